"""ModelSpec: the shape of a decoder (from a name or a Hugging Face config.json) and its size arithmetic."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The numbers of a Llama-style decoder the simulators need (no weights)."""

    name: str
    """Label shown in plans and errors (a known name or the config's directory)."""
    hidden_size: int
    """Width h of the residual stream."""
    num_layers: int
    """Decoder layers L."""
    num_heads: int
    """Query heads; tensor-parallel sizes must divide it."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than num_heads); sizes the KV cache."""
    intermediate_size: int
    """Width of the gated MLP."""
    vocab_size: int
    """Rows of the embedding and of the output head."""
    tie_word_embeddings: bool = False
    """Whether the output head shares the embedding matrix."""
    attention_head_dim: int | None = None
    """Width of one attention head when the config sets it apart from hidden_size / num_heads (Qwen3, Gemma 3)."""
    num_experts: int = 0
    """Experts of each mixture-of-experts layer (Qwen3-MoE); 0: a dense MLP of intermediate_size."""
    moe_intermediate_size: int = 0
    """Width of one expert's gated MLP."""

    def __post_init__(self) -> None:
        for field_name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                           "vocab_size"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec.{field_name} must be a positive integer, got {value!r}")
        if self.attention_head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"ModelSpec.hidden_size {self.hidden_size} must be divisible by "
                             f"num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec.num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values) of one token in one layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        attention = 2 * self.hidden_size * self.num_heads * self.head_dim + 2 * self.hidden_size * self.kv_dim
        # every expert counts (memory; the simulators also take it as the compute, an upper bound for MoE)
        mlp = (self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size + self.hidden_size)
               if self.num_experts else 3 * self.hidden_size * self.intermediate_size)
        return attention + mlp + 2 * self.hidden_size  # + the two RMSNorm weights

    def num_params(self, *, head: str = "lm") -> int:
        """All parameters with an ``lm`` (vocabulary) head or a ``value`` (one scalar) head."""
        body = self.vocab_size * self.hidden_size + self.num_layers * self.params_per_layer + self.hidden_size
        return body + self.head_params(head)

    def matmul_params(self, *, head: str = "lm") -> int:
        """Parameters that take part in a matrix multiply per token (the embedding is a lookup)."""
        return self.num_layers * self.params_per_layer + self.head_params(head)

    def head_params(self, head: str) -> int:
        if head == "lm":
            return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        if head == "value":
            return self.hidden_size + 1
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")


# Public shapes. Llama-2 7B/13B/70B (Touvron et al. 2023); 34B is Code Llama 34B, the only public
# Llama-2-architecture 34B, as in the HybridFlow paper. "tiny" is hybridflow.models.tiny.TINY_DEFAULTS.
KNOWN_MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(name="tiny", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      intermediate_size=128, vocab_size=256),
    "llama-7b": ModelSpec(name="llama-7b", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                          intermediate_size=11008, vocab_size=32000),
    "llama-13b": ModelSpec(name="llama-13b", hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                           intermediate_size=13824, vocab_size=32000),
    "llama-34b": ModelSpec(name="llama-34b", hidden_size=8192, num_layers=48, num_heads=64, num_kv_heads=8,
                           intermediate_size=22016, vocab_size=32000),
    "llama-70b": ModelSpec(name="llama-70b", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                           intermediate_size=28672, vocab_size=32000),
}


def spec_from_hf_config(config: dict, *, name: str) -> ModelSpec:
    """A ModelSpec from the fields of a Hugging Face ``config.json`` of a supported family (``head_dim`` where
    set, the experts of Qwen3-MoE)."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"config of {name!r} lacks {missing}; a decoder config.json needs {list(required)}")
    return ModelSpec(
        name=name,
        hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
    )


def model_spec(name_or_path: str | ModelSpec) -> ModelSpec:
    """A known model by name, or the model of a local directory (or file) holding ``config.json``."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    key = str(name_or_path).lower()
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    path = Path(name_or_path)
    config_path = path / "config.json" if path.is_dir() else path
    if config_path.is_file():
        with open(config_path) as handle:
            return spec_from_hf_config(json.load(handle), name=path.name if path.is_dir() else path.parent.name)
    raise ValueError(f"unknown model {name_or_path!r}: not a known name and no config.json there; "
                     f"known: {', '.join(KNOWN_MODELS)}, or a local Hugging Face model directory")
