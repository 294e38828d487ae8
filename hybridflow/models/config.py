"""ModelConfig: which model to build (a local Hugging Face directory or a tiny random one), in which dtype."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hybridflow.models.families import check_family

HEADS = ("lm", "value", "score")
"""What a role's model ends in (the role decides: ``build_model(config, head=...)``). "lm": causal LM (logits over
the vocabulary). "value": scalar per token (critic). "score": scalar per token read at the last real token
(reward/cost model). value and score share one module (``*ForTokenClassification`` with one label); they differ
in how the engine reads it."""
DTYPES = ("auto", "float32", "bfloat16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


BUILTIN_MODELS = ("arithmetic",)
"""Names ``ModelConfig.builtin`` accepts."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Where a role's model comes from and how it is built. Exactly one of ``path``, ``tiny`` and ``builtin`` is
    set (``build_model`` takes ``path`` or ``tiny``; the trainers resolve ``builtin`` into ``tiny``)."""

    ALTERNATIVES: ClassVar[tuple[tuple[str, ...], ...]] = (("path", "tiny", "builtin"),)
    """Keys of which exactly one is set: an override of one replaces the others set in the YAML."""

    path: str | None = None
    """Local Hugging Face model directory (config.json + safetensors). Nothing is fetched from a hub."""

    tiny: dict[str, Any] | None = None
    """Build a tiny randomly initialised model instead: overrides of ``tiny_config`` (``{}`` for the defaults)."""

    builtin: str | None = None
    """Name of a built-in tiny model (``arithmetic``: the built-in task's model and tokenizer), randomly
    initialised from the trainer's seed."""

    tokenizer_path: str | None = None
    """Tokenizer directory when it differs from ``path`` (default: ``path``, or the built-in's tokenizer)."""

    family: str | None = None
    """Decoder family: llama, mistral, qwen2, qwen3, qwen3_moe or gemma3_text (docs/models.md). Detected from
    config.json for ``path`` (a mismatch is an
    error); for ``tiny`` it picks the architecture (default llama)."""

    dtype: str = "auto"
    """Parameter dtype: "float32", "bfloat16", or "auto" = float32 on every device (the engines keep fp32
    master weights; low-precision compute is the engine's ``dtype``, so checkpoints load bit-exactly)."""

    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers: "sdpa", "eager" or "flash_attention_2" (CUDA only)."""

    trust_remote_code: bool = False
    """Passed to transformers; the supported families never need remote code."""

    def __post_init__(self) -> None:
        given = [name for name in self.ALTERNATIVES[0] if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"config key path needs exactly one of path, tiny and builtin; got "
                             f"path={self.path!r}, tiny={self.tiny!r}, builtin={self.builtin!r}")
        if self.builtin is not None and self.builtin not in BUILTIN_MODELS:
            raise ValueError(f"config key builtin got {self.builtin!r}; allowed: {', '.join(BUILTIN_MODELS)}")
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ValueError(f"ModelConfig.path must be a non-empty string, got {self.path!r}")
        if self.tiny is not None:
            if not isinstance(self.tiny, Mapping):
                raise ValueError(
                    f"ModelConfig.tiny must be a dict of config overrides, got {type(self.tiny).__name__}"
                )
            # a plain dict even when built from an OmegaConf node; the dataclass stays frozen
            object.__setattr__(self, "tiny", dict(self.tiny))
        if self.family is not None:
            check_family(self.family, source="ModelConfig.family")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"ModelConfig.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                f"got {self.attn_implementation!r}"
            )
