"""GRPO on SmolLM2-135M-Instruct with offline GSM8K-style prompts: `python examples/smollm2_gsm8k/run.py [key=value ...]`.

Needs the converted checkpoint (`python scripts/get_smollm2.py`) and reasoning-gym
(`pip install 'hybridflow[math]'`). Overrides go to the RL config, e.g. `trainer.total_steps=2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridflow.data.math_prompts import math_prompt_rows
from hybridflow.data import write_jsonl
from hybridflow.models import smollm2_path
from hybridflow.trainers.config import load_rl_config
from hybridflow.trainers.ppo import RLTrainer

CONFIG = Path(__file__).with_name("config.yaml")
INSTRUCTION = "Think step by step, then give the final answer as \\boxed{number}."


def write_prompts(directory: Path, *, num_train: int, num_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """Train and eval prompt files (eval prompts never appear in train)."""
    eval_rows = math_prompt_rows(num_eval, seed=seed + 1, instruction=INSTRUCTION)
    train_rows = math_prompt_rows(num_train, seed=seed, instruction=INSTRUCTION,
                                  exclude_prompts={row["prompt"] for row in eval_rows})
    return write_jsonl(directory / "train.jsonl", train_rows), write_jsonl(directory / "eval.jsonl", eval_rows)


def run(overrides: list[str], *, num_train: int = 400, num_eval: int = 16, mode: str | None = None) -> list[dict]:
    model_dir = smollm2_path()
    if model_dir is None:
        raise SystemExit("SmolLM2-135M-Instruct is not converted yet: run python scripts/get_smollm2.py")
    output_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir=")),
                      "runs/smollm2_gsm8k")
    train_path, eval_path = write_prompts(Path(output_dir) / "data", num_train=num_train, num_eval=num_eval)
    config = load_rl_config(CONFIG, [f"actor.model.path={model_dir}", f"data.train_path={train_path}",
                                     f"data.val_path={eval_path}", *overrides])
    trainer = RLTrainer(config, mode=mode)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    history = run(sys.argv[1:])
    print(history[-1])
