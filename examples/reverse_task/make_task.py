"""Your own task and model, from nothing: reverse a digit string, a character-level tokenizer and a tiny Llama.

    python examples/reverse_task/make_task.py runs/reverse

writes the data files (SFT rows, RL prompts, held-out prompts), ``tokenizer/`` and ``base/`` (a random tiny
Llama with that tokenizer) under the given directory. docs/tutorial.md walks the rest.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = list("0123456789=")


def build_tokenizer():
    """One token per character; ``<s>`` opens every encoded text; padding on the left (for generation)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    core.decoder = decoders.Fuse()  # characters are joined without spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")


def build_model(tokenizer, seed: int = 0):
    """A 4-layer Llama (hidden 128) sized to the tokenizer, randomly initialised."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def problems(count: int, *, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """Digit strings of 3 to 6 digits and their reversal: {"prompt": "4821=", "answer": "1284"}."""
    generator, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < count:
        digits = "".join(generator.choice("0123456789") for _ in range(generator.randint(3, 6)))
        if digits not in seen:
            seen.add(digits)
            rows.append({"prompt": f"{digits}=", "answer": digits[::-1]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(out: str, *, num_sft: int = 2000, num_prompts: int = 2000, num_val: int = 100) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    val = problems(num_val, seed=1)
    held_out = {row["prompt"][:-1] for row in val}
    train = problems(num_sft + num_prompts, seed=0, exclude=held_out)
    # SFT rows carry the target as `response`; `answer` is kept for the reward function
    write_jsonl(root / "sft.jsonl", [{**row, "response": row["answer"]} for row in train[:num_sft]])
    write_jsonl(root / "sft_val.jsonl", [{**row, "response": row["answer"]} for row in val])
    write_jsonl(root / "train.jsonl", train[num_sft:])
    write_jsonl(root / "val.jsonl", val)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(root / "tokenizer"))
    model = build_model(tokenizer)
    model.save_pretrained(str(root / "base"))
    tokenizer.save_pretrained(str(root / "base"))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"wrote {root}: {num_sft} SFT rows, {num_prompts} RL prompts, {num_val} held-out prompts, "
          f"a {len(tokenizer)}-token tokenizer and a {parameters / 1e6:.2f}M-parameter Llama in {root / 'base'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/reverse_task/make_task.py OUT_DIR")
    main(sys.argv[1])
