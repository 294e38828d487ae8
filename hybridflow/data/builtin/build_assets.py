"""Build the built-in task's shipped files: the character-level tokenizer and the tiny Llama config.

The package ships the output in `assets/`, so nothing is built or downloaded at run time.
`python -m hybridflow.data.builtin.build_assets --out DIR` writes the files into DIR, `--check`
compares a fresh build with the shipped files, and only `--in-package` rewrites `assets/` itself
(for a developer changing the tokenizer or the model config).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, processors

ASSETS_DIR = Path(__file__).parent / "assets"

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
# Every character the task writes, one token each; a few spare symbols keep the tokenizer usable
# for variants of the task (multiplication, spaces, parentheses) without rebuilding it.
CHARACTERS = list("0123456789+-*=() ")
# Embedding rows are padded to a multiple of 8 so that tensor parallelism up to tp=8 can split
# the vocabulary dimension evenly (see parallel/sharding.py); the extra rows are never produced.
VOCAB_MULTIPLE = 8

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "use_cache": True,
    "torch_dtype": "float32",
}


def build_tokenizer() -> Tokenizer:
    """A character-level tokenizer: BPE with no merges splits text into single characters."""
    specials = [SPECIAL_TOKENS[key] for key in ("pad_token", "bos_token", "eos_token", "unk_token")]
    vocab = {token: index for index, token in enumerate(specials + CHARACTERS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.add_special_tokens(specials)
    bos = SPECIAL_TOKENS["bos_token"]
    # Like Llama: encoding a prompt prepends <bos>; responses are encoded with add_special_tokens=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def write_assets(directory: Path = ASSETS_DIR) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and config.json."""
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), padding_side="left", **SPECIAL_TOKENS)
    fast.model_max_length = TINY_LLAMA["max_position_embeddings"]
    fast.save_pretrained(str(directory))
    vocab_size = -(-len(fast) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = dict(
        TINY_LLAMA,
        vocab_size=vocab_size,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def differing_assets(directory: Path = ASSETS_DIR) -> list[str]:
    """Names of the files in ``directory`` whose content differs from a fresh build (missing ones included)."""
    with tempfile.TemporaryDirectory() as fresh:
        write_assets(Path(fresh))
        return [path.name for path in sorted(Path(fresh).iterdir())
                if not (directory / path.name).is_file()
                or _content(directory / path.name) != _content(path)]


def _content(path: Path):
    # JSON files compare by value: key order and indentation may differ between transformers versions
    return json.loads(path.read_text()) if path.suffix == ".json" else path.read_bytes()


def main(argv: list[str] | None = None) -> int:
    """The command line: exactly one of ``--out DIR``, ``--check`` and ``--in-package``."""
    parser = argparse.ArgumentParser(
        prog="python -m hybridflow.data.builtin.build_assets",
        description="Build the built-in task's tokenizer and tiny model config (the files the package ships in "
                    f"{ASSETS_DIR}).")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", metavar="DIR", help="write the files into DIR (created if missing)")
    action.add_argument("--check", action="store_true",
                        help="build into a temporary folder and compare with the shipped files (exit 1 if they differ)")
    action.add_argument("--in-package", action="store_true",
                        help=f"rewrite the shipped files in {ASSETS_DIR} (developers only)")
    args = parser.parse_args(argv)
    if args.check:
        differing = differing_assets()
        if differing:
            print(f"differ from a fresh build: {', '.join(differing)} (in {ASSETS_DIR})")
            return 1
        print(f"the shipped files in {ASSETS_DIR} match a fresh build")
        return 0
    directory = ASSETS_DIR if args.in_package else Path(args.out)
    write_assets(directory)
    print(f"wrote {sorted(path.name for path in directory.iterdir())} to {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
