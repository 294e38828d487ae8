"""Training steps on CPU with the host allocator kept (the default) vs glibc's own: seconds, page faults, system time.

Wall seconds on a shared 2-core machine vary by 20% from step to step; the CPU seconds (user + system) are
the steadier comparison. Each setting runs in a fresh process (``HYBRIDFLOW_HOST_ALLOCATOR`` is read once per process): a
``TrainingEngine`` on SmolLM2-135M (or the tiny model with ``--model tiny``) trains a fixed RL-shaped
batch (prompts left-padded, responses of mixed lengths) for a few steps; every step prints its wall
seconds, minor page faults, system CPU seconds and the process's peak resident memory.

    python benchmarks/bench_host_allocator.py                    # SmolLM2, 64 rows, 4 steps per setting
    python benchmarks/bench_host_allocator.py --model tiny --rows 128
    python benchmarks/bench_host_allocator.py --settings keep --micro-batch-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

STEP_SCRIPT = r"""
import json, resource, sys, time
import torch
from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import ModelConfig, build_model, smollm2_path
model, rows, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
config = ModelConfig(tiny={}, dtype="float32") if model == "tiny" else ModelConfig(path=smollm2_path(), dtype="float32")
mbt = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
engine = TrainingEngine(EngineConfig(micro_batch_tokens=mbt, optim=OptimConfig(lr=1e-6)), lambda: build_model(config))
P, R = 24, 32
generator = torch.Generator().manual_seed(0)
ids = torch.randint(3, engine.hf_config.vocab_size, (rows, P + R), generator=generator)
mask = torch.ones_like(ids)
for row in range(rows):
    prompt = int(torch.randint(P - 8, P + 1, (1,), generator=generator))
    response = R if row % 3 else int(torch.randint(R // 2, R, (1,), generator=generator))
    mask[row, :P - prompt] = 0
    mask[row, P + response:] = 0
batch = dict(input_ids=ids, attention_mask=mask, responses=ids[:, P:], response_mask=mask[:, P:])
def loss(outputs, micro_batch):
    return -(outputs["logprobs"] * micro_batch["response_mask"]).sum() / micro_batch["num_tokens_global"], {}
for step in range(steps):
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    engine.train_step(batch, loss)
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"step": step, "seconds": time.perf_counter() - start, "faults": after.ru_minflt - before.ru_minflt,
                      "system_s": after.ru_stime - before.ru_stime, "user_s": after.ru_utime - before.ru_utime, "peak_gib": after.ru_maxrss / 2**20,
                      "tokens": int(mask.sum())}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--settings", nargs="+", choices=["keep", "system"], default=["keep", "system"])
    args = parser.parse_args()
    if args.model == "smollm2":
        from hybridflow.models import smollm2_path

        if smollm2_path() is None:
            sys.exit("SmolLM2-135M not converted (python scripts/get_smollm2.py), or use --model tiny")
    print(f"load average before: {os.getloadavg()}")
    for setting in args.settings:
        env = dict(os.environ, HYBRIDFLOW_HOST_ALLOCATOR=setting, CUDA_VISIBLE_DEVICES="")
        out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, args.model, str(args.rows), str(args.steps),
                              str(args.threads), str(args.micro_batch_tokens)], env=env, capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            row = json.loads(line)
            print(f"{setting:6s} step {row['step']}: {row['seconds']:7.2f} s  {row['faults']:9d} faults  "
                  f"user {row['user_s']:6.2f} s  system {row['system_s']:6.2f} s  peak {row['peak_gib']:5.2f} GiB  ({row['tokens']} tokens)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
