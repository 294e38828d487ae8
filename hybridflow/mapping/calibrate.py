"""Calibration: measure this machine's FLOP/s, memory bandwidth, per-layer overhead and gloo bandwidth.

torch (and torch.distributed, in the spawned probe processes) is imported only inside these
functions, so the rest of hybridflow.mapping stays importable without it. Every process of a
hybridflow run on CPU computes with one thread, so the probes do too; the profile's
compute_units_per_node (the core count) lets the simulator divide them when processes outnumber cores.
"""

from __future__ import annotations

import datetime
import os
import platform
import time

from hybridflow.mapping.hardware import GIB, LOCAL_PROFILE_NAME, HardwareProfile

# How the measured numbers become a profile: the probes already measure what kernels achieve, so
# the achievable fractions are 1; a process may fill this share of its slice of the RAM.
USABLE_MEMORY_FRACTION = 0.8


def _best_seconds(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up (the least disturbed by other processes)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(*, size: int = 1024, repeats: int = 5) -> float:
    """fp32 FLOP/s of one thread multiplying two ``size`` x ``size`` matrices (2 size^3 FLOPs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        left, right = torch.randn(size, size), torch.randn(size, size)
        out = torch.empty(size, size)
        seconds = _best_seconds(lambda: torch.matmul(left, right, out=out), repeats)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / seconds


def measure_memory_bandwidth(*, num_bytes: int = 256 * 1024**2, repeats: int = 5) -> float:
    """Bytes/s one thread streams copying a ``num_bytes`` fp32 buffer (counted: read + write)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.ones(num_bytes // 4)
        target = torch.empty_like(source)
        seconds = _best_seconds(lambda: target.copy_(source), repeats)
    finally:
        torch.set_num_threads(threads)
    return 2 * num_bytes / seconds


def all_reduce_probe(rank: int, world_size: int, num_bytes: int, repeats: int) -> tuple[float, float]:
    """(seconds of a ``num_bytes`` fp32 all-reduce, seconds of a one-element all-reduce): the fastest
    of ``repeats``, measured in a process group started by hybridflow.parallel.launch."""
    import torch
    import torch.distributed as dist

    large, small = torch.ones(num_bytes // 4), torch.ones(1)

    def timed(tensor) -> float:
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        return time.perf_counter() - start

    timed(large)
    large_seconds = min(timed(large) for _ in range(repeats))
    small_seconds = min(timed(small) for _ in range(max(repeats, 20)))
    return large_seconds, small_seconds


def measure_all_reduce(*, world_size: int = 2, num_bytes: int = 64 * 1024**2, repeats: int = 5) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of gloo all-reduce between ``world_size`` local processes.

    Bus bandwidth = 2 (g-1)/g * bytes / seconds, the quantity the simulator's ring formula divides by.
    """
    from hybridflow.parallel.launch import run_distributed

    results = run_distributed(all_reduce_probe, world_size, num_bytes, repeats, timeout_s=120)
    large_seconds = max(result[0] for result in results)
    small_seconds = max(result[1] for result in results)
    return 2 * (world_size - 1) / world_size * num_bytes / large_seconds, small_seconds


def measure_layer_overhead(*, repeats: int = 5) -> float:
    """Seconds one eager forward spends per decoder layer when compute is negligible (one token).

    The difference between a 2-layer and a 6-layer tiny Llama, divided by 4, leaves out the
    embedding, head and Python call overhead that do not grow with depth.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for layers in (2, 6):
            config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2)
            model = LlamaForCausalLM(config).eval()
            tokens = torch.ones(1, 1, dtype=torch.long)
            with torch.no_grad():
                seconds[layers] = _best_seconds(lambda: model(tokens, use_cache=False), repeats * 4)
    finally:
        torch.set_num_threads(threads)
    return max(0.0, (seconds[6] - seconds[2]) / 4)


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(*, quick: bool = False) -> HardwareProfile:
    """Measure this machine and return its profile (named cpu-local)."""
    repeats = 3 if quick else 5
    cores = os.cpu_count() or 1
    flops = measure_matmul_flops(size=512 if quick else 1024, repeats=repeats)
    bandwidth = measure_memory_bandwidth(num_bytes=(64 if quick else 256) * 1024**2, repeats=repeats)
    layer_overhead = measure_layer_overhead(repeats=repeats)
    link_bandwidth, link_latency = measure_all_reduce(num_bytes=(8 if quick else 64) * 1024**2, repeats=repeats)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return HardwareProfile(
        name=LOCAL_PROFILE_NAME,
        device_memory_gib=round(total_memory_bytes() / cores / GIB, 3),
        usable_memory_fraction=USABLE_MEMORY_FRACTION,
        peak_flops=flops,
        flops_fraction=1.0,
        memory_bandwidth=bandwidth,
        memory_bandwidth_fraction=1.0,
        intra_node_bandwidth=link_bandwidth,
        inter_node_bandwidth=link_bandwidth,
        link_bandwidth_fraction=1.0,
        intra_node_latency_s=link_latency,
        inter_node_latency_s=link_latency,
        compute_dtype="fp32",
        compute_units_per_node=cores,
        layer_overhead_s=layer_overhead,
        source=(f"measured by `hybridflow calibrate` on {platform.node()} ({cores} cores, "
                f"{platform.processor() or platform.machine()}) at {stamp}: one-thread fp32 matmul, one-thread "
                f"copy bandwidth, eager tiny-Llama layer overhead, gloo all-reduce between 2 "
                f"local processes (inter-node taken equal: no second node); device memory = RAM / cores"),
    )
