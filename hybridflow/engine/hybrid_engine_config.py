"""HybridEngineConfig: the actor's generation layout and transition strategy (no torch: configs load fast)."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("pp_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.strategy == "full_gather" and (self.pp_size, self.tp_size) != (1, 1):
            raise ValueError(f"strategy 'full_gather' generates with the whole model on each rank: pp_size and "
                             f"tp_size must be 1, got pp_size={self.pp_size}, tp_size={self.tp_size}")
