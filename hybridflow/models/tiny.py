"""Tiny randomly initialised decoders of the supported families, for tests and the CPU demo."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

from hybridflow.models.families import check_family, family_config_class

# Small enough to train in seconds on one CPU core, shaped like a real decoder: grouped-query
# attention (4 query heads share 2 key/value heads), a gated MLP, rotary positions. The head counts,
# intermediate size and vocabulary (256) divide by tensor-parallel sizes 1 and 2 (4 with 4 kv heads).
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # Qwen3's config defaults head_dim to 128 whatever the hidden size: keep hidden / heads like the others
    "qwen3": {"head_dim": 16},
    # eight experts of a quarter of the dense width, two per token (Qwen3-30B-A3B: 128 experts, 8 per token)
    "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True},
    # Gemma 3: hidden / heads wide heads, the score scale of that width, a window shorter than the test sequences
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4},
}
"""Per-family additions to ``TINY_DEFAULTS`` (fields whose family default does not fit a 64-wide model)."""


def tiny_config(family: str = "llama", **overrides: Any) -> PretrainedConfig:
    """A Hugging Face config of a tiny ``family`` decoder: ``TINY_DEFAULTS`` updated by ``overrides``.

    Overrides are any fields of that family's transformers config (e.g. ``num_hidden_layers=2``,
    ``tie_word_embeddings=True``); an unknown field is a ValueError.
    """
    config_cls = family_config_class(check_family(family, source="tiny_config(family=...)"))
    # the fields of the family's defaults too (Qwen3-MoE's config lists head_dim only once it is set)
    known = set(config_cls().to_dict()) | set(FAMILY_DEFAULTS.get(family, {}))
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"tiny_config got unknown {family} config fields {unknown}; "
                         f"known fields include {sorted(TINY_DEFAULTS)}")
    values = {**TINY_DEFAULTS, **FAMILY_DEFAULTS.get(family, {}), **overrides}
    if family == "mistral":
        values.setdefault("sliding_window", None)  # full attention, like the other families
    if family == "gemma3_text" and "layer_types" not in overrides:
        # sliding and full layers alternate (the real models have five sliding layers per full one)
        values["layer_types"] = ["full_attention" if i % 2 else "sliding_attention"
                                 for i in range(values["num_hidden_layers"])]
    try:
        return config_cls(**values)
    except StrictDataclassError as error:  # transformers' own shape checks, e.g. heads not dividing hidden
        raise ValueError(f"tiny {family} config {overrides} is inconsistent: {error}") from error


@contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Seed torch's CPU random generator with ``seed`` inside the block and restore it afterwards.

    Model construction draws its initial weights from that generator, so building inside this block
    gives the same weights on every rank and leaves the caller's random stream untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_tiny_model(family: str = "llama", *, head: str = "lm", seed: int = 0,
                     dtype: str = "float32", **overrides: Any) -> torch.nn.Module:
    """A tiny randomly initialised model (shorthand for ``build_model(ModelConfig(tiny=overrides, ...), ...)``)."""
    # imported here: the loader itself builds tiny models from this module's config and seeding
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.loader import build_model

    return build_model(ModelConfig(tiny=overrides, family=family, dtype=dtype), head=head, seed=seed)
