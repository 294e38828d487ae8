"""`hybridflow calibrate`: measure this machine's accelerator (or CPU) and write a planner hardware profile.

On a CUDA machine it measures the GPU: bf16 matrix-multiply FLOP/s at a transformer layer's shape,
HBM bandwidth (a device-to-device copy), device memory, and the nccl all-reduce between the local
GPUs (with one GPU there is no link to measure; the host link stands in, see ``_single_gpu_links``).
Without one it measures what a hybridflow CPU process gets: one-thread fp32 matmul, one-thread copy
bandwidth, the eager overhead per decoder layer and gloo all-reduce between 2 local processes (each
CPU process of a run computes with one thread; compute_units_per_node, the core count, lets the
simulator divide the cores when processes outnumber them), and the fixed costs per call that dominate
a tiny model's stages: the native engine's decode step, a training engine's forward and update, FSDP2's
host work per collective on 2 ranks, and the single controller's no-op call under Ray.

The device and the collective backend come from hybridflow.device, as everywhere else; the probes
import torch inside their functions. This module sits above both packages it joins: it measures with
hybridflow.parallel's launcher and writes hybridflow.mapping's HardwareProfile, which the planner reads
as data (the planner never imports torch, parallel's launcher or this module).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from typing import Callable

from hybridflow.mapping.hardware import GIB, LOCAL_PROFILE_NAMES, HardwareProfile, load_hardware, local_profile_dir

# The probes measure what kernels achieve, so the achievable fractions are 1; a process may fill this
# share of its slice of the RAM (CPU) or of the device memory (CUDA: context and allocator slack).
USABLE_MEMORY_FRACTION = {"cpu": 0.8, "cuda": 0.9}


def _best_seconds(fn: Callable[[], object], repeats: int, synchronize: Callable[[], None] = lambda: None) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up (the least disturbed by other processes)."""
    fn()
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


# ---- CPU probes (one thread, like every process of a hybridflow CPU run) ---------------------
def measure_matmul_flops(*, size: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of one thread multiplying two ``size`` x ``size`` matrices of ``dtype`` (2 size^3 FLOPs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        element = getattr(torch, dtype)
        left, right = torch.randn(size, size, dtype=element), torch.randn(size, size, dtype=element)
        out = torch.empty(size, size, dtype=element)
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


# ---- fixed costs per call (what dominates a tiny model's stages) ---------------------------
def intercept(seconds_small: float, seconds_large: float, small: int, large: int) -> float:
    """Seconds at 0 of the line through (small, seconds_small) and (large, seconds_large): the fixed part."""
    slope = (seconds_large - seconds_small) / (large - small)
    return seconds_small - slope * small


def _tiny_model_config():
    from hybridflow.models import ModelConfig

    return ModelConfig(tiny={}, dtype="float32")  # TINY_DEFAULTS: 4 layers, 64 wide, vocabulary 256


def measure_decode_overheads(*, layer_overhead_s: float, flops: float, bandwidth: float, batch: int = 64,
                             new_tokens: int = 16, repeats: int = 5) -> tuple[float, float]:
    """(``decode_step_overhead_s``, ``decode_host_seconds_per_sequence``): one thread of the native engine
    sampling from the tiny model, a decode step being the difference of ``new_tokens`` + 1 and 1 new tokens.

    At batch 1 a step beyond its layers' ``layer_overhead_s`` and its roofline (the weights streamed at
    ``bandwidth``) is the fixed cost per step; the growth from batch 1 to ``batch`` beyond the roofline's
    (its FLOPs at ``flops``) is the host time per sequence. Both as the simulator adds them."""
    import torch

    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig
    from hybridflow.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(_tiny_model_config())
        engine = GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict()))
        prompt_len, vocab = 8, model.config.vocab_size

        def step_seconds(rows: int) -> float:
            prompts = torch.randint(3, vocab, (rows, prompt_len), generator=torch.Generator().manual_seed(0))
            mask = torch.ones_like(prompts)
            total = {}
            for tokens in (1, new_tokens + 1):
                config = SamplingConfig(max_new_tokens=tokens, min_new_tokens=tokens, temperature=1.0)
                total[tokens] = _best_seconds(lambda: engine.generate(prompts, mask, config), repeats)
            return max(0.0, (total[new_tokens + 1] - total[1]) / new_tokens)

        single, batched = step_seconds(1), step_seconds(batch)
    finally:
        torch.set_num_threads(threads)
    layers = model.config.num_hidden_layers
    params = sum(parameter.numel() for name, parameter in model.named_parameters() if "embed" not in name)
    roofline = params * 4 / bandwidth  # fp32 weights streamed once; a batch-1 step's FLOPs are fewer
    step_overhead = max(0.0, single - layers * layer_overhead_s - roofline)
    per_sequence = max(0.0, (batched - single) / (batch - 1) - 2 * params / flops)
    return step_overhead, per_sequence


def engine_call_probe(rank: int, world_size: int, rows: tuple[int, int], repeats: int) -> dict[str, list[float]]:
    """Seconds of the tiny model's FSDP forward (log-probs) and train step at each of ``rows`` (per rank), in a
    process group started by hybridflow.parallel.launch: the fastest of ``repeats``."""
    import torch

    from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
    from hybridflow.models import build_model

    torch.set_num_threads(1)
    engine = TrainingEngine(EngineConfig(layout="fsdp", optim=OptimConfig(lr=1e-6)),
                            lambda: build_model(_tiny_model_config()))
    prompt_len, response_len = 8, 24
    seconds: dict[str, list[float]] = {"forward": [], "update": [], "layers": [engine.hf_config.num_hidden_layers]}

    def loss(outputs, micro_batch):
        mask = micro_batch["response_mask"]
        return -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"], {}

    for count in rows:
        ids = torch.randint(3, engine.hf_config.vocab_size, (count, prompt_len + response_len),
                            generator=torch.Generator().manual_seed(rank))
        mask = torch.ones_like(ids)
        batch = dict(input_ids=ids, attention_mask=mask, responses=ids[:, prompt_len:],
                     response_mask=mask[:, prompt_len:])
        seconds["forward"].append(_best_seconds(lambda: engine.forward(batch, outputs=("logprobs",)), repeats))
        seconds["update"].append(_best_seconds(lambda: engine.train_step(batch, loss), repeats))
    return seconds


def measure_engine_overheads(*, layer_overhead_s: float, link_latency_s: float, rows: tuple[int, int] = (2, 16),
                             repeats: int = 5) -> tuple[float, float, float]:
    """(``inference_call_overhead_s``, ``update_overhead_s``, ``fsdp_collective_overhead_s``) of the training
    engine on the tiny model, one thread per process.

    On one process, a forward's and a train step's seconds against their rows meet 0 rows at the fixed cost of
    a call, less the layers' ``layer_overhead_s`` (once forward, 3 times with backward) that the simulator
    charges already. Two FSDP ranks add to that fixed cost FSDP2's host work around its collectives: one
    all-gather per unit forward, two more and a reduce-scatter with backward (units: layers + root), each beyond
    the ring step's ``link_latency_s``."""
    from hybridflow.parallel.launch import run_distributed

    single = run_distributed(engine_call_probe, 1, rows, repeats, timeout_s=300)[0]
    pair = run_distributed(engine_call_probe, 2, rows, repeats, timeout_s=300)
    fixed = {kind: intercept(*single[kind], *rows) for kind in ("forward", "update")}
    # a collective ends when its slower rank gets there
    fixed_pair = {kind: max(intercept(*result[kind], *rows) for result in pair) for kind in fixed}
    layers = int(single["layers"][0])
    inference = max(0.0, fixed["forward"] - layers * layer_overhead_s)
    update = max(0.0, fixed["update"] - 3 * layers * layer_overhead_s)
    collectives = 4 * (layers + 1)  # forward 1, update 3 per unit
    added = fixed_pair["forward"] - fixed["forward"] + fixed_pair["update"] - fixed["update"]
    return inference, update, max(0.0, added / collectives - link_latency_s)


def _call_probe_worker() -> type:
    """A worker class whose one method returns its slice of the batch (defined here so that importing this module
    does not import the controller, torch and Ray; Ray ships the class to its processes by value)."""
    from hybridflow.controller import Worker, register

    class CallProbeWorker(Worker):
        @register("DP_PROTO")
        def echo(self, batch):
            return batch

    return CallProbeWorker


def measure_controller_call(*, calls: int = 50, rows: int = 8) -> float:
    """Median seconds of a call that does no work on a 2-process worker group under Ray, as the driver sees it:
    a ``rows``-row batch of token ids split over the ranks (DP_PROTO), each rank's slice sent back and joined
    (dispatch, serialization, the collect). Starts Ray for it when the driver is not connected, and stops it."""
    import statistics

    import ray
    import torch

    from hybridflow.controller import ResourcePool, WorkerGroup
    from hybridflow.protocol import DataProto

    started_here = not ray.is_initialized()
    pool = ResourcePool([2], name="calibrate-calls")
    group = WorkerGroup(pool, _call_probe_worker(), name="calibrate-calls")
    batch = DataProto.from_dict({"input_ids": torch.zeros(rows, 32, dtype=torch.long)})
    try:
        for _ in range(5):
            group.echo(batch)
        seconds = []
        for _ in range(calls):
            start = time.perf_counter()
            group.echo(batch)
            seconds.append(time.perf_counter() - start)
    finally:
        group.shutdown()
        pool.release()
        if started_here:
            ray.shutdown()
    return statistics.median(seconds)


# ---- CUDA probes -----------------------------------------------------------------------------
def measure_cuda_matmul_flops(*, tokens: int = 4096, hidden: int = 4096, repeats: int = 10) -> float:
    """bf16 (fp16 without bf16) FLOP/s of one GPU on a transformer MLP's product: [tokens, hidden] x
    [hidden, 4 hidden], the shape the training and prefill simulators charge at this rate."""
    import torch

    from hybridflow.device import current_device, default_dtype

    device = current_device(0)
    dtype = default_dtype() if default_dtype() != torch.float32 else torch.float16
    left = torch.randn(tokens, hidden, device=device, dtype=dtype)
    right = torch.randn(hidden, 4 * hidden, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: torch.matmul(left, right), repeats, torch.cuda.synchronize)
    return 2 * tokens * hidden * 4 * hidden / seconds


def measure_cuda_memory_bandwidth(*, num_bytes: int = 1024**3, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy of ``num_bytes`` (counted: read + write)."""
    import torch

    from hybridflow.device import current_device

    device = current_device(0)
    source = torch.ones(num_bytes // 2, device=device, dtype=torch.float16)
    target = torch.empty_like(source)
    return 2 * num_bytes / _best_seconds(lambda: target.copy_(source), repeats, torch.cuda.synchronize)


def measure_host_link_bandwidth(*, num_bytes: int = 256 * 1024**2, repeats: int = 5) -> float:
    """Bytes/s of a pinned host-to-device copy (PCIe or the chip-to-chip link)."""
    import torch

    from hybridflow.device import current_device

    device = current_device(0)
    host = torch.ones(num_bytes // 2, dtype=torch.float16).pin_memory()
    target = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    return num_bytes / _best_seconds(lambda: target.copy_(host, non_blocking=True), repeats, torch.cuda.synchronize)


# ---- collectives -----------------------------------------------------------------------------
def all_reduce_probe(rank: int, world_size: int, num_bytes: int, repeats: int) -> tuple[float, float]:
    """(seconds of a ``num_bytes`` all-reduce, seconds of a one-element all-reduce): the fastest of
    ``repeats``, in a process group started by hybridflow.parallel.launch (gloo on CPU, nccl on CUDA),
    each rank's tensors on the device hybridflow.device binds to it."""
    import torch
    import torch.distributed as dist

    from hybridflow.device import current_device, device_type

    device = current_device(rank)
    synchronize = torch.cuda.synchronize if device_type() == "cuda" else (lambda: None)
    large, small = torch.ones(num_bytes // 4, device=device), torch.ones(1, device=device)

    def timed(tensor) -> float:
        dist.barrier()
        synchronize()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize()
        return time.perf_counter() - start

    timed(large)
    large_seconds = min(timed(large) for _ in range(repeats))
    small_seconds = min(timed(small) for _ in range(max(repeats, 20)))
    return large_seconds, small_seconds


def measure_all_reduce(*, world_size: int = 2, num_bytes: int = 64 * 1024**2, repeats: int = 5) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency of one ring step s) of all-reduce between ``world_size`` local
    processes: bus bandwidth = 2 (g-1)/g bytes / seconds, the quantity the simulator's ring formula
    divides by; a one-element all-reduce takes 2 (g-1) ring steps."""
    from hybridflow.parallel.launch import run_distributed

    results = run_distributed(all_reduce_probe, world_size, num_bytes, repeats, timeout_s=120)
    large_seconds = max(result[0] for result in results)
    small_seconds = max(result[1] for result in results)
    steps = 2 * (world_size - 1)
    return 2 * (world_size - 1) / world_size * num_bytes / large_seconds, small_seconds / steps


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def calibrate_cpu(*, quick: bool = False) -> HardwareProfile:
    """Measure this machine's CPU as hybridflow CPU processes use it (profile ``cpu-local``)."""
    from hybridflow.device import CPU_BF16_MIN_HIDDEN, cpu_has_native_bf16

    repeats = 3 if quick else 5
    cores = os.cpu_count() or 1
    flops = measure_matmul_flops(size=512 if quick else 1024, repeats=repeats)
    # where the cores multiply bf16 in hardware, engine.dtype auto trains and generates wide models in bf16
    bf16_flops = (measure_matmul_flops(size=512 if quick else 1024, repeats=repeats, dtype="bfloat16")
                  if cpu_has_native_bf16() else None)
    bandwidth = measure_memory_bandwidth(num_bytes=(64 if quick else 256) * 1024**2, repeats=repeats)
    layer_overhead = measure_layer_overhead(repeats=repeats)
    link_bandwidth, link_latency = measure_all_reduce(num_bytes=(8 if quick else 64) * 1024**2, repeats=repeats)
    step_overhead, per_sequence = measure_decode_overheads(layer_overhead_s=layer_overhead, flops=flops,
                                                           bandwidth=bandwidth, new_tokens=8 if quick else 16,
                                                           repeats=repeats)
    inference_call, update, fsdp_collective = measure_engine_overheads(
        layer_overhead_s=layer_overhead, link_latency_s=link_latency, rows=(2, 8) if quick else (2, 16),
        repeats=2 if quick else repeats)
    controller_call = measure_controller_call(calls=20 if quick else 50)
    return HardwareProfile(
        name=LOCAL_PROFILE_NAMES["cpu"],
        device_memory_gib=round(total_memory_bytes() / cores / GIB, 3),
        usable_memory_fraction=USABLE_MEMORY_FRACTION["cpu"],
        peak_flops=flops, flops_fraction=1.0,
        memory_bandwidth=bandwidth, memory_bandwidth_fraction=1.0,
        intra_node_bandwidth=link_bandwidth, inter_node_bandwidth=link_bandwidth, link_bandwidth_fraction=1.0,
        intra_node_latency_s=link_latency, inter_node_latency_s=link_latency,
        compute_dtype="fp32", compute_units_per_node=cores, layer_overhead_s=layer_overhead,
        decode_step_overhead_s=step_overhead, decode_host_seconds_per_sequence=per_sequence,
        inference_call_overhead_s=inference_call, update_overhead_s=update,
        fsdp_collective_overhead_s=fsdp_collective, controller_call_overhead_s=controller_call,
        cpu_bf16_peak_flops=bf16_flops, cpu_bf16_min_hidden=CPU_BF16_MIN_HIDDEN if bf16_flops else 0,
        source=(f"measured by `hybridflow calibrate` on {platform.node()} ({cores} cores, "
                f"{platform.processor() or platform.machine()}) at {_stamp()}: one-thread fp32 matmul"
                f"{' (and bf16: the cores have bf16 instructions)' if bf16_flops else ''}, one-thread "
                f"copy bandwidth, eager tiny-Llama layer overhead, gloo all-reduce between 2 "
                f"local processes (inter-node taken equal: no second node), the fixed costs per call of the tiny "
                f"model's decode step, forward, update and 2-rank FSDP collectives and of a no-op call on a "
                f"2-process worker group under Ray; device memory = RAM / cores"),
    )


def calibrate_cuda(*, quick: bool = False, reference: str = "a100-80g") -> HardwareProfile:
    """Measure the local GPUs (profile ``cuda-local``). Numbers no probe here can measure (links
    between nodes, the rollout engine's host time per sequence) are taken from the built-in profile
    ``reference`` and named in the profile's source."""
    import torch

    from hybridflow.device import current_device, default_dtype

    repeats = 5 if quick else 10
    device = current_device(0)
    properties = torch.cuda.get_device_properties(device)
    flops = measure_cuda_matmul_flops(tokens=2048 if quick else 4096, repeats=repeats)
    bandwidth = measure_cuda_memory_bandwidth(num_bytes=(256 if quick else 1024) * 1024**2, repeats=repeats)
    known = load_hardware(reference)
    num_gpus = torch.cuda.device_count()
    if num_gpus >= 2:
        link_bandwidth, link_latency = measure_all_reduce(world_size=num_gpus, num_bytes=(64 if quick else 256)
                                                          * 1024**2, repeats=repeats)
        links = f"nccl all-reduce between the {num_gpus} local GPUs"
    else:
        link_bandwidth, link_latency = measure_host_link_bandwidth(repeats=repeats), known.intra_node_latency_s
        links = ("one GPU, so no GPU-to-GPU link to measure: the link numbers are the pinned host-to-device "
                 f"copy bandwidth and {reference}'s latency")
    return HardwareProfile(
        name=LOCAL_PROFILE_NAMES["cuda"],
        device_memory_gib=round(properties.total_memory / GIB, 3),
        usable_memory_fraction=USABLE_MEMORY_FRACTION["cuda"],
        peak_flops=flops, flops_fraction=1.0,
        memory_bandwidth=bandwidth, memory_bandwidth_fraction=1.0,
        intra_node_bandwidth=link_bandwidth, inter_node_bandwidth=min(link_bandwidth, known.inter_node_bandwidth),
        link_bandwidth_fraction=1.0,
        intra_node_latency_s=link_latency, inter_node_latency_s=max(link_latency, known.inter_node_latency_s),
        compute_dtype="bf16" if default_dtype() == torch.bfloat16 else "fp32",
        compute_units_per_node=0, layer_overhead_s=0.0,
        decode_host_seconds_per_sequence=known.decode_host_seconds_per_sequence,
        source=(f"measured by `hybridflow calibrate` on {platform.node()} ({properties.name}) at {_stamp()}: "
                f"bf16 [tokens, h] x [h, 4h] matmul, device-to-device copy bandwidth, {links}; inter-node "
                f"bandwidth and latency and the decode host time per sequence from {reference} (not measurable on "
                f"one node)"),
    )


def calibrate(*, quick: bool = False) -> HardwareProfile:
    """Measure the accelerator hybridflow.device picks (CUDA), else the CPU."""
    from hybridflow.device import device_type

    return calibrate_cuda(quick=quick) if device_type() == "cuda" else calibrate_cpu(quick=quick)


def calibrate_main(argv: list[str]) -> int:
    """`hybridflow calibrate [--output PATH] [--quick]`."""
    import sys

    parser = argparse.ArgumentParser(
        prog="hybridflow calibrate",
        description="Measure this machine's accelerator (CUDA: bf16 matmul FLOP/s, HBM bandwidth, nccl all-reduce; "
                    "else one CPU thread's fp32 matmul, copy bandwidth, gloo all-reduce between 2 processes and the "
                    "fixed costs per decode step, engine call, FSDP collective and controller call) and "
                    f"write the hardware profile '{LOCAL_PROFILE_NAMES['cuda']}' or '{LOCAL_PROFILE_NAMES['cpu']}' "
                    f"for `hybridflow plan --hardware`.")
    parser.add_argument("--output", help=f"profile file (default {local_profile_dir()}/<name>.json)")
    parser.add_argument("--quick", action="store_true", help="smaller probes (a few seconds, noisier)")
    args = parser.parse_args(argv)
    profile = calibrate(quick=args.quick)
    try:
        path = profile.save(args.output or local_profile_dir() / f"{profile.name}.json")
    except OSError as error:
        print(f"hybridflow calibrate: cannot write the profile to {args.output}: {error.strerror}", file=sys.stderr)
        return 2
    if profile.compute_dtype == "bf16":
        print(f"matmul (bf16): {profile.peak_flops / 1e12:.1f} TFLOP/s")
    else:
        print(f"matmul (fp32, 1 thread): {profile.peak_flops / 1e9:.1f} GFLOP/s")
        if profile.cpu_bf16_peak_flops is not None:
            print(f"matmul (bf16, 1 thread): {profile.cpu_bf16_peak_flops / 1e9:.1f} GFLOP/s (models at least "
                  f"{profile.cpu_bf16_min_hidden} wide compute in bf16 here)")
    print(f"memory bandwidth: {profile.memory_bandwidth / 1e9:.2f} GB/s")
    print(f"all-reduce: {profile.intra_node_bandwidth / 1e9:.3f} GB/s bus bandwidth, "
          f"{profile.intra_node_latency_s * 1e6:.1f} us per ring step")
    print(f"eager overhead per decoder layer: {profile.layer_overhead_s * 1e6:.0f} us")
    if profile.compute_dtype == "fp32":
        print(f"fixed costs: decode step {profile.decode_step_overhead_s * 1e3:.2f} ms "
              f"(+ {profile.decode_host_seconds_per_sequence * 1e6:.0f} us per sequence), inference call "
              f"{profile.inference_call_overhead_s * 1e3:.2f} ms, update {profile.update_overhead_s * 1e3:.2f} ms, "
              f"FSDP collective {profile.fsdp_collective_overhead_s * 1e3:.2f} ms, controller call "
              f"{profile.controller_call_overhead_s * 1e3:.2f} ms")
    print(f"memory per device: {profile.device_memory_gib:.2f} GiB; cores shared: {profile.compute_units_per_node}")
    print(f"wrote {path}  (use: hybridflow plan --hardware {profile.name})")
    return 0

