"""WorkerHost: the process behind one slot of a pool; builds its role objects and runs their methods."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import ray
import torch

from hybridflow.controller.batch import is_splittable, num_rows
from hybridflow.controller.errors import WorkerError
from hybridflow.controller.future import resolve_arguments
from hybridflow.controller.register import declares_layout
from hybridflow.controller.worker import (
    Worker,
    WorkerContext,
    add_process_role,
    remove_process_role,
    set_worker_context,
)
from hybridflow.device import init_process_group

RoleSpec = tuple[type, tuple, dict]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


def threads_per_worker(local_world_size: int, cores: int | None = None, limit: int | None = None) -> int:
    """Torch compute threads of one of ``local_world_size`` SPMD workers sharing a node's cores.

    The ranks of one group run at the same time, so each owns an equal share of the cores: a
    single worker on a 2-core machine uses both, four workers on it one each (never fewer than one).
    ``limit`` (the driver's ``OMP_NUM_THREADS``, see ``driver_thread_limit``) caps the share.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    cores = usable_cores() if cores is None else cores
    share = max(1, cores // local_world_size)
    return share if limit is None else min(share, limit)


def driver_thread_limit(environ: dict[str, str] | None = None) -> int | None:
    """The driver's ``OMP_NUM_THREADS`` as a cap on every worker's threads, or None when it is not set.

    A user who sets it (a shared machine, other jobs on the same cores) gets it in the workers too:
    Ray workers start with their own environment, and OpenMP threads that find their cores taken spin
    at every barrier (measured here: one decode-sized matmul 10-17 ms at 2 threads vs 1-2 ms at 1).
    """
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"environment variable OMP_NUM_THREADS must be a positive integer, got {value!r}")
    return int(value)


_pinned_threads: int | None = None
"""Threads a role of this process asked for (``engine.num_threads``); the driver's share no longer applies."""


def pin_num_threads(count: int) -> None:
    """Use ``count`` torch threads in this process whatever its share of the node's cores."""
    global _pinned_threads
    _pinned_threads = count
    torch.set_num_threads(count)


def build_roles(context: WorkerContext, roles: dict[str, RoleSpec]) -> dict[str, Worker]:
    """Construct every role object of one process under ``context``."""
    set_worker_context(context)
    built: dict[str, Worker] = {}
    try:
        for role, (worker_cls, args, kwargs) in roles.items():
            try:
                built[role] = worker_cls(*args, **kwargs)
                add_process_role(role, built[role])
            except Exception as error:
                for built_role, worker in built.items():  # the group will not exist: forget its other roles
                    remove_process_role(built_role, worker)
                raise WorkerError(role=role, rank=context.rank, method="__init__",
                                  remote_traceback=traceback.format_exc()) from error
    finally:
        set_worker_context(None)
    return built


def run_method(worker: Worker, *, role: str, rank: int, method: str, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """Call one method; returns (output, info) with info = (out_rows, in_rows, layout_version)."""
    version = worker.layout_state()[2]
    try:
        args, kwargs = resolve_arguments(args, kwargs)
        output = getattr(worker, method)(*args, **kwargs)
        if worker.layout_state()[2] != version and not declares_layout(type(worker), method):
            raise RuntimeError(f"{type(worker).__name__}.{method} declared a new layout (set_parallel_layout) but is "
                               f"not registered with declares_layout=True: calls submitted while it ran could be "
                               f"split by the old layout; register it with @register(..., declares_layout=True)")
    except Exception as error:
        raise WorkerError(role=role, rank=rank, method=method, remote_traceback=traceback.format_exc()) from error
    in_rows = next((len(v) for v in list(args) + list(kwargs.values()) if is_splittable(v)), None)
    return output, (num_rows(output), in_rows, worker.layout_state()[2])


class WorkerHost:
    """One Ray actor per slot (wrapped with ``ray.remote`` by the WorkerGroup)."""

    def __init__(self, *, rank: int, world_size: int, local_rank: int, local_world_size: int = 1,
                 thread_limit: int | None = None) -> None:
        # threads follow the cores this worker owns: the node's cores split among the group's ranks on it,
        # capped by the driver's OMP_NUM_THREADS when the user set it
        torch.set_num_threads(threads_per_worker(local_world_size, limit=thread_limit))
        self._context = WorkerContext(rank=rank, world_size=world_size, local_rank=local_rank,
                                      node_id=ray.get_runtime_context().get_node_id())
        self._local_world_size = local_world_size
        self._roles: dict[str, Worker] = {}

    def node_id(self) -> str:
        """The Ray node this process runs on (the driver counts the worker processes per node)."""
        return self._context.node_id

    def set_num_threads(self, count: int) -> int:
        """Use ``count`` torch compute threads from now on (the driver's share of this node's cores), unless a
        role of this process pinned its own (``pin_num_threads``)."""
        torch.set_num_threads(count if _pinned_threads is None else _pinned_threads)
        return torch.get_num_threads()

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: the rendezvous point when this host is rank 0."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, *, master_addr: str, master_port: int, dist_timeout_s: float,
              roles: dict[str, RoleSpec]) -> int:
        """Join the group's torch.distributed world, build the role objects; returns the process id."""
        context = self._context
        os.environ.update(RANK=str(context.rank), WORLD_SIZE=str(context.world_size),
                          LOCAL_RANK=str(context.local_rank), LOCAL_WORLD_SIZE=str(self._local_world_size),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        try:
            init_process_group(rank=context.rank, world_size=context.world_size, master_addr=master_addr,
                               master_port=master_port, timeout_s=dist_timeout_s)
        except Exception as error:
            raise WorkerError(role="+".join(roles), rank=context.rank, method="init_process_group",
                              remote_traceback=traceback.format_exc()) from error
        self._roles = build_roles(context, roles)
        return os.getpid()

    @ray.method(num_returns=2)
    def execute(self, role: str, method: str, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
        return run_method(self._roles[role], role=role, rank=self._context.rank, method=method,
                          args=args, kwargs=kwargs)

    def layout_state(self, role: str) -> tuple:
        return self._roles[role].layout_state()
