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
