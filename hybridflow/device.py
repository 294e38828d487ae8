"""The one place that picks the accelerator and the collective backend (CUDA + nccl, else CPU + gloo)."""

from __future__ import annotations

import ctypes
import os
import platform
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


class NotEnoughDevicesError(ValueError):
    """More ranks of one group than accelerators for them: NCCL cannot put two ranks on one GPU."""


def device_type() -> str:
    """'cuda' when a GPU is visible to this process, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def distributed_backend() -> str:
    """The torch.distributed backend string of this machine; override with HYBRIDFLOW_BACKEND.

    On CUDA it is the mixed ``cpu:gloo,cuda:nccl``: GPU tensors go through NCCL while CPU tensors
    (FSDP CPU offload, object collectives, metrics kept on the host) go through gloo instead of
    failing. On CPU it is ``gloo``.
    """
    override = os.environ.get("HYBRIDFLOW_BACKEND")
    if override:
        return override
    return "cpu:gloo,cuda:nccl" if device_type() == "cuda" else "gloo"


def current_device(local_rank: int = 0) -> torch.device:
    """The device this process computes on; on CUDA it also becomes the current device.

    Under Ray each process sees only the GPU it was given (index 0); under a plain launcher the
    local rank picks the GPU. Two ranks of one group on one GPU are refused at group start
    (``init_process_group``), not here.
    """
    if device_type() == "cuda":
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def require_devices(world_size: int, *, what: str = "this run") -> None:
    """Raise NotEnoughDevicesError when ``world_size`` ranks on this machine would share a GPU."""
    if device_type() != "cuda":
        return
    count = torch.cuda.device_count()
    if world_size > count:
        raise NotEnoughDevicesError(
            f"{what} needs {world_size} processes, one per GPU, but this machine has {count} visible GPU(s); "
            f"NCCL cannot run two ranks of one group on the same GPU. Use at most {count} ranks here, or set "
            f"HYBRIDFLOW_BACKEND=gloo with CUDA_VISIBLE_DEVICES='' to run them on the CPU")


CPU_DTYPE_ENV = "HYBRIDFLOW_CPU_DTYPE"
"""Environment variable: what ``dtype: auto`` means on CPU: 'auto' (the default: see ``default_dtype``),
'float32' or 'bfloat16'."""
CPU_BF16_MIN_HIDDEN = 256
"""Smallest hidden size at which ``dtype: auto`` computes in bf16 on a CPU with bf16 instructions. Below it,
autocast's casts cost more than the faster matmuls save: a GRPO step of the 64-wide model of
benchmarks/vs_trl runs 0.82x as fast in bf16, of the 256-wide one 1.55x (docs/engines.md, "Precision on CPU")."""


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), which oneDNN's bf16 matmuls use.

    Where it has them, a bf16 matmul runs 2-3x as fast as fp32 (`python benchmarks/bench_precision.py`);
    where it has not (AVX2 only), bf16 is converted in software and runs 3.7-5x slower than fp32.
    """
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def default_dtype(hidden_size: int | None = None) -> torch.dtype:
    """The compute dtype of ``dtype: auto`` for a model of ``hidden_size`` (None: any size).

    CUDA: bf16 when the GPU supports it. CPU: bf16 when it has bf16 dot-product instructions
    (``cpu_has_native_bf16``) and the model is at least ``CPU_BF16_MIN_HIDDEN`` wide, fp32 otherwise;
    ``HYBRIDFLOW_CPU_DTYPE=float32|bfloat16`` overrides the CPU's choice. Master weights, gradients and
    optimizer state stay fp32 either way (autocast).
    """
    if device_type() == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    choice = os.environ.get(CPU_DTYPE_ENV, "auto")
    if choice not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"{CPU_DTYPE_ENV} must be 'auto', 'float32' or 'bfloat16', got {choice!r}")
    if choice != "auto":
        return getattr(torch, choice)
    wide_enough = hidden_size is None or hidden_size >= CPU_BF16_MIN_HIDDEN
    return torch.bfloat16 if cpu_has_native_bf16() and wide_enough else torch.float32


def configure_matmul_precision(compute_dtype: torch.dtype) -> str:
    """Let CUDA run the fp32 matmuls left outside bf16 compute on TF32 tensor cores; returns the precision set.

    With a bf16 compute dtype the few fp32 matmuls that remain (heads upcast for log-probs, norms' neighbours)
    gain TF32's speed at a rounding far below bf16's. A user who asks for ``dtype: float32`` gets true fp32
    ("highest"), as does the CPU, where TF32 does not exist. The setting is per process.
    """
    precision = "high" if device_type() == "cuda" and compute_dtype != torch.float32 else "highest"
    torch.set_float32_matmul_precision(precision)
    return precision


HOST_ALLOCATOR_ENV = "HYBRIDFLOW_HOST_ALLOCATOR"
"""Environment variable: 'keep' (the default: freed memory stays on the heap) or 'system' (glibc as it is)."""
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)
_host_allocator: str | None = None


def configure_host_allocator() -> str:
    """Make the CPU's allocator keep freed memory for the next allocation; returns the mode in effect.

    glibc serves every allocation above 32 MiB (a micro-batch's logits, an embedding's gradient, the
    MLP's activations at a large token budget) with a fresh ``mmap`` and gives it back on free, and
    trims the heap's free top: each training step then faults in and zeroes its working set again.
    On SmolLM2-135M (64 RL rows, one process, 2 threads) that was 1.2 million page faults and 52-55 CPU-s
    per step, against none and 37-44 CPU-s with the heap kept (``benchmarks/bench_host_allocator.py``).
    This is what PyTorch's CUDA caching allocator does on the GPU: the process keeps its peak (the
    resident size stays at its high-water mark instead of falling between steps). Only on CPU runs with
    glibc, once per process; ``HYBRIDFLOW_HOST_ALLOCATOR=system`` leaves glibc as it is. Reused memory is not
    zeroed: code that reads memory before writing it (a regrown vLLM KV cache did) must clear it itself.
    """
    global _host_allocator
    if _host_allocator is not None:
        return _host_allocator
    requested = os.environ.get(HOST_ALLOCATOR_ENV, "keep")
    if requested not in ("keep", "system"):
        raise ValueError(f"{HOST_ALLOCATOR_ENV} must be 'keep' or 'system', got {requested!r}")
    mode = "system"
    if requested == "keep" and device_type() == "cpu" and platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL("libc.so.6")
        # mallopt takes an int: -1 converts to the largest size_t, i.e. never trim the heap's top
        if libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1:
            mode = "keep"
    _host_allocator = mode
    return mode


def init_process_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 600.0,
) -> None:
    """Join the default torch.distributed group of one worker group (idempotent).

    On CUDA the ranks first compare, over gloo, which physical GPU each one got: two ranks on one
    GPU are refused with an error naming them (NCCL would abort later with a duplicate-GPU error).
    """
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=distributed_backend(),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if device_type() == "cuda" and world_size > 1 and "nccl" in dist.get_backend():
        _check_one_rank_per_gpu(rank, world_size)


def _check_one_rank_per_gpu(rank: int, world_size: int) -> None:
    index = current_device(int(os.environ.get("LOCAL_RANK", "0"))).index
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(index).uuid))
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)  # on the gloo half of the mixed backend: no NCCL communicator yet
    owners: dict[tuple, list[int]] = {}
    for other, key in enumerate(everyone):
        owners.setdefault(tuple(key), []).append(other)
    shared = {key: ranks for key, ranks in owners.items() if len(ranks) > 1}
    if shared:
        (host, _), ranks = next(iter(shared.items()))
        dist.destroy_process_group()
        raise NotEnoughDevicesError(
            f"ranks {ranks} of this group of {world_size} were given the same GPU on host {host!r}; NCCL needs one "
            f"GPU per rank. Give the group at most as many ranks as GPUs (max_processes_per_slot=1 on GPU pools)")
