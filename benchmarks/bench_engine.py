"""Training-engine benchmark: tokens/s, peak memory per rank and achieved FLOP/s per layout.

Trains a few steps of every layout on a batch with skewed lengths (a few long responses, many
short), prints one row per (model, layout) and the padding ratio the packed micro-batches reach.
Achieved FLOP/s counts 6 * matmul parameters * real tokens per step (attention scores ignored) and
is compared with this machine's fp32 matmul FLOP/s, measured in the same run on the devices the
layout uses (one torch thread per rank on CPU, as the launcher gives every rank).

    python benchmarks/bench_engine.py                      # tiny model, every layout
    python benchmarks/bench_engine.py --model smollm2      # SmolLM2-135M (if converted)
    python benchmarks/bench_engine.py --layouts single,dp2,fsdp2 --core-share   # 1 process x 2 threads vs 2 x 1
    python benchmarks/bench_engine.py --model both --optimizer   # AdamW step: PyTorch's CPU default vs fused
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from hybridflow.device import current_device, device_type
from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import ModelConfig, build_model, smollm2_path
from hybridflow.parallel.launch import run_distributed

LAYOUTS = {
    "tiny": [("single", 1, {}), ("dp2", 2, dict(layout="3d")), ("fsdp2", 2, dict(layout="fsdp")),
             ("tp2", 2, dict(layout="3d", tp_size=2)), ("pp2", 2, dict(layout="3d", pp_size=2)),
             ("tp2_dp2", 4, dict(layout="3d", tp_size=2)), ("tp2_pp2", 4, dict(layout="3d", tp_size=2, pp_size=2))],
    # SmolLM2 has 9 attention heads: tp 3, not 2
    "smollm2": [("single", 1, {}), ("dp2", 2, dict(layout="3d")), ("fsdp2", 2, dict(layout="fsdp")),
                ("pp2", 2, dict(layout="3d", pp_size=2)), ("tp3", 3, dict(layout="3d", tp_size=3))],
}


def model_config(model: str) -> ModelConfig:
    if model == "tiny":
        return ModelConfig(tiny={}, dtype="float32")
    return ModelConfig(path=smollm2_path(), dtype="float32")


def skewed_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> dict:
    """Prompts left-padded to prompt_len, responses right-padded to response_len; 1 in 4 responses is long."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt_len + response_len), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(rows):
        prompt = int(torch.randint(prompt_len // 2, prompt_len + 1, (1,), generator=generator))
        long_response = row % 4 == 0
        response = response_len if long_response else int(torch.randint(1, response_len // 8 + 2, (1,),
                                                                         generator=generator))
        mask[row, :prompt_len - prompt] = 0
        mask[row, prompt_len + response:] = 0
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, prompt_len:],
                response_mask=mask[:, prompt_len:])


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"]
    return -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"], {}


def matmul_flops(size: int = 1024, repeats: int = 10) -> float:
    """fp32 matmul FLOP/s of one device (one torch thread on CPU)."""
    device = current_device(0)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b
    if device_type() == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device_type() == "cuda":
        torch.cuda.synchronize()
    return 2 * size ** 3 * repeats / (time.perf_counter() - start)


def peak_memory_mb() -> float:
    if device_type() == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: the process peak RSS


def bench_rank(rank, world_size, model, layout, args):
    if args.core_share:  # the cores split among the ranks, as the trainer's workers get them (controller/host.py)
        from hybridflow.controller.host import threads_per_worker

        torch.set_num_threads(threads_per_worker(world_size))
    config = EngineConfig(micro_batch_tokens=args.micro_batch_tokens, optim=OptimConfig(lr=1e-5), **layout)
    engine = TrainingEngine(config, lambda: build_model(model_config(model)))
    batch = skewed_batch(args.rows, args.prompt_len, args.response_len, engine.hf_config.vocab_size)
    rows = args.rows // engine.layout.dp_size
    start = engine.coords.dp_rank * rows
    local = {key: value[start:start + rows] for key, value in batch.items()}
    engine.train_step(local, nll_loss)  # warm-up: allocations, pipeline setup
    began = time.perf_counter()
    for _ in range(args.steps):
        engine.train_step(local, nll_loss)
    if device_type() == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    return {"elapsed": elapsed, "peak_mb": peak_memory_mb(), **engine.last_batch_stats,
            "dp_rank": engine.coords.dp_rank, "is_replica_head": engine.coords.tp_rank == 0
            and engine.coords.pp_rank == 0}


def matmul_params(model: str) -> int:
    """Parameters used in matmuls per token: all but the embedding lookup (+ the tied output head)."""
    meta = build_model(model_config(model), device="meta")
    total = sum(p.numel() for p in meta.parameters())
    embedding = meta.model.embed_tokens.weight.numel()
    tied = getattr(meta.config, "tie_word_embeddings", False)
    return total - embedding + (embedding if tied else 0)


def bench_optimizer(model: str, repeats: int = 5) -> None:
    """Seconds of one AdamW step over the model's parameters (random gradients, all cores): PyTorch's CPU
    default (one tensor at a time), the multi-tensor ``foreach`` form, and the fused kernel the engine uses."""
    params = [p for p in build_model(model_config(model), device=current_device()).parameters()]
    cells = []
    for label, options in (("default", {}), ("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer = torch.optim.AdamW(params, lr=1e-5, **options)
        optimizer.step()  # creates the moments
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            optimizer.step()
            best = min(best, time.perf_counter() - start)
        cells.append(f"{label} {best * 1e3:.1f} ms")
    total = sum(p.numel() for p in params)
    print(f"{model}: AdamW step over {len(params)} tensors, {total / 1e6:.1f} M parameters, "
          f"{torch.get_num_threads()} threads, best of {repeats}: " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2", "both"], default="tiny")
    parser.add_argument("--layouts", default="", help="comma-separated layout names (default: all)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--core-share", action="store_true",
                        help="each rank uses cores // ranks torch threads (the trainer's rule) instead of one; "
                             "'of peak' is then against the all-core matmul")
    parser.add_argument("--optimizer", action="store_true",
                        help="only time one AdamW step: PyTorch's CPU default, foreach and fused")
    args = parser.parse_args()
    models = ["tiny", "smollm2"] if args.model == "both" else [args.model]
    if "smollm2" in models and smollm2_path() is None:
        print("SmolLM2-135M not converted (python scripts/get_smollm2.py): skipping it")
        models.remove("smollm2")
    if args.optimizer:
        for model in models:
            bench_optimizer(model)
        return
    torch.set_num_threads(1)
    peak_per_device = matmul_flops()
    cores = os.cpu_count() or 1
    if args.core_share and device_type() == "cpu":  # one "device" = all the cores, shared by the ranks
        torch.set_num_threads(cores)
        peak_per_device = matmul_flops()
        cores = 1
    print(f"device: {device_type()}, cpu cores: {cores}, fp32 matmul per device: {peak_per_device / 1e9:.2f} GFLOP/s")
    wanted = set(filter(None, args.layouts.split(",")))
    print(f"{'model':8} {'layout':8} {'ranks':>5} {'tokens/s':>9} {'peak MB/rank':>12} {'GFLOP/s':>8} "
          f"{'of peak':>7} {'micro-b':>7} {'padding':>7} {'padding':>7}")
    print(f"{'':8} {'':8} {'':>5} {'':>9} {'(max)':>12} {'':>8} {'':>7} {'(rank0)':>7} {'packed':>7} {'padded':>7}")
    for model in models:
        params = matmul_params(model)
        for name, world, layout in LAYOUTS[model]:
            if wanted and name not in wanted:
                continue
            results = run_distributed(bench_rank, world, model, layout, args, timeout_s=600)
            elapsed = max(r["elapsed"] for r in results)
            heads = [r for r in results if r["is_replica_head"]]  # one rank per data-parallel replica
            real = sum(r["real_tokens"] for r in heads)
            computed = sum(r["computed_tokens"] for r in heads)
            padded = sum(r["padded_tokens"] for r in heads)
            tokens_per_s = real * args.steps / elapsed
            flops = 6 * params * tokens_per_s
            devices = world if device_type() == "cuda" else min(world, cores)
            print(f"{model:8} {name:8} {world:5d} {tokens_per_s:9.0f} {max(r['peak_mb'] for r in results):12.0f} "
                  f"{flops / 1e9:8.2f} {flops / (peak_per_device * devices):7.1%} {results[0]['micro_batches']:7d} "
                  f"{1 - real / computed:7.1%} {1 - real / padded:7.1%}")


if __name__ == "__main__":
    main()
