"""A hand-written critic-free RL loop (GRPO-style) over hybridflow's worker groups: the README's example.

Run: hybridflow demo      (once: writes runs/demo/sft/model, a weak 2-digit adder)
     python examples/custom_grpo_loop.py [--steps 20] [--local] [--model DIR]
It writes prompt files of the demo's task (2-digit sums, answers written least-significant digit
first) to a temporary folder, builds the actor and reference groups from
examples/arithmetic_ppo.yaml with the demo's SFT policy as the actor, and spells out one RL step
in a few lines; the exact checker is the reward. `--model builtin` starts from random weights
instead (a smoke test: such a model never writes a right answer, so every score is 0).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from hybridflow.algorithms import grpo_advantages
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer

EXAMPLE_CONFIG = Path(__file__).with_name("arithmetic_ppo.yaml")
DEMO_MODEL = "runs/demo/sft/model"
SAMPLES_PER_PROMPT = 4
# the demo's task: its policy answers 2-digit sums, digits least-significant first ("57+68=" -> "521")
DEMO_TASK = ArithmeticTaskConfig(min_digits=2, max_digits=2, reverse_answer=True)


def run(steps: int, workdir: Path, *, local: bool, model: str = DEMO_MODEL) -> list[dict[str, float]]:
    """``steps`` GRPO steps on the demo's task from ``model`` (a directory, or ``builtin`` for random
    weights); returns the actor's update metrics per step."""
    if model != "builtin" and not Path(model, "config.json").is_file():
        raise SystemExit(f"no model at {model!r}: run `hybridflow demo` first (it writes {DEMO_MODEL}), "
                         "or pass --model DIR, or --model builtin for random weights")
    write_jsonl(workdir / "train.jsonl", prompt_rows(512, split="train", seed=0, config=DEMO_TASK))
    source = "actor.model.builtin=arithmetic" if model == "builtin" else f"actor.model.path={model}"
    config = load_rl_config(EXAMPLE_CONFIG, [
        source, f"data.train_path={workdir / 'train.jsonl'}", "data.val_path=null", "trainer.val_every=0",
        f"trainer.output_dir={workdir / 'run'}",
        "algorithm.advantage_estimator=grpo", "algorithm.kl_mode=loss", f"batch.samples_per_prompt={SAMPLES_PER_PROMPT}",
        "batch.prompts_per_step=8", "trainer.progress_bar=false"])
    trainer = RLTrainer(config, mode="local" if local else None, tensorboard=False)
    actor, reference = trainer.actor, trainer.reference
    history = []
    try:
        for step in range(steps):
            prompts = trainer.loader.next_batch()
            prompts["uid"] = np.arange(len(prompts))                 # samples of one prompt share a group id
            prompts.meta_info.update(samples_per_prompt=SAMPLES_PER_PROMPT, seed=step)
            batch = actor.generate_sequences(prompts)                # one chunk per generation replica
            batch = batch.union(actor.compute_log_prob(batch))       # split by data-parallel rank
            batch = batch.union(reference.compute_ref_log_prob(batch))
            scores_B, _ = trainer.scorer.score(batch)                # the exact checker here (reward.function)
            batch["advantages"] = grpo_advantages(scores_B, batch["uid"], batch["response_mask"])
            metrics = actor.update_actor(batch)[0]                   # one metrics dict per data-parallel rank
            metrics["reward/score_mean"] = float(scores_B.mean())
            history.append(metrics)
            print(f"step {step}: score {metrics['reward/score_mean']:.3f}  loss {metrics['actor/loss']:.4f}")
    finally:
        trainer.shutdown()
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--local", action="store_true", help="every group in this process (no Ray)")
    parser.add_argument("--model", default=DEMO_MODEL,
                        help=f"the actor's initial weights: a model directory (default {DEMO_MODEL}, written by "
                             "`hybridflow demo`) or `builtin` (random weights: scores stay 0)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        run(args.steps, Path(workdir), local=args.local, model=args.model)


if __name__ == "__main__":
    main()
