"""Single-process mode: every worker group runs inside the driver's process (world size 1, no Ray)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

LOCAL_ENV = "HYBRIDFLOW_LOCAL"
_forced: bool | None = None


def local_mode_enabled() -> bool:
    """True when pools default to single-process mode (``local_mode()`` or HYBRIDFLOW_LOCAL=1)."""
    if _forced is not None:
        return _forced
    return os.environ.get(LOCAL_ENV, "0").strip().lower() in ("1", "true", "yes")


@contextlib.contextmanager
def local_mode(enabled: bool = True) -> Iterator[None]:
    """Within this block, new ``ResourcePool`` objects without an explicit mode run in the driver's process."""
    global _forced
    previous, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = previous


def init_local_process_group() -> None:
    """A torch.distributed world of one in the driver, so engines that call collectives work unchanged."""
    import torch.distributed as dist

    from hybridflow.device import init_process_group
    from hybridflow.ports import free_port

    if not dist.is_initialized():
        init_process_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())


class _DeadlineExpired(BaseException):
    """Raised by SIGALRM inside an in-process call that ran past its deadline."""


@contextlib.contextmanager
def call_deadline(timeout_s: float | None, *, role: str, method: str) -> Iterator[None]:
    """Bound an in-process worker call by ``timeout_s`` as Ray mode bounds a remote one: a ``WorkerTimeoutError``
    naming the role and method is raised in the call when the time is up (SIGALRM; Python code and sleeps are
    interrupted, one long C call finishes first). A no-op off the main thread; an earlier alarm (an enclosing
    deadline, pytest-timeout) is kept and re-armed with its remaining time."""
    import signal
    import threading
    import time

    from hybridflow.controller.errors import WorkerTimeoutError

    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left = signal.getitimer(signal.ITIMER_REAL)[0]
    if 0 < outer_left <= timeout_s:  # the enclosing alarm fires first anyway
        yield
        return

    def expire(signum, frame):
        raise _DeadlineExpired  # a BaseException: the worker method's own `except Exception` cannot swallow it

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    except _DeadlineExpired:
        raise WorkerTimeoutError(role=role, method=method, pending_ranks=[0], timeout_s=timeout_s,
                                 pids=[os.getpid()]) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 1e-3))
