"""Train-step and inference time of packed micro-batches by attention implementation and token budget.

    python benchmarks/bench_packed_attention.py --models tiny small smollm2 --threads 2
    python benchmarks/bench_packed_attention.py --models smollm2 --attention sdpa --dtypes float32 bfloat16

One update (forward + backward + optimizer) and one no-grad forward over an RL-like batch (128 rows
of a 14-20 token prompt and a 1-32 token response) through ``TrainingEngine``; ``eager`` is the dense
N x N mask, ``sdpa`` the packed SDPA path (the default). Median of ``--repeats`` after one warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from hybridflow.engine import EngineConfig, TrainingEngine
from hybridflow.models import ModelConfig, build_model
from hybridflow.models.smollm2 import smollm2_path

MODELS = {
    "tiny": dict(tiny=dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4)),
    "small": dict(tiny=dict(vocab_size=32, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8)),
}


def rl_batch(rows: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    prompt, response = 20, 32
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(rows):
        left = int(torch.randint(0, 7, (), generator=generator))
        right = int(torch.randint(0, response, (), generator=generator))
        mask[row, :left] = 0
        if right:
            mask[row, -right:] = 0
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, -response:], response_mask=mask[:, -response:])


def loss_fn(outputs, batch):
    loss = -(outputs["logprobs"] * batch["response_mask"]).sum() / batch["num_tokens_global"]
    return loss, {}


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small", "smollm2"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--attention", nargs="+", default=["eager", "sdpa"])
    parser.add_argument("--dtypes", nargs="+", default=["float32"],
                        help="compute dtypes (autocast); log-prob error is reported against float32")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f}, threads {args.threads}, rows {args.rows}")
    for name in args.models:
        if name == "smollm2":
            path = smollm2_path()
            if path is None:
                print("smollm2: no converted checkpoint, skipped")
                continue
            fields = dict(path=path)
        else:
            fields = MODELS[name]
        for attention in args.attention:
            model_config = ModelConfig(dtype="float32", attn_implementation=attention, **fields)
            for dtype in args.dtypes:
                for budget in args.budgets:
                    engine = TrainingEngine(EngineConfig(micro_batch_tokens=budget, dtype=dtype),
                                            lambda: build_model(model_config))
                    batch = rl_batch(args.rows, min(engine.hf_config.vocab_size, 200))
                    update = timed(lambda: engine.train_step(batch, loss_fn, outputs=("logprobs",)), args.repeats)
                    forward = timed(lambda: engine.forward(batch, outputs=("logprobs",)), args.repeats)
                    # log-prob error against the fp32 forward of the same (updated) weights
                    logprobs = engine.forward(batch, outputs=("logprobs",))["logprobs"]
                    mask = batch["response_mask"].bool()
                    error = ""
                    if dtype != "float32":
                        engine.config = dataclasses.replace(engine.config, dtype="float32")
                        exact = engine.forward(batch, outputs=("logprobs",))["logprobs"]
                        diff = (logprobs - exact)[mask].abs()
                        error = f"  logprob |err| mean={float(diff.mean()):.2e} max={float(diff.max()):.2e}"
                    print(f"{name:8s} {attention:6s} {dtype:8s} budget={budget:5d} micro_batches="
                          f"{engine.last_batch_stats['micro_batches']:3d}  update={update:.3f}s  "
                          f"forward={forward:.3f}s{error}", flush=True)

if __name__ == "__main__":
    main()
