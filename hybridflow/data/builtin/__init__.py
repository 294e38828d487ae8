"""The built-in arithmetic task with its shipped character-level tokenizer and tiny Llama config."""

from __future__ import annotations

from pathlib import Path

from hybridflow.data.builtin.arithmetic import (
    ArithmeticTaskConfig,
    Problem,
    carry_free_sum,
    parse_prompt,
    plausible_wrong_answer,
    preference_rows,
    prompt_rows,
    sample_problems,
    score,
    sft_rows,
)

ASSETS_DIR = Path(__file__).parent / "assets"
"""A Hugging Face style directory: tokenizer.json + tokenizer_config.json + config.json (no weights)."""


def builtin_tokenizer():
    """The task's character-level tokenizer as a transformers fast tokenizer (pad/bos/eos set, left padding)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS_DIR))


def builtin_model_config():
    """The tiny Llama config (hidden 128, 4 layers, 4 heads) sized to the task's vocabulary."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(ASSETS_DIR))


__all__ = [
    "ASSETS_DIR",
    "ArithmeticTaskConfig",
    "Problem",
    "builtin_model_config",
    "builtin_tokenizer",
    "carry_free_sum",
    "parse_prompt",
    "plausible_wrong_answer",
    "preference_rows",
    "prompt_rows",
    "sample_problems",
    "score",
    "sft_rows",
]
