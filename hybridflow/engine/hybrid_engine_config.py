"""HybridEngineConfig: the actor's generation layout and transition strategy (no torch: configs load fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

STRATEGIES = ("hybrid", "vanilla", "full_gather")  # the classes: hybrid_engine.TRANSITION_STRATEGIES


@dataclass(frozen=True, kw_only=True)
class HybridEngineConfig:
    """The actor's generation layout and how to get there from the training layout."""

    pp_size: int = 1
    """pg: generation pipeline stages; divides the training pp_size."""
    tp_size: int = 1
    """tg: generation tensor-parallel size; divides the training tp_size."""
    strategy: Literal["hybrid", "vanilla", "full_gather"] = "hybrid"
    """How the actor goes from its training shards to its generation shards: ``hybrid`` (the paper's
    zero-redundancy grouping), or a baseline for measurement: ``vanilla`` (consecutive generation TP groups,
    a redundant copy) or ``full_gather`` (every rank gathers the whole model, as DeepSpeed-Chat does; needs
    pp_size = tp_size = 1)."""
    bucket_mb: float = 256.0
    """Transition collectives carry buckets of parameters: each rank flattens up to this many MiB of its
    pieces into one buffer, so a transition issues one all-gather (or broadcast) per bucket per group instead
    of one per parameter. The bytes moved and the generation weights are the same; 0 = one collective per
    parameter."""
    offload_optimizer: bool = False
    """Move the actor's optimizer state (AdamW moments) to CPU memory (pinned on CUDA) before each rollout and
    back after it, so that generation's KV cache can use that memory. A no-op when the actor trains on the CPU
    (``actor.transition_stats()`` then reports ``optimizer_offloaded: 0``)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("pp_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (not isinstance(self.bucket_mb, (int, float)) or isinstance(self.bucket_mb, bool)
                or not math.isfinite(self.bucket_mb) or self.bucket_mb < 0):
            raise ValueError(f"bucket_mb must be a finite number >= 0 (0 = one collective per parameter), "
                             f"got {self.bucket_mb!r}")
        if not isinstance(self.offload_optimizer, bool):
            raise ValueError(f"offload_optimizer must be a bool, got {self.offload_optimizer!r}")
        if self.strategy == "full_gather" and (self.pp_size, self.tp_size) != (1, 1):
            raise ValueError(f"strategy 'full_gather' generates with the whole model on each rank: pp_size and "
                             f"tp_size must be 1, got pp_size={self.pp_size}, tp_size={self.tp_size}")
