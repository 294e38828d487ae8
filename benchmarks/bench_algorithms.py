"""The RL algorithms side by side on the built-in task: held-out accuracy after N steps and seconds per step.

Every run starts from the demo's SFT policy (docs/demo.md: a 2,000-step base model, then 300 SFT
steps on an imperfect demonstrator who drops the digit opened by the final carry; about 37% of the
held-out problems right) and trains against the exact checker as a rule reward (1 right, 0 wrong),
the way GRPO/DAPO-style recipes train on verifiable tasks. Same seed, data, batch (32 prompts x 4
samples, mini-batches of 64), learning rate and step count for every algorithm; only the
algorithm keys differ (ALGORITHMS below). Accuracy: greedy answers to 256 eval-split problems,
exact checker, before and after. Seconds per step: mean wall time of the RL steps (validation
excluded), local mode (every role in one process).

    python benchmarks/bench_algorithms.py --out /tmp/bench_algorithms --val-at 1,2,3,5,10   # all; ~5 min SFT + ~5 min
    python benchmarks/bench_algorithms.py --out /tmp/bench_algorithms --runs grpo,dapo --steps 10

The SFT policy is cached in --out (delete it to retrain). Prints a markdown table; also writes
results.json there.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

STEPS, PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MINI_BATCH = 20, 32, 4, 64
MAX_NEW_TOKENS = 8  # correct answers take <= 4 tokens (3 reversed digits + EOS): room for DAPO's overlong buffer
ACTOR_LR = 1e-4

_GSPO_CLIP = ("actor.loss.clip_ratio_low=3e-4", "actor.loss.clip_ratio_high=4e-4")
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "ppo": ("algorithm.advantage_estimator=gae", "algorithm.kl_coef=0.02", "critic.engine.optim.lr=1e-3"),
    "grpo": ("algorithm.advantage_estimator=grpo",),
    "grpo_seq_mean": ("algorithm.advantage_estimator=grpo", "actor.loss.loss_aggregation=seq-mean-token-mean"),
    "dr_grpo": ("algorithm.advantage_estimator=dr_grpo", "actor.loss.loss_aggregation=seq-mean-token-sum-norm"),
    "rloo": ("algorithm.advantage_estimator=rloo",),
    "dapo": ("algorithm.advantage_estimator=grpo", "algorithm.kl_mode=none", "actor.loss.clip_ratio_low=0.2",
             "actor.loss.clip_ratio_high=0.28", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3",
             "algorithm.overlong_buffer_length=3", "algorithm.overlong_penalty_factor=1.0",
             "algorithm.overlong_filter=true"),
    "gspo": ("algorithm.advantage_estimator=grpo", "actor.loss.policy_loss=gspo", *_GSPO_CLIP,
             "actor.loss.loss_aggregation=seq-mean-token-mean"),
    "cispo": ("algorithm.advantage_estimator=grpo", "actor.loss.policy_loss=cispo", "actor.loss.clip_ratio_low=1.0",
              "actor.loss.clip_ratio_high=0.28"),
    "grpo_tis": ("algorithm.advantage_estimator=grpo", "actor.loss.tis_cap=2.0"),
}
"""Run name -> the config keys that make it that algorithm (on top of the shared ones in ``run_one``)."""


def sft_policy(out: Path) -> tuple[str, dict]:
    """The demo's base model and SFT policy (cached); returns (policy model dir, data files)."""
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import prompt_rows
    from hybridflow.trainers.demo import DemoConfig, _task, train_sft, write_task_data

    config = DemoConfig(output_dir=str(out))
    files = write_task_data(config, out / "data")
    files["rl_prompts"] = write_jsonl(out / "data" / "rl_prompts.jsonl", prompt_rows(
        STEPS * PROMPTS_PER_STEP * 4, split="train", seed=config.seed + 7, config=_task(config)))
    policy = out / "sft" / "model"
    if not (policy / "model.safetensors").exists():
        base = out / "base" / "model"
        if not (base / "model.safetensors").exists():
            train_sft(config, files["sft_base"], out / "base", steps=config.base_steps, lr=config.base_lr,
                      init_dir=None, tensorboard=False)
        train_sft(config, files["sft_policy"], out / "sft", steps=config.sft_steps, lr=config.sft_lr,
                  init_dir=str(base), tensorboard=False)
    return str(policy), files


def run_one(name: str, policy_dir: str, files: dict, out: Path, steps: int, val_at: list[int]) -> dict:
    """``steps`` RL steps of one algorithm; held-out accuracy before, after the ``val_at`` steps and at the end;
    seconds per RL step (validation excluded)."""
    from hybridflow.controller import local_mode
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    config = load_rl_config(None, [
        f"data.train_path={files['rl_prompts']}", f"data.val_path={files['prompts_eval']}",
        f"actor.model.path={policy_dir}", f"actor.engine.optim.lr={ACTOR_LR}",
        f"actor.generation.max_new_tokens={MAX_NEW_TOKENS}", "reward.function=arithmetic",
        f"batch.prompts_per_step={PROMPTS_PER_STEP}", f"batch.samples_per_prompt={SAMPLES_PER_PROMPT}",
        f"batch.mini_batch_size={MINI_BATCH}", f"trainer.total_steps={steps}", "trainer.val_every=0",
        "trainer.val_function=arithmetic", f"trainer.output_dir={out / 'runs' / name}", "trainer.resume=false",
        "trainer.overwrite=true",
        "trainer.progress_bar=false", *ALGORITHMS[name]])
    seconds: list[float] = []
    accuracy: dict[int, float] = {}
    clock = {"start": 0.0}

    def on_step(step: int, metrics: dict) -> None:
        seconds.append(time.perf_counter() - clock["start"])
        if step in val_at:
            accuracy[step] = trainer.validate()["val/function_mean"]
        clock["start"] = time.perf_counter()

    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            before = trainer.validate()["val/function_mean"]
            clock["start"] = time.perf_counter()
            history = trainer.fit(on_step=on_step)
            after = trainer.validate()["val/function_mean"]
        finally:
            trainer.shutdown()
    result = {"name": name, "keys": list(ALGORITHMS[name]), "steps": steps, "accuracy_before": before,
              "accuracy_at": accuracy, "accuracy_after": after, "seconds_per_step": sum(seconds) / len(seconds),
              "train_score_first": history[0]["reward/score_mean"],
              "train_score_last": history[-1]["reward/score_mean"]}
    if "sampling/prompts_drawn" in history[0]:
        result["prompts_drawn_per_step"] = sum(r["sampling/prompts_drawn"] for r in history) / len(history)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="working directory (the SFT policy is cached here)")
    parser.add_argument("--runs", default=",".join(ALGORITHMS), help=f"comma-separated subset of {list(ALGORITHMS)}")
    parser.add_argument("--steps", type=int, default=STEPS, help="RL steps per algorithm")
    parser.add_argument("--val-at", default="5,10", help="also measure held-out accuracy after these steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: no oversubscription on a "
                                                                 "shared machine)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    policy_dir, files = sft_policy(args.out)
    results = []
    print(f"load average at start: {os.getloadavg()}")
    val_at = [int(step) for step in args.val_at.split(",") if step]
    after = " | ".join(f"after {step}" for step in val_at + [args.steps])
    print(f"| algorithm | held-out accuracy before | {after} | train reward step 1 -> last | s/step |")
    print("|---|---|" + "---|" * (len(val_at) + 1) + "---|---|")
    for name in args.runs.split(","):
        result = run_one(name, policy_dir, files, args.out, args.steps, val_at)
        results.append(result)
        drawn = (f" ({result['prompts_drawn_per_step']:.0f} prompts drawn/step)"
                 if "prompts_drawn_per_step" in result else "")
        accuracies = "".join(f"{result['accuracy_at'][step]:.1%} | " for step in val_at if step in result["accuracy_at"])
        print(f"| {name} | {result['accuracy_before']:.1%} | {accuracies}{result['accuracy_after']:.1%} | "
              f"{result['train_score_first']:.2f} -> {result['train_score_last']:.2f} | "
              f"{result['seconds_per_step']:.2f}{drawn} |", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
