"""GRPO on SmolLM2-135M-Instruct with offline math prompts: `python examples/smollm2_gsm8k/run.py [--problems P] [key=value ...]`.

Needs the converted checkpoint (`python scripts/get_smollm2.py`) and reasoning-gym
(`pip install 'hybridflow[math]'`). `--problems gsm` (default) draws GSM8K-style word problems;
`--problems arithmetic` draws sums and differences of two 1-2 digit numbers, which SmolLM2-135M
sometimes solves, so even a short run sees groups with mixed rewards (GRPO learns nothing from a
group whose answers all score the same). Overrides go to the RL config, e.g. `trainer.total_steps=2`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.data.math_prompts import math_prompt_rows
from hybridflow.data import write_jsonl
from hybridflow.models import smollm2_path
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer

CONFIG = Path(__file__).with_name("config.yaml")
INSTRUCTION = "Think step by step, then give the final answer as \\boxed{number}."
# reasoning-gym dataset and its options for each --problems choice
PROBLEMS = {"gsm": ("gsm_symbolic", {}),
            "arithmetic": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                                "operators": ("+", "-"), "allow_negation": False})}


def write_prompts(directory: Path, *, num_train: int, num_eval: int, seed: int = 0,
                  problems: str = "gsm") -> tuple[Path, Path]:
    """Train and eval prompt files (eval prompts never appear in train)."""
    if problems not in PROBLEMS:
        raise ValueError(f"--problems must be one of {sorted(PROBLEMS)}, got {problems!r}")
    dataset, options = PROBLEMS[problems]
    eval_rows = math_prompt_rows(num_eval, seed=seed + 1, dataset=dataset, instruction=INSTRUCTION, options=options)
    train_rows = math_prompt_rows(num_train, seed=seed, dataset=dataset, instruction=INSTRUCTION, options=options,
                                  exclude_prompts={row["prompt"] for row in eval_rows})
    return write_jsonl(directory / "train.jsonl", train_rows), write_jsonl(directory / "eval.jsonl", eval_rows)


def run(overrides: list[str], *, num_train: int = 400, num_eval: int = 16, mode: str | None = None,
        problems: str = "gsm") -> list[dict]:
    model_dir = smollm2_path()
    if model_dir is None:
        raise SystemExit("SmolLM2-135M-Instruct is not converted yet: run python scripts/get_smollm2.py")
    output_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir=")),
                      "runs/smollm2_gsm8k")
    train_path, eval_path = write_prompts(Path(output_dir) / "data", num_train=num_train, num_eval=num_eval,
                                           problems=problems)
    config = load_rl_config(CONFIG, [f"actor.model.path={model_dir}", f"data.train_path={train_path}",
                                     f"data.val_path={eval_path}", *overrides])
    trainer = RLTrainer(config, mode=mode)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", choices=sorted(PROBLEMS), default="gsm", help="which math prompts to draw")
    args, overrides = parser.parse_known_args(sys.argv[1:])
    history = run(overrides, problems=args.problems)
    print(history[-1])
