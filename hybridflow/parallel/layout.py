"""Rank arithmetic for parallel layouts: training (p, t, d) and generation (pg, tg, dg) meshes.

Pure integer arithmetic, no process groups, so it is unit-tested on its own and shared by the
controller (transfer protocols), the engines and the 3D-HybridEngine.

Rank order (same as ``init_device_mesh(("dp", "pp", "tp"), (d, p, t))``): tp varies fastest, then
pp, then dp, so one data-parallel replica of the model is a consecutive block of p*t ranks and a
training TP group is a consecutive block of t ranks:

    rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank

Generation grouping inside each training replica (paper section 5.3, DESIGN.md section 4):
``hybrid`` (the paper's): generation TP groups take ranks at stride t/tg inside each training TP
group, generation PP stages at stride p/pg, and the micro-DP groups are consecutive, so every rank's
training shard lies inside its generation shard. ``vanilla``: generation TP groups are consecutive
and micro-DP groups strided (the baseline the paper compares against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GROUPINGS = ("hybrid", "vanilla")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers held by training pipeline stage ``pp_rank`` of ``pp_size``.

    Consecutive chunks as equal as possible; the first ``num_layers % pp_size`` stages get one more.
    Stage 0 also holds the input embedding, the last stage the final norm and output head. A
    generation stage of the hybrid engine holds the union of the training stages it covers.
    """
    _check_positive("num_layers", num_layers)
    _check_positive("pp_size", pp_size)
    if pp_size > num_layers:
        raise ValueError(f"pp_size {pp_size} is larger than the model's {num_layers} layers; "
                         f"allowed: 1..{num_layers}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside 0..{pp_size - 1}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in a training mesh."""

    dp_rank: int
    pp_rank: int
    tp_rank: int


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """A training layout of ``pp_size * tp_size * dp_size`` ranks."""

    pp_size: int = 1
    """Pipeline-parallel stages (layers split into consecutive chunks)."""
    tp_size: int = 1
    """Tensor-parallel ranks (each weight matrix split in tp_size shards)."""
    dp_size: int = 1
    """Data-parallel replicas (each holds a full copy of its (pp, tp) shard)."""

    def __post_init__(self) -> None:
        for name in ("pp_size", "tp_size", "dp_size"):
            _check_positive(name, getattr(self, name))

    @classmethod
    def for_world(cls, world_size: int, *, pp_size: int = 1, tp_size: int = 1) -> "ParallelLayout":
        """The layout with the given model-parallel sizes that fills ``world_size`` with data parallelism."""
        _check_positive("world_size", world_size)
        _check_positive("pp_size", pp_size)
        _check_positive("tp_size", tp_size)
        if world_size % (pp_size * tp_size):
            raise ValueError(
                f"world_size {world_size} is not divisible by pp_size*tp_size = {pp_size}*{tp_size}; "
                f"allowed: a multiple of {pp_size * tp_size}"
            )
        return cls(pp_size=pp_size, tp_size=tp_size, dp_size=world_size // (pp_size * tp_size))

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size * self.dp_size

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        tp_rank = rank % self.tp_size
        pp_rank = (rank // self.tp_size) % self.pp_size
        dp_rank = rank // (self.tp_size * self.pp_size)
        return RankCoords(dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank)

    def rank_of(self, *, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp_size + pp_rank) * self.tp_size + tp_rank

    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing (dp, pp): each list is one tensor-parallel group."""
        return [[self.rank_of(dp_rank=d, pp_rank=p, tp_rank=t) for t in range(self.tp_size)]
                for d in range(self.dp_size) for p in range(self.pp_size)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks sharing (dp, tp): each list is one pipeline, stage 0 first."""
        return [[self.rank_of(dp_rank=d, pp_rank=p, tp_rank=t) for p in range(self.pp_size)]
                for d in range(self.dp_size) for t in range(self.tp_size)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks sharing (pp, tp): each list holds the replicas of one shard."""
        return [[self.rank_of(dp_rank=d, pp_rank=p, tp_rank=t) for d in range(self.dp_size)]
                for p in range(self.pp_size) for t in range(self.tp_size)]


@dataclass(frozen=True)
class GenerationCoords:
    """Where one rank sits in the generation mesh of the hybrid engine."""

    replica: int
    """Global generation replica (0 .. dp_size*micro_dp_size-1); each gets its own slice of prompts."""
    micro_dp_rank: int
    """Index of the replica inside its training replica (0 .. micro_dp_size-1)."""
    gen_pp_rank: int
    gen_tp_rank: int


@dataclass(frozen=True, kw_only=True)
class GenerationLayout:
    """The actor's generation layout (pg, tg) on the same ranks as its training layout (p, t, d)."""

    train: ParallelLayout
    """The training layout these ranks also train with."""
    pp_size: int = 1
    """pg: pipeline stages during generation; must divide the training pp_size."""
    tp_size: int = 1
    """tg: tensor-parallel size during generation; must divide the training tp_size."""
    grouping: Literal["hybrid", "vanilla"] = "hybrid"
    """'hybrid': the paper's strided generation groups (zero redundancy); 'vanilla': consecutive."""

    def __post_init__(self) -> None:
        _check_positive("generation pp_size", self.pp_size)
        _check_positive("generation tp_size", self.tp_size)
        if self.train.tp_size % self.tp_size:
            raise ValueError(f"generation tp_size {self.tp_size} must divide the training tp_size "
                             f"{self.train.tp_size}; allowed: divisors of {self.train.tp_size}")
        if self.train.pp_size % self.pp_size:
            raise ValueError(f"generation pp_size {self.pp_size} must divide the training pp_size "
                             f"{self.train.pp_size}; allowed: divisors of {self.train.pp_size}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")

    @property
    def tp_ratio(self) -> int:
        """t / tg: how many training TP shards one generation TP shard holds."""
        return self.train.tp_size // self.tp_size

    @property
    def pp_ratio(self) -> int:
        """p / pg: how many training stages one generation stage holds."""
        return self.train.pp_size // self.pp_size

    @property
    def ranks_per_replica(self) -> int:
        """pg * tg: the ranks of one generation replica (1: every rank generates alone with the whole model)."""
        return self.pp_size * self.tp_size

    @property
    def micro_dp_size(self) -> int:
        """dg = p*t / (pg*tg): generation replicas inside one training replica."""
        return self.tp_ratio * self.pp_ratio

    @property
    def num_replicas(self) -> int:
        """d * dg: generation replicas in the whole group, each generating its own prompts."""
        return self.train.dp_size * self.micro_dp_size

    def coords(self, rank: int) -> GenerationCoords:
        c = self.train.coords(rank)
        if self.grouping == "hybrid":
            gen_tp, micro_tp = divmod(c.tp_rank, self.tp_ratio)
            gen_pp, micro_pp = divmod(c.pp_rank, self.pp_ratio)
        else:
            micro_tp, gen_tp = divmod(c.tp_rank, self.tp_size)
            micro_pp, gen_pp = divmod(c.pp_rank, self.pp_size)
        micro_dp = micro_pp * self.tp_ratio + micro_tp
        return GenerationCoords(replica=c.dp_rank * self.micro_dp_size + micro_dp,
                                micro_dp_rank=micro_dp, gen_pp_rank=gen_pp, gen_tp_rank=gen_tp)

    def _grouped(self, key) -> list[list[int]]:
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.train.world_size):
            groups.setdefault(key(rank, self.coords(rank)), []).append(rank)
        return sorted(groups.values())

    def tp_groups(self) -> list[list[int]]:
        """Generation tensor-parallel groups (ranks of one replica and one generation stage)."""
        return self._grouped(lambda r, g: (g.replica, g.gen_pp_rank))

    def pp_groups(self) -> list[list[int]]:
        """Generation pipelines (ranks of one replica and one generation TP rank), stage 0 first."""
        return self._grouped(lambda r, g: (g.replica, g.gen_tp_rank))

    def micro_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same generation shard in one training replica: the all-gather groups."""
        return self._grouped(lambda r, g: (self.train.coords(r).dp_rank, g.gen_pp_rank, g.gen_tp_rank))

    def stage_layers(self, num_layers: int, gen_pp_rank: int) -> range:
        """Decoder layers of generation stage ``gen_pp_rank``: the union of the training stages it covers."""
        if self.grouping == "hybrid":
            stages = [gen_pp_rank * self.pp_ratio + i for i in range(self.pp_ratio)]
        else:
            stages = [i * self.pp_size + gen_pp_rank for i in range(self.pp_ratio)]
        ranges = [stage_layer_range(num_layers, self.train.pp_size, s) for s in stages]
        layers = sorted(layer for r in ranges for layer in r)
        if layers != list(range(layers[0], layers[-1] + 1)):
            raise ValueError(f"generation stage {gen_pp_rank} of the {self.grouping} grouping covers "
                             f"non-contiguous layers {layers}; use grouping='hybrid' for pipelined generation")
        return range(layers[0], layers[-1] + 1)

    def replica_ranks(self, replica: int) -> list[int]:
        """The pg*tg ranks of one generation replica, ordered by (gen_pp_rank, gen_tp_rank)."""
        ranks = [r for r in range(self.train.world_size) if self.coords(r).replica == replica]
        return sorted(ranks, key=lambda r: (self.coords(r).gen_pp_rank, self.coords(r).gen_tp_rank))
