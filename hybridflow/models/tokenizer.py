"""load_tokenizer: the tokenizer of a local model directory, with a pad token and a chosen padding side."""

from __future__ import annotations

import os
import warnings

from transformers import AutoTokenizer, PreTrainedTokenizerBase

PADDING_SIDES = ("left", "right")


def load_tokenizer(path: str, *, padding_side: str = "left",
                   trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """AutoTokenizer from the local directory ``path``.

    ``padding_side`` defaults to "left": prompts are left-padded so every response starts at the same
    position (the shared batch convention); pass "right" for SFT/reward-model batches if preferred.
    A tokenizer without a pad token gets its EOS token as pad token, with a warning; the attention
    mask, not the pad id, marks padding everywhere in hybridflow.
    """
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path!r} does not exist (a local Hugging Face model directory "
                         f"is expected; nothing is downloaded)")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {path!r} has neither a pad token nor an EOS token to pad with")
        warnings.warn(f"tokenizer at {path!r} has no pad token; using its EOS token {tokenizer.eos_token!r}",
                      stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
