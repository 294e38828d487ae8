"""RoleStrategy: one role's parallel layout (fsdp, or 3d with p and t; the actor's generation pg, tg)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from hybridflow.mapping.layouts import TRAINING_LAYOUTS, LayoutModel, training_layout
from hybridflow.mapping.model_spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class RoleStrategy:
    """A role's layout on its pool; data parallelism fills the rest (d = devices / (p * t))."""

    layout: str = "3d"
    """'fsdp' (all state sharded over data parallel ranks; p = t = 1) or '3d' (Megatron-style p, t, d): a name of
    hybridflow.mapping.layouts.TRAINING_LAYOUTS (``layout_model``)."""
    pp_size: int = 1
    """Training (and inference) pipeline stages p."""
    tp_size: int = 1
    """Training (and inference) tensor-parallel size t."""
    generation_pp_size: int = 0
    """Actor only: generation pipeline stages pg (divides p); 0 for roles that do not generate."""
    generation_tp_size: int = 0
    """Actor only: generation tensor-parallel size tg (divides t); 0 for roles that do not generate."""

    def __post_init__(self) -> None:
        layout = training_layout(self.layout)
        for name in ("pp_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RoleStrategy.{name} must be a positive integer, got {value!r}")
        layout.check(self)
        generates = (self.generation_pp_size, self.generation_tp_size)
        if generates != (0, 0):
            if min(generates) < 1:
                raise ValueError(f"RoleStrategy: generation sizes must both be 0 (no generation) or both >= 1, "
                                 f"got pg={self.generation_pp_size}, tg={self.generation_tp_size}")
            if self.pp_size % self.generation_pp_size or self.tp_size % self.generation_tp_size:
                raise ValueError(f"RoleStrategy: generation pp_size {self.generation_pp_size} must divide pp_size "
                                 f"{self.pp_size} and generation tp_size {self.generation_tp_size} must divide "
                                 f"tp_size {self.tp_size} (3D-HybridEngine)")

    @property
    def layout_model(self) -> LayoutModel:
        """The cost model of ``layout`` (what the simulator asks instead of the name)."""
        return TRAINING_LAYOUTS[self.layout]

    @property
    def model_parallel_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def generates(self) -> bool:
        return self.generation_tp_size > 0

    def dp_size(self, num_devices: int) -> int:
        return num_devices // self.model_parallel_size

    def describe(self) -> str:
        text = self.layout_model.describe(self)
        if self.generates:
            text += f" gen p{self.generation_pp_size} t{self.generation_tp_size}"
        return text


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def training_strategies(spec: ModelSpec, *, num_devices: int, node_size: int) -> Iterator[RoleStrategy]:
    """Every layout of one model on ``num_devices``: fsdp, and 3d with t inside a node dividing the heads."""
    yield RoleStrategy(layout="fsdp")
    for tp_size in _divisors(num_devices):
        if tp_size > node_size or node_size % tp_size or spec.num_heads % tp_size:
            continue
        if spec.num_kv_heads % tp_size and tp_size % spec.num_kv_heads:
            continue
        for pp_size in _divisors(num_devices // tp_size):
            if pp_size <= spec.num_layers:
                yield RoleStrategy(layout="3d", pp_size=pp_size, tp_size=tp_size)


def generation_strategies(train: RoleStrategy) -> Iterator[RoleStrategy]:
    """The actor's generation sizes on a training layout: pg | p and tg | t (the hybrid engine's rule)."""
    for generation_pp_size in _divisors(train.pp_size):
        for generation_tp_size in _divisors(train.tp_size):
            yield RoleStrategy(layout=train.layout, pp_size=train.pp_size, tp_size=train.tp_size,
                               generation_pp_size=generation_pp_size, generation_tp_size=generation_tp_size)
