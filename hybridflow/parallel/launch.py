"""Run a function on N local processes joined in one torch.distributed group (tests, benchmarks).

Each process gets one torch thread (more processes than cores otherwise fight over them), joins a
gloo group on CPU (nccl on CUDA), runs ``fn(rank, world_size, *args)`` and sends its return value
back. An exception in any rank is re-raised in the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from hybridflow.device import init_process_group, require_devices
from hybridflow.ports import free_port


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        init_process_group(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                           master_port=port, timeout_s=timeout_s)
        # plain pickle bytes, not torch's shared-memory tensor handles: those die with this process,
        # which may exit before the parent reads the queue
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``fn`` must be importable (a module-level function) and its result picklable (tensors are fine).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    require_devices(world_size, what=f"run_distributed({getattr(fn, '__name__', fn)}, {world_size})")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, queue, timeout_s), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < world_size and not failures:
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r, proc in enumerate(procs) if not proc.is_alive() and r not in results]
            if dead and queue.empty():
                failures.append(f"ranks {dead} exited without a result (exit codes "
                                f"{[procs[r].exitcode for r in dead]})")
            elif time.monotonic() > deadline:
                failures.append(f"timed out after {timeout_s:.0f} s waiting for ranks "
                                f"{sorted(set(range(world_size)) - set(results))}")
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            # the other ranks may now block in a collective forever; they are killed below
            failures.append(f"--- rank {rank} ---\n{payload}")
    for proc in procs:
        proc.join(timeout=5 if failures else timeout_s)
        if proc.is_alive():
            proc.kill()
    if failures:
        raise RuntimeError("distributed run failed:\n" + "\n".join(failures))
    return [results[rank] for rank in range(world_size)]
