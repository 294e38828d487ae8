"""Worker: the base class of one process of a worker group (rank, world size, mesh coordinates)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from hybridflow.device import current_device
from hybridflow.parallel.layout import GenerationLayout, ParallelLayout, RankCoords


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """Where one worker process sits; set by its host before any role object is built."""

    rank: int
    """Rank of this process in its worker group (0 .. world_size-1)."""
    world_size: int
    """Number of processes in the worker group."""
    local_rank: int
    """Index of this process among the group's processes on its node (picks the device)."""
    node_id: str
    """Ray node id of the machine this process runs on ('local' in single-process mode)."""


_context = threading.local()
_process_roles: dict[str, "Worker"] = {}


def set_worker_context(context: WorkerContext | None) -> None:
    """Install the context that the next ``Worker`` objects built in this thread read."""
    _context.value = context


def add_process_role(role: str, worker: "Worker") -> None:
    """Make ``worker`` reachable from the other roles of this process as ``colocated_role(role)``."""
    _process_roles[role] = worker


def remove_process_role(role: str, worker: "Worker") -> None:
    """Forget ``worker`` (its group was shut down), unless the name now belongs to another object."""
    if _process_roles.get(role) is worker:
        del _process_roles[role]


def _current_context() -> WorkerContext:
    context = getattr(_context, "value", None)
    # a worker built by hand outside any group (a unit test, a notebook) is a world of one
    return context or WorkerContext(rank=0, world_size=1, local_rank=0, node_id="local")


class Worker:
    """Base class of a role in a worker group; subclasses add methods decorated with ``@register``.

    The rank information is installed before the subclass ``__init__`` runs, so a subclass may use
    ``self.rank`` or torch.distributed collectives in its constructor without calling
    ``super().__init__()``. By default every rank is a data-parallel rank (pp = tp = 1); a worker
    that builds a model-parallel engine declares its layout with ``set_parallel_layout`` and the
    transfer protocols follow it from the next call on.
    """

    def __new__(cls, *args, **kwargs):
        worker = super().__new__(cls)
        context = _current_context()
        worker._worker_context = context
        worker._parallel_layout = ParallelLayout(dp_size=context.world_size)
        worker._generation_layout = None
        worker._layout_version = 0
        return worker

    @property
    def rank(self) -> int:
        return self._worker_context.rank

    @property
    def world_size(self) -> int:
        return self._worker_context.world_size

    @property
    def local_rank(self) -> int:
        return self._worker_context.local_rank

    @property
    def node_id(self) -> str:
        return self._worker_context.node_id

    @property
    def device(self) -> torch.device:
        """The device this worker computes on (its GPU, or the CPU)."""
        return current_device(self.local_rank)

    @property
    def parallel_layout(self) -> ParallelLayout:
        return self._parallel_layout

    @property
    def generation_layout(self) -> GenerationLayout | None:
        """A second layout some roles declare for a second phase (the actor's generation); the transfer
        protocols split data by its replicas. Its coordinates and groups belong to ``GenerationLayout``."""
        return self._generation_layout

    @property
    def coords(self) -> RankCoords:
        """This rank's (dp, pp, tp) coordinates in the training layout."""
        return self._parallel_layout.coords(self.rank)

    def colocated_role(self, role: str) -> "Worker":
        """Another role object living in this process (built by ``WorkerGroup.colocate`` on the same pool)."""
        if role not in _process_roles:
            raise ValueError(f"no role {role!r} in this process; colocated roles here: {sorted(_process_roles)}")
        return _process_roles[role]

    def set_parallel_layout(self, layout: ParallelLayout, generation: GenerationLayout | None = None) -> None:
        """Declare the mesh this worker's model uses; every rank of the group must declare the same one."""
        if layout.world_size != self.world_size:
            raise ValueError(f"layout (pp={layout.pp_size}, tp={layout.tp_size}, dp={layout.dp_size}) covers "
                             f"{layout.world_size} ranks, but the worker group has {self.world_size}; "
                             f"allowed: pp*tp*dp == {self.world_size}")
        if generation is not None and generation.train != layout:
            raise ValueError(f"generation layout is defined over {generation.train}, "
                             f"not over the declared training layout {layout}")
        self._parallel_layout = layout
        self._generation_layout = generation
        self._layout_version += 1

    def layout_state(self) -> tuple[ParallelLayout, GenerationLayout | None, int]:
        """(training layout, generation layout, version): what the driver caches for the protocols."""
        return self._parallel_layout, self._generation_layout, self._layout_version
