"""Verifiable math prompt files (GSM8K-style word problems with numeric answers) generated offline with reasoning-gym.

`python -m hybridflow.data.math_prompts OUT_DIR --train 2000 --eval 200` writes OUT_DIR/train.jsonl
and OUT_DIR/eval.jsonl with rows {"prompt", "answer", "solution"}, ready for PromptDataset and the
built-in `math` reward. reasoning-gym is an optional dependency: `pip install 'hybridflow[math]'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.data.files import write_jsonl

# reasoning-gym draws with replacement from ~100 templates; over-drawing then removing duplicates
# (and eval prompts from train) still leaves enough rows, up to this many draws per wanted row.
_DRAWS_PER_ROW = 4


def math_prompt_rows(
    num_prompts: int,
    *,
    seed: int,
    dataset: str = "gsm_symbolic",
    instruction: str | None = None,
    exclude_prompts: set[str] | frozenset[str] = frozenset(),
    options: dict | None = None,
) -> list[dict]:
    """`num_prompts` distinct rows {"prompt", "answer", "solution"} from a reasoning-gym dataset.

    `instruction` is appended to every question (e.g. asking for \\boxed{}); prompts in
    `exclude_prompts` are never returned (used to keep an eval split out of training); `options` go to
    the dataset's config (e.g. ``{"max_terms": 2, "max_digits": 2}`` for basic_arithmetic).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(
            "math prompt generation needs the optional package reasoning-gym: pip install 'hybridflow[math]'"
        ) from error
    try:
        examples = reasoning_gym.create_dataset(dataset, size=num_prompts * _DRAWS_PER_ROW, seed=seed,
                                                **(options or {}))
    except Exception as error:
        raise ValueError(f"dataset {dataset!r}: reasoning-gym cannot create it: {error}") from error
    rows, seen = [], set(exclude_prompts)
    for example in examples:
        prompt = example["question"] if instruction is None else f"{example['question']} {instruction}"
        if prompt in seen:
            continue
        seen.add(prompt)
        solution = example.get("metadata", {}).get("answer_cot")
        rows.append({"prompt": prompt, "answer": str(example["answer"]), "solution": solution})
        if len(rows) == num_prompts:
            return rows
    raise ValueError(
        f"dataset {dataset!r} gave only {len(rows)} distinct prompts of the {num_prompts} asked for; ask for fewer"
    )


def write_math_prompt_splits(
    directory: str | Path,
    *,
    num_train: int,
    num_eval: int,
    seed: int = 0,
    dataset: str = "gsm_symbolic",
    instruction: str | None = None,
) -> tuple[Path, Path]:
    """Write directory/train.jsonl and directory/eval.jsonl, with no eval prompt in train -> (train, eval) paths."""
    eval_rows = math_prompt_rows(num_eval, seed=seed + 1, dataset=dataset, instruction=instruction)
    train_rows = math_prompt_rows(
        num_train, seed=seed, dataset=dataset, instruction=instruction,
        exclude_prompts={row["prompt"] for row in eval_rows},
    )
    directory = Path(directory)
    return write_jsonl(directory / "train.jsonl", train_rows), write_jsonl(directory / "eval.jsonl", eval_rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where train.jsonl and eval.jsonl are written")
    parser.add_argument("--train", type=int, default=2000, help="training prompts")
    parser.add_argument("--eval", type=int, default=200, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="gsm_symbolic", help="reasoning-gym dataset name")
    parser.add_argument("--instruction", default=None, help="text appended to every question")
    args = parser.parse_args(argv)
    train_path, eval_path = write_math_prompt_splits(
        args.directory, num_train=args.train, num_eval=args.eval, seed=args.seed,
        dataset=args.dataset, instruction=args.instruction,
    )
    print(f"wrote {args.train} prompts to {train_path} and {args.eval} to {eval_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
