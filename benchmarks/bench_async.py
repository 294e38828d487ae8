"""Pipelined asynchronous RL against the synchronous step on the same two processes (one training process, one
rollout process, on Ray): `python benchmarks/bench_async.py [--steps 8] [--staleness 0 1] [--mode pipelined ...]`.

Both runs place the actor on pool ``trainer`` and the generation replica on pool ``gen`` (one CPU slot each);
k = 0 syncs the weights and generates before every update (the processes take turns), k = 1 generates batch
i + 1 while batch i trains. `--mode pipelined streaming` runs every k >= 1 in each mode (streaming: requests in
flight, weights updated between decode rounds; k = 0 is the synchronous step, run once); `--backend vllm`: the
replica generates with vLLM. Prints steps per second over steps 2..N (step 1 pays the workers' warm-up), the mean
response length (`--free-lengths`: responses end at EOS instead of all being --new-tokens long) and the load average
before and after each run (the numbers scale with what else the machine runs).

`--checksum` instead times the weight-sync checksum (``tensor_checksum``) of a 16 M-value bf16 tensor against a
plain copy of it (the cost docs/async.md states).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer


def run(staleness: int, *, steps: int, directory: Path, new_tokens: int, prompts: int,
        mode: str = "pipelined", free_lengths: bool = False, backend: str = "native") -> dict[str, float]:
    config = load_rl_config(None, [
        f"data.train_path={directory / 'train.jsonl'}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        f"actor.generation.max_new_tokens={new_tokens}",
        f"actor.generation.min_new_tokens={0 if free_lengths else new_tokens}",
        "actor.engine.optim.lr=1e-4", "algorithm.advantage_estimator=grpo", f"batch.prompts_per_step={prompts}",
        "batch.samples_per_prompt=4", f"batch.mini_batch_size={prompts * 4}", f"trainer.total_steps={steps}",
        "trainer.progress_bar=false", f"trainer.output_dir={directory / f'{mode}-k{staleness}'}",
        "actor.loss.tis_cap=2.0", "placement.pools={trainer: [1], gen: [1]}",
        "placement.roles={actor: trainer, rollout: gen}", "placement.runtime=ray",
        f"async.max_staleness={staleness}", f"async.mode={mode}", f"actor.generation.backend={backend}",
        *(["actor.generation.vllm_kv_cache_gib=0.125"] if backend == "vllm" else [])])
    load_before = os.getloadavg()[0]
    trainer = RLTrainer(config, tensorboard=False)
    stamps = []
    try:
        trainer.fit(on_step=lambda step, metrics: stamps.append(time.perf_counter()))
        history = trainer.logger.history
    finally:
        trainer.shutdown()
    steps_per_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    sync_s = sum(m["async/sync_s"] for m in history[1:]) / (len(history) - 1)
    wait_s = sum(m["async/wait_generation_s"] for m in history[1:]) / (len(history) - 1)
    streamed = {"stale_regenerated": sum(m["async/stale_regenerated_groups"] for m in history),
                "multi_version": sum(m["async/multi_version_fraction"] for m in history) / len(history)
                } if mode == "streaming" else {}
    return {"mode": mode, "k": staleness, "steps_per_s": steps_per_s, "sync_s": sync_s, "wait_generation_s": wait_s,
            "length_mean": sum(m["response/length_mean"] for m in history) / len(history),
            "length_min": min(m["response/length_min"] for m in history), **streamed,
            "sync_mb": history[-1]["async/sync_bytes"] / 2**20, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def time_checksum(numel: int = 16_000_000) -> None:
    """Seconds (best of 3) of the checksum and of a copy of one bf16 tensor, and their GB/s."""
    import torch

    from hybridflow.engine.weight_sync import tensor_checksum

    tensor = torch.randn(numel).to(torch.bfloat16)
    for name, work in (("copy", tensor.clone), ("checksum", lambda: tensor_checksum(tensor))):
        seconds = []
        for _ in range(3):
            started = time.perf_counter()
            work()
            seconds.append(time.perf_counter() - started)
        best = min(seconds)
        print(f"{name} {best:.4f} s | {numel * 2 / best / 1e9:.2f} GB/s | load {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--mode", choices=["pipelined", "streaming"], nargs="+", default=["pipelined"],
                        help="async.mode of the runs with k >= 1 (each k in each mode)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--free-lengths", action="store_true",
                        help="responses end at EOS (lengths vary) instead of all --new-tokens long")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--backend", default="native", help="actor.generation.backend of the rollout replica")
    parser.add_argument("--checksum", action="store_true", help="time the weight checksum against a copy")
    args = parser.parse_args()
    if args.checksum:
        return time_checksum()
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_jsonl(directory / "train.jsonl", prompt_rows(256, split="train", seed=0,
                                                           config=ArithmeticTaskConfig(max_digits=2)))
        runs = [(staleness, mode) for staleness in args.staleness
                for mode in (args.mode if staleness else ["pipelined"])]
        for staleness, mode in runs:
            result = run(staleness, steps=args.steps, directory=directory, new_tokens=args.new_tokens,
                         prompts=args.prompts, mode=mode, free_lengths=args.free_lengths, backend=args.backend)
            print(" | ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                             for key, value in result.items()), flush=True)


if __name__ == "__main__":
    main()
