"""GRPO on SmolLM2-135M-Instruct with short verifiable answers.

    python examples/smollm2_arithmetic/run.py [--evaluate MODEL_DIR] [key=value ...]

Writes train/held-out prompt files (reasoning-gym's basic_arithmetic: a + b of 1-2 digit operands; the
held-out problems never appear in training) under ``<output_dir>/data``, then trains ``config.yaml``.
``--evaluate DIR`` instead scores a Hugging Face directory (the base model, or ``<output_dir>/final/actor``) on
the held-out prompts with plain transformers in fp32, greedy, the way the exported model is documented to load.
Needs the converted checkpoint (``python scripts/get_smollm2.py``) and reasoning-gym.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.data import PromptDataset, write_jsonl
from hybridflow.data.math_prompts import math_prompt_rows
from hybridflow.models import smollm2_path
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer

CONFIG = Path(__file__).with_name("config.yaml")
INSTRUCTION = "Reply with the number only."
# a + b with 0 <= a, b <= 100: the base model answers 42% of them right greedily and 15% of its samples at
# temperature 1 are right, so most groups are mixed (with a - b too it learned half as much: README.md)
OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ("+",),
           "allow_parentheses": False, "allow_negation": False}


def write_prompts(directory: Path, *, num_train: int, num_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """Train and held-out prompt files (held-out prompts never appear in train)."""
    eval_rows = math_prompt_rows(num_eval, seed=seed + 1, dataset="basic_arithmetic", instruction=INSTRUCTION,
                                 options=OPTIONS)
    train_rows = math_prompt_rows(num_train, seed=seed, dataset="basic_arithmetic", instruction=INSTRUCTION,
                                  options=OPTIONS, exclude_prompts={row["prompt"] for row in eval_rows})
    return write_jsonl(directory / "train.jsonl", train_rows), write_jsonl(directory / "eval.jsonl", eval_rows)


def build_config(overrides: list[str], *, num_train: int = 2000, num_eval: int = 200):
    model_dir = smollm2_path()
    if model_dir is None:
        raise SystemExit("SmolLM2-135M-Instruct is not converted yet: run python scripts/get_smollm2.py")
    output_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir=")),
                      "runs/smollm2_arithmetic")
    train_path, eval_path = write_prompts(Path(output_dir) / "data", num_train=num_train, num_eval=num_eval)
    return load_rl_config(CONFIG, [f"actor.model.path={model_dir}", f"data.train_path={train_path}",
                                   f"data.val_path={eval_path}", *overrides])


def run(overrides: list[str], *, num_train: int = 2000, num_eval: int = 200, mode: str | None = None) -> list[dict]:
    config = build_config(overrides, num_train=num_train, num_eval=num_eval)
    trainer = RLTrainer(config, mode=mode)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def evaluate(model_dir: str, config, *, batch_size: int = 32) -> float:
    """Held-out accuracy of a Hugging Face directory with plain transformers: fp32, greedy, the same prompts (chat
    template and response prefix) and reward as the run's validation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.rewards import RuleReward

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = PromptDataset(config.data.val_path, tokenizer, max_prompt_tokens=config.data.max_prompt_tokens,
                            **config.data.prompt_format())
    rule, pad_id = RuleReward(config.reward.function), tokenizer.pad_token_id or tokenizer.eos_token_id
    scores = []
    for batch in prompts.batches_in_order(batch_size):
        with torch.no_grad():
            output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    do_sample=False, max_new_tokens=config.actor.generation.max_new_tokens,
                                    pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id)
        answers = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        answers = [prefix + answer for prefix, answer in zip(batch["response_prefix"], answers)]
        scores.append(rule.score_batch(list(batch["raw_prompt"]), answers, list(batch["extra_fields"])))
    return float(torch.cat(scores).mean())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluate", metavar="MODEL_DIR", help="score this model on the held-out prompts instead")
    args, overrides = parser.parse_known_args(sys.argv[1:])
    if args.evaluate:
        accuracy = evaluate(args.evaluate, build_config(overrides))
        print(f"held-out accuracy of {args.evaluate} (transformers, fp32, greedy): {accuracy:.1%}")
    else:
        history = run(overrides)
        print({key: value for key, value in history[-1].items() if key.startswith(("val/", "reward/", "signal/"))})
