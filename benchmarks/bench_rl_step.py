"""Time of one RL step on the built-in tiny model (single-process mode), by stage: `python benchmarks/bench_rl_step.py`.

Prints generate / score (old + reference log-probs, values, reward model) / update seconds per step,
averaged over steps 2..N (step 1 pays one-off warm-up), for PPO (with critic and reward model) and GRPO.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from hybridflow.controller import local_mode
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config import load_rl_config
from hybridflow.trainers.ppo import RLTrainer


def measure(estimator: str, *, steps: int, prompts: int, samples: int, directory: Path) -> dict[str, float]:
    extra = ["reward.model.builtin=arithmetic"] if estimator == "gae" else []
    config = load_rl_config(None, [
        f"data.train_path={directory / 'train.jsonl'}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        f"algorithm.advantage_estimator={estimator}", "actor.generation.max_new_tokens=6",
        f"batch.prompts_per_step={prompts}", f"batch.samples_per_prompt={samples}",
        f"batch.mini_batch_size={prompts * samples}", f"trainer.total_steps={steps}", "trainer.progress_bar=false",
        f"trainer.output_dir={directory / estimator}", *extra])
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            history = trainer.fit()
        finally:
            trainer.shutdown()
    timed = history[1:] if len(history) > 1 else history
    return {name: statistics.mean(record[f"time/{name}_s"] for record in timed) for name in ("generate", "score", "update")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (1 is fastest at this size)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        write_jsonl(directory / "train.jsonl", prompt_rows(args.prompts * args.steps, split="train", seed=0,
                                                           config=ArithmeticTaskConfig()))
        for estimator in ("gae", "grpo"):
            times = measure(estimator, steps=args.steps, prompts=args.prompts, samples=args.samples,
                            directory=directory)
            total = sum(times.values())
            print(f"{estimator:5s} samples/step={args.prompts * args.samples:4d}  "
                  + "  ".join(f"{name}={seconds:.2f}s" for name, seconds in times.items()) + f"  total={total:.2f}s")


if __name__ == "__main__":
    main()
