"""LoraConfig: which linear layers get a LoRA adapter, of which rank, scale and dropout (no torch needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a decoder layer of the supported families (PEFT's "all-linear" without the output head)."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """A LoRA adapter (Hu et al. 2021) on a trained role's model: each targeted linear layer computes
    ``x W^T + (alpha / rank) * dropout(x) A^T B^T`` with the base weight W frozen and only A [rank, in] and
    B [out, rank] trained (B starts at zero, so training starts from the base model). The same adapter PEFT
    builds for ``peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=...)``."""

    rank: int = 8
    """Rank r of the update B A (PEFT's ``r``)."""
    alpha: float = 16.0
    """Scale numerator: the update is multiplied by alpha / rank (PEFT's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training, in [0, 1) (PEFT's ``lora_dropout``)."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Names of the linear layers to adapt, matched as PEFT matches a list: a module whose name is the entry or
    ends with ``.<entry>`` (``q_proj`` adapts every layer's ``self_attn.q_proj``). Only linear layers inside the
    decoder layers can be adapted (not the embedding or the output head)."""
    export_merged: bool = False
    """Export also writes the merged model (W + scale B A, a plain Hugging Face directory) to
    ``<export dir>/<role>/merged`` beside the adapter (PEFT's adapter_config.json + adapter_model.safetensors)."""
    vllm_sync: Literal["adapter", "merged"] = "adapter"
    """The actor's, with ``generation.backend: vllm`` (a critic generates nothing): what each weight sync hands
    vLLM. ``adapter``: the base weights once, then only A and B per sync, generated as a vLLM LoRA request (vLLM
    keeps its copy of the base weights between rollouts); ``merged``: the whole generation shard with W + scale B A
    merged in, as full fine-tuning syncs it (vLLM's weights are released for training). The native backend always
    reads the merged shard (docs/lora.md)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"config key rank got {self.rank!r}; allowed: an integer >= 1")
        if (not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not math.isfinite(self.alpha)
                or self.alpha <= 0):
            raise ValueError(f"config key alpha got {self.alpha!r}; allowed: a finite number > 0")
        if (not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool)
                or not 0 <= self.dropout < 1):
            raise ValueError(f"config key dropout got {self.dropout!r}; allowed: a number in [0, 1)")
        targets = self.target_modules
        if isinstance(targets, str) or not isinstance(targets, (tuple, list)) or not targets or not all(
                isinstance(name, str) and name and not name.startswith(".") for name in targets):
            raise ValueError(f"config key target_modules got {targets!r}; allowed: a non-empty list of module "
                             f"names such as {list(DEFAULT_TARGETS)}")
        object.__setattr__(self, "target_modules", tuple(targets))
        if not isinstance(self.export_merged, bool):
            raise ValueError(f"config key export_merged got {self.export_merged!r}; allowed: true or false")
        if self.vllm_sync not in ("adapter", "merged"):
            raise ValueError(f"config key vllm_sync got {self.vllm_sync!r}; allowed: adapter, merged")

    @property
    def scale(self) -> float:
        """alpha / rank: the factor on B A."""
        return self.alpha / self.rank
