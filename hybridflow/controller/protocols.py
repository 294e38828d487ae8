"""Transfer protocols: how a driver call is split across the ranks of a group and how outputs are merged.

A protocol is a (distribute, collect) pair driven by the mesh the workers declared:

    distribute(mesh, args, kwargs) -> Dispatch(calls=[(args, kwargs) or None per rank], pad=rows)
    collect(mesh, outputs_by_rank, pad) -> the value the driver's call returns

``outputs_by_rank[r]`` is rank r's return value, or None for a rank that did not run or whose output
the protocol does not read (``source_ranks``). A protocol that ``concatenates`` returns the outputs of
its ``source_ranks`` concatenated along rows minus the last ``pad`` rows; for those the controller
also knows how to hand a future's rows straight to another group's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hybridflow.controller.batch import concat_rows, drop_last_rows, is_splittable, split_rows
from hybridflow.controller.future import DerivedPad, Future, RowSlice, WholeValue
from hybridflow.parallel.layout import GenerationLayout, ParallelLayout

RankCall = tuple[tuple, dict]


@dataclass(frozen=True)
class GroupMesh:
    """The parallel layout every rank of a group declared (the same on all ranks)."""

    layout: ParallelLayout
    """Training layout (pp, tp, dp); pure data parallel unless the workers declared otherwise."""
    generation: GenerationLayout | None = None
    """Generation layout of a hybrid-engine actor, when declared."""

    @property
    def world_size(self) -> int:
        return self.layout.world_size


@dataclass(frozen=True)
class Dispatch:
    """Per-rank arguments of one call."""

    calls: list[RankCall | None]
    """(args, kwargs) for each rank; None: the rank does not run the method."""
    pad: Any = 0
    """Rows appended to the split input to make it divisible (removed again by collect)."""


@dataclass(frozen=True)
class Protocol:
    """A registered (distribute, collect) pair."""

    name: str
    distribute: Callable[[GroupMesh, tuple, dict], Dispatch]
    collect: Callable[[GroupMesh, list, int], Any]
    source_ranks: Callable[[GroupMesh], list[int]] | None = None
    """Ranks whose outputs collect reads, in order; None: every rank that ran."""
    concatenates: bool = False
    """True when collect concatenates the source ranks' outputs and drops the last ``pad`` rows."""
    uses_mesh: bool = True
    """False for protocols that ignore the layout (the driver then never waits to refresh it)."""


_PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(name: str, distribute: Callable, collect: Callable, *,
                      source_ranks: Callable | None = None, concatenates: bool = False,
                      uses_mesh: bool = True) -> Protocol:
    """Add a user protocol; ``@register(protocol=name)`` can use it from then on."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"protocol name must be a non-empty string, got {name!r}")
    if name in _PROTOCOLS:
        raise ValueError(f"protocol {name!r} is already registered; allowed: a new name, not one of "
                         f"{sorted(_PROTOCOLS)}")
    if not callable(distribute) or not callable(collect):
        raise ValueError(f"protocol {name!r} needs callable distribute and collect functions")
    protocol = Protocol(name=name, distribute=distribute, collect=collect, source_ranks=source_ranks,
                        concatenates=concatenates, uses_mesh=uses_mesh)
    _PROTOCOLS[name] = protocol
    return protocol


def get_protocol(name: str) -> Protocol:
    if name not in _PROTOCOLS:
        raise ValueError(f"unknown transfer protocol {name!r}; allowed: {sorted(_PROTOCOLS)}")
    return _PROTOCOLS[name]


def protocol_names() -> list[str]:
    return sorted(_PROTOCOLS)


# ---------------------------------------------------------------- helpers for distribute functions

def whole(value: Any) -> Any:
    """An argument every rank receives whole: a future becomes a lazy whole value, the rest is unchanged."""
    if isinstance(value, Future):
        return value.get() if value.is_local else WholeValue(value.value_refs)
    return value


def broadcast(mesh: GroupMesh, args: tuple, kwargs: dict) -> list[RankCall]:
    """Every rank gets the same arguments."""
    call = (tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()})
    return [call] * mesh.world_size


def _split_one(value: Any, num_chunks: int) -> tuple[list[Any], Any] | None:
    if isinstance(value, Future) and value.is_local:
        value = value.get()
    if isinstance(value, Future):
        rows = value.value_refs.rows()
        if rows is None:
            return None
        return [RowSlice(rows, num_chunks, i) for i in range(num_chunks)], DerivedPad(rows, num_chunks)
    if is_splittable(value):
        return split_rows(value, num_chunks)
    return None


def split_arguments(args: tuple, kwargs: dict, num_chunks: int) -> tuple[list[RankCall], Any]:
    """Cut every DataProto (or row future) argument into ``num_chunks`` chunks; the rest goes whole.

    Returns one (args, kwargs) per chunk and the pad rows of the split (all split arguments must
    have the same number of rows; the first one's padding is the one collect removes).
    """
    names = list(range(len(args))) + list(kwargs)
    values = list(args) + list(kwargs.values())
    per_value, pad, rows = [], None, None
    for name, value in zip(names, values):
        split = _split_one(value, num_chunks)
        if split is None:
            per_value.append([whole(value)] * num_chunks)
            continue
        chunks, value_pad = split
        if not isinstance(value, Future):
            if rows is not None and len(value) != rows:
                raise ValueError(f"batch argument {name!r} has {len(value)} rows but an earlier one has {rows}; "
                                 f"split arguments of one call must have the same number of rows")
            rows = len(value)
        pad = value_pad if pad is None else pad
        per_value.append(chunks)
    calls = []
    for chunk in range(num_chunks):
        chunk_values = [column[chunk] for column in per_value]
        calls.append((tuple(chunk_values[: len(args)]), dict(zip(kwargs, chunk_values[len(args):]))))
    return calls, (0 if pad is None else pad)


# ---------------------------------------------------------------- the built-in protocols

def _collect_all(mesh: GroupMesh, outputs: list, pad: int) -> list:
    return list(outputs)


def _concat(ranks_of: Callable[[GroupMesh], list[int]]) -> Callable:
    def collect(mesh: GroupMesh, outputs: list, pad: int) -> Any:
        return drop_last_rows(concat_rows([outputs[r] for r in ranks_of(mesh)]), pad)
    return collect


def _one_to_all(mesh: GroupMesh, args: tuple, kwargs: dict) -> Dispatch:
    return Dispatch(calls=broadcast(mesh, args, kwargs))


def _all_to_all(mesh: GroupMesh, args: tuple, kwargs: dict) -> Dispatch:
    for name, value in list(enumerate(args)) + list(kwargs.items()):
        if not isinstance(value, (list, tuple)) or len(value) != mesh.world_size:
            raise ValueError(f"ALL_TO_ALL argument {name!r} must be a list with one entry per rank "
                             f"({mesh.world_size}), got {type(value).__name__}"
                             f"{' of length ' + str(len(value)) if isinstance(value, (list, tuple)) else ''}")
    return Dispatch(calls=[(tuple(whole(a[r]) for a in args), {k: whole(v[r]) for k, v in kwargs.items()})
                           for r in range(mesh.world_size)])


def _dp_ranks(mesh: GroupMesh) -> list[int]:
    if mesh.layout.pp_size != 1 or mesh.layout.tp_size != 1:
        raise ValueError(f"DP_PROTO needs a pure data-parallel layout (pp=tp=1), the workers declared "
                         f"pp={mesh.layout.pp_size}, tp={mesh.layout.tp_size}; use 3D_PROTO")
    return list(range(mesh.world_size))


def _dp_distribute(mesh: GroupMesh, args: tuple, kwargs: dict) -> Dispatch:
    calls, pad = split_arguments(args, kwargs, len(_dp_ranks(mesh)))
    return Dispatch(calls=calls, pad=pad)


def _by_dp_rank(mesh: GroupMesh, args: tuple, kwargs: dict) -> Dispatch:
    chunks, pad = split_arguments(args, kwargs, mesh.layout.dp_size)
    return Dispatch(calls=[chunks[mesh.layout.coords(r).dp_rank] for r in range(mesh.world_size)], pad=pad)


def _dp_representatives(mesh: GroupMesh) -> list[int]:
    """One rank per DP group: tp rank 0 of the last pipeline stage (where outputs are complete)."""
    layout = mesh.layout
    return [layout.rank_of(dp_rank=d, pp_rank=layout.pp_size - 1, tp_rank=0) for d in range(layout.dp_size)]


def _generation(mesh: GroupMesh) -> GenerationLayout:
    if mesh.generation is None:
        raise ValueError("3D_ALL_MICRO_DP needs a generation layout; declare it with "
                         "set_parallel_layout(layout, generation=GenerationLayout(...)) in the workers")
    return mesh.generation


def _by_replica(mesh: GroupMesh, args: tuple, kwargs: dict) -> Dispatch:
    generation = _generation(mesh)
    chunks, pad = split_arguments(args, kwargs, generation.num_replicas)
    return Dispatch(calls=[chunks[generation.coords(r).replica] for r in range(mesh.world_size)], pad=pad)


def _replica_heads(mesh: GroupMesh) -> list[int]:
    """The first rank (gen_pp_rank 0, gen_tp_rank 0) of every generation replica, by replica."""
    generation = _generation(mesh)
    return [generation.replica_ranks(replica)[0] for replica in range(generation.num_replicas)]


def _stage_heads(mesh: GroupMesh) -> list[int]:
    """tp rank 0 of dp replica 0 for every pipeline stage, stage 0 first."""
    return [mesh.layout.rank_of(dp_rank=0, pp_rank=p, tp_rank=0) for p in range(mesh.layout.pp_size)]


def _rank_zero(mesh: GroupMesh, args: tuple, kwargs: dict) -> Dispatch:
    return Dispatch(calls=[broadcast(mesh, args, kwargs)[0]] + [None] * (mesh.world_size - 1))


def _select(ranks_of: Callable[[GroupMesh], list[int]]) -> Callable:
    def collect(mesh: GroupMesh, outputs: list, pad: int) -> list:
        return [outputs[r] for r in ranks_of(mesh)]
    return collect


def _rank_zero_only(mesh: GroupMesh) -> list[int]:
    return [0]


def _first_output(mesh: GroupMesh, outputs: list, pad: int) -> Any:
    return outputs[0]


register_protocol("ONE_TO_ALL", _one_to_all, _collect_all, uses_mesh=False)
register_protocol("ALL_TO_ALL", _all_to_all, _collect_all, uses_mesh=False)
register_protocol("DP_PROTO", _dp_distribute, _concat(_dp_ranks), source_ranks=_dp_ranks, concatenates=True)
register_protocol("3D_PROTO", _by_dp_rank, _concat(_dp_representatives), source_ranks=_dp_representatives,
                  concatenates=True)
register_protocol("3D_ALL_MICRO_DP", _by_replica, _concat(_replica_heads), source_ranks=_replica_heads,
                  concatenates=True)
register_protocol("3D_PP_ONLY", _one_to_all, _select(_stage_heads), source_ranks=_stage_heads)
register_protocol("RANK_ZERO", _rank_zero, _first_output, source_ranks=_rank_zero_only, uses_mesh=False)
# The eighth: training updates split the batch by DP rank like 3D_PROTO but return metrics (loss,
# grad norm, clip fraction), not rows; this one returns one output per DP rank, in DP order.
register_protocol("DP_METRICS", _by_dp_rank, _select(_dp_representatives), source_ranks=_dp_representatives)
