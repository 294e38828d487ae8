"""The one place that picks the accelerator and the collective backend (CUDA + nccl, else CPU + gloo)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def device_type() -> str:
    """'cuda' when a GPU is visible to this process, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def distributed_backend() -> str:
    """'nccl' on CUDA, 'gloo' on CPU. Override with HYBRIDFLOW_BACKEND (e.g. to test gloo on a GPU box)."""
    override = os.environ.get("HYBRIDFLOW_BACKEND")
    if override:
        return override
    return "nccl" if device_type() == "cuda" else "gloo"


def current_device(local_rank: int = 0) -> torch.device:
    """The device this process computes on; on CUDA it also becomes the current device."""
    if device_type() == "cuda":
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def default_dtype() -> torch.dtype:
    """bf16 where the device computes it natively (CUDA with bf16 support), fp32 on CPU."""
    if device_type() == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def init_process_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 600.0,
) -> None:
    """Join the default torch.distributed group of one worker group (idempotent)."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=distributed_backend(),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
