"""Identical inputs for both sides: character tokenizer, random-init Llama model directories, prompt file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=32),
}
"""Random-init Llama shapes (the character vocabulary of the built-in arithmetic task)."""


def build_model_dir(name: str, directory: Path, *, seed: int = 0) -> Path:
    """A Hugging Face directory: the built-in character tokenizer and random weights from ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.data.builtin import ASSETS_DIR

    target = directory / name
    if (target / "model.safetensors").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in ASSETS_DIR.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            shutil.copy(path, target / path.name)
    base = json.loads((ASSETS_DIR / "config.json").read_text())
    config = LlamaConfig(**{**base, **MODELS[name], "max_position_embeddings": 128})
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(target))
    return target


def build_score_model_dir(policy_dir: Path, directory: Path, *, seed: int = 0) -> Path:
    """The PPO reward model and value-model init: the policy's backbone under a one-label scalar head.

    Saved as ``LlamaForTokenClassification`` (what hybridflow's critic and reward workers load, head
    ``score`` with a bias) with the head drawn from ``seed`` and the bias zeroed, so TRL's
    ``AutoModelForSequenceClassification`` (the same ``score`` weight, no bias) computes the same
    function. Both sides load this one directory for the reward model and for the value model.
    """
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as transformers_logging

    target = directory / f"{policy_dir.name}-score"
    if (target / "model.safetensors").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in policy_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            shutil.copy(path, target / path.name)
    config = AutoConfig.from_pretrained(str(policy_dir), num_labels=1)
    config.classifier_dropout = 0.0
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the load report lists the new head and the unused lm_head
    try:
        model = AutoModelForTokenClassification.from_pretrained(str(policy_dir), config=config, dtype=torch.float32)
    finally:
        transformers_logging.set_verbosity(verbosity)
    generator = torch.Generator().manual_seed(seed)
    hidden = model.score.in_features
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=generator) / (hidden + 1))
        model.score.bias.zero_()
    model.save_pretrained(str(target))
    return target


def build_prompts(path: Path, count: int, *, seed: int = 0) -> Path:
    """``count`` addition prompts ("a+b=") as JSON lines with a ``prompt`` field."""
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows

    if not path.exists():
        write_jsonl(path, [{"prompt": row["prompt"]} for row in
                           prompt_rows(count, split="train", seed=seed, config=ArithmeticTaskConfig())])
    return path


def policy_dir(name: str, directory: Path) -> Path:
    """The policy of a benchmark model name: a random-init ``MODELS`` entry built under ``directory``, or the
    converted SmolLM2-135M-Instruct for ``smollm2`` (exits naming scripts/get_smollm2.py when it is missing)."""
    if name != "smollm2":
        return build_model_dir(name, directory)
    from hybridflow.models import smollm2_path

    if smollm2_path() is None:
        raise SystemExit("SmolLM2-135M-Instruct is not converted: run python scripts/get_smollm2.py")
    return Path(smollm2_path())
