"""A tiny chat model for multi-turn episodes: a character-level BPE tokenizer with a ChatML chat template that
offers tools (hermes ``<tool_call>`` format) and a random 4-layer Llama sized to it, plus calculator questions.

    python examples/episodes/make_chat_model.py runs/episodes

writes ``base/`` (model and tokenizer), ``train.jsonl`` and ``val.jsonl`` (rows of
``examples/agents/calculator_env.py``) under the given directory. docs/tutorial.md ("Several turns with a tool")
trains it with ``examples/episodes/calculator_grpo.yaml``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHARACTERS = [chr(code) for code in range(32, 127)] + ["\n"]
SPECIAL = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
TOOL_HEADER = ("{% if tools %}<|im_start|>system\nTools (call one as <tool_call>{\"name\": ..., \"arguments\": "
               "{...}}</tool_call>):{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}")
CHATML = (TOOL_HEADER + "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML: each message between <|im_start|>role and <|im_end|>; the tools' names in a system turn first."""


def chat_tokenizer(template: str = CHATML, *, merge_newlines: bool = False):
    """One token per printable character plus the ChatML specials; ``merge_newlines``: each character also merges
    with a following newline into one token (a tokenizer whose merges join a turn's end with the next text)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL + CHARACTERS)}
    merges = []
    if merge_newlines:
        for character in CHARACTERS[:-1]:
            merges.append((character, "\n"))
            vocab[character + "\n"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.add_special_tokens(SPECIAL)
    core.decoder = decoders.Fuse()  # characters are joined without spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", padding_side="left")
    tokenizer.chat_template = template
    return tokenizer


def build_model(tokenizer, seed: int = 0):
    """A 4-layer Llama (hidden 64) sized to the tokenizer, randomly initialised; <|im_end|> ends a turn."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return LlamaForCausalLM(config)


def main(out: str, *, num_train: int = 256, num_val: int = 16) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
    from calculator_env import make_rows

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    rows = make_rows(num_train + num_val, seed=0)
    for name, part in (("train.jsonl", rows[:num_train]), ("val.jsonl", rows[num_train:])):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    tokenizer = chat_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(str(root / "base"))
    tokenizer.save_pretrained(str(root / "base"))
    print(f"wrote {root}: {num_train} training and {num_val} held-out calculator questions, a {len(tokenizer)}-token "
          f"chat tokenizer and a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter Llama in "
          f"{root / 'base'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/episodes/make_chat_model.py OUT_DIR")
    main(sys.argv[1])
