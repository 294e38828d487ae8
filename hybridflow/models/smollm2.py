"""Where the converted SmolLM2-135M-Instruct checkpoint lives (made by scripts/get_smollm2.py)."""

from __future__ import annotations

import os

SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def smollm2_default_dir() -> str:
    """``$HYBRIDFLOW_SMOLLM2_DIR`` if set, else ``${HYBRIDFLOW_CACHE:-~/.cache/hybridflow}/SmolLM2-135M-Instruct``."""
    explicit = os.environ.get("HYBRIDFLOW_SMOLLM2_DIR")
    if explicit:
        return explicit
    cache = os.environ.get("HYBRIDFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridflow")
    return os.path.join(cache, SMOLLM2_NAME)


def is_converted(directory: str) -> bool:
    """True when ``directory`` holds a complete converted checkpoint (config, weights, tokenizer)."""
    needed = ("config.json", "model.safetensors", "tokenizer.json")
    return all(os.path.isfile(os.path.join(directory, name)) for name in needed)


def smollm2_path() -> str | None:
    """The converted SmolLM2-135M-Instruct directory, or None when it has not been converted yet."""
    directory = smollm2_default_dir()
    return directory if is_converted(directory) else None
