"""A PPO step with the critic's value pass folded into its update, and with the separate pass, in one process.

`python benchmarks/bench_redundant_passes.py --model small` runs PPO on benchmarks/vs_trl's assets (its
random-init models, addition prompts, a reward model and critic from the policy's backbone, 32 prompts x 1
sample, exactly 32 new tokens, one mini-batch per step, local mode) and alternates step by step between the
folded critic pass (``perf/critic_values_folded``, the default here) and the separate value forward, so both
see the machine's drift alike. Prints the median step, generate / score / update seconds of each after the
warm-up steps, and the ratio. ``--model smollm2`` needs the converted checkpoint (scripts/get_smollm2.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))

from assets import build_prompts, build_score_model_dir, policy_dir  # noqa: E402

from hybridflow.trainers.config import load_rl_config  # noqa: E402
from hybridflow.trainers.ppo import RLTrainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "small", "smollm2"), default="small")
    parser.add_argument("--steps", type=int, default=30, help="measured steps, alternating (half each)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_redundant_"))
    policy = policy_dir(args.model, work / "models")
    score = build_score_model_dir(policy, work / "models")
    total = args.warmup + args.steps
    prompts = build_prompts(work / "prompts.jsonl", 32 * total)
    config = load_rl_config(None, [
        f"data.train_path={prompts}", "data.chat_template=never", f"actor.model.path={policy}",
        f"reward.model={{path: {score}}}", f"critic.model={{path: {score}}}", "algorithm.advantage_estimator=gae",
        "algorithm.kl_mode=reward", "algorithm.kl_coef=0.05", "actor.generation.max_new_tokens=32",
        "actor.generation.min_new_tokens=32", "actor.generation.temperature=1.0", "actor.engine.optim.lr=1e-5",
        "critic.engine.optim.lr=1e-5", "batch.prompts_per_step=32", "batch.samples_per_prompt=1",
        "batch.mini_batch_size=32", f"trainer.total_steps={total}", "trainer.progress_bar=false",
        f"trainer.output_dir={work / 'run'}"])
    trainer = RLTrainer(config, tensorboard=False, mode="local")
    if not trainer.folds_critic_values:
        raise SystemExit("this config does not fold the critic's value pass (see trainers/redundant_passes.py)")
    records: dict[bool, list[tuple[float, float, float, float]]] = {True: [], False: []}
    step_fn = trainer.train_step

    def alternating(prompts_batch):
        folded = trainer.step % 2 == 1
        trainer.folds_critic_values = folded
        metrics = step_fn(prompts_batch)
        if trainer.step > args.warmup:
            records[folded].append((metrics["time/generate_s"] + metrics["time/score_s"] + metrics["time/update_s"],
                                    metrics["time/generate_s"], metrics["time/score_s"], metrics["time/update_s"]))
        return metrics

    trainer.train_step = alternating
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    medians = {}
    for folded, rows in records.items():
        step, generate, score_s, update = (statistics.median(column) for column in zip(*rows))
        medians[folded] = step
        print(f"{args.model} {'folded' if folded else 'separate':8s} step={step:.4f}s generate={generate:.4f} "
              f"score={score_s:.4f} update={update:.4f} steps={len(rows)}", flush=True)
    print(f"{args.model} separate / folded step time: {medians[False] / medians[True]:.3f}x  "
          f"(load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
