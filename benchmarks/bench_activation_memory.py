"""Peak host memory of one training step with and without activation checkpointing (CPU, one process).

Each setting runs in a fresh child process (peak RSS only grows within a process): build the engine, take
one warm-up step at a small budget, then one step whose micro-batch holds ``--tokens`` tokens, and report the
peak resident memory (``ru_maxrss``) above the resident memory before that step, with the step's time, and
per token beside the estimate ``micro_batch_tokens: auto`` sizes its budget with
(``hybridflow.engine.token_budget.activation_bytes_per_token``: it should not be below the measurement).

    python benchmarks/bench_activation_memory.py --tokens 8192 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    import torch

    from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
    from hybridflow.engine.token_budget import activation_bytes_per_token
    from hybridflow.models import ModelConfig, build_model

    model_config = ModelConfig(tiny=dict(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                         vocab_size=4096, max_position_embeddings=args.tokens))
    config = EngineConfig(micro_batch_tokens=args.tokens, dtype=args.dtype, optim=OptimConfig(lr=1e-5),
                          activation_checkpointing=args.activation_checkpointing == "on")
    engine = TrainingEngine(config, lambda: build_model(model_config, seed=0))
    rows = args.tokens // args.row_tokens

    def batch(num_rows):
        ids = torch.randint(3, 4096, (num_rows, args.row_tokens), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        half = args.row_tokens // 2
        return dict(input_ids=ids, attention_mask=mask, responses=ids[:, half:], response_mask=mask[:, half:])

    def loss_fn(outputs, micro_batch):
        mask = micro_batch["response_mask"]
        return -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"], {}

    engine.train_step(batch(1), loss_fn, outputs=("logprobs",))  # warm-up: optimizer state, allocator pools
    before = current_rss_bytes()
    start = time.perf_counter()
    metrics = engine.train_step(batch(rows), loss_fn, outputs=("logprobs",))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    estimate = activation_bytes_per_token(engine.hf_config, compute_dtype=engine.compute_dtype, trainable=True,
                                          activation_checkpointing=args.activation_checkpointing == "on")
    print(json.dumps(dict(activation_checkpointing=args.activation_checkpointing, tokens=rows * args.row_tokens,
                          layers=args.layers, hidden=args.hidden,
                          micro_batches=engine.last_batch_stats["micro_batches"],
                          rss_before_mib=round(before / 2**20), peak_rss_mib=round(peak / 2**20),
                          step_peak_above_before_mib=round((peak - before) / 2**20), dtype=args.dtype,
                          measured_kib_per_token=round((peak - before) / rows / args.row_tokens / 1024, 1),
                          estimated_kib_per_token=round(estimate / 1024, 1), step_s=round(seconds, 1),
                          loss=round(metrics["loss"], 5))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the measured step's one micro-batch")
    parser.add_argument("--row-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--activation-checkpointing", choices=("off", "on"), default=None,
                        help="run one setting in this process (the parent runs both in children)")
    args = parser.parse_args()
    if args.activation_checkpointing is not None:
        child(args)
        return
    for setting in ("off", "on"):
        command = [sys.executable, __file__, "--tokens", str(args.tokens), "--row-tokens", str(args.row_tokens),
                   "--layers", str(args.layers), "--hidden", str(args.hidden), "--dtype", args.dtype,
                   "--activation-checkpointing", setting]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
