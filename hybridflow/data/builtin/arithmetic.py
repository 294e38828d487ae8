"""The built-in verifiable task: multi-digit arithmetic ("12+345=" -> "357") with an exact checker.

Prompts are the bare expression followed by "=", responses the decimal answer (a leading "-" when
negative). Train and eval problems are disjoint by construction: a problem belongs to the eval
split when a stable hash of its text falls in the lowest `eval_percent` of 100 buckets, whatever
the seed, so no eval problem can ever be drawn for training.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

OPERATIONS = ("+", "-", "*")
SPLITS = ("train", "eval")
_PROBLEM_RE = re.compile(r"^\s*(\d+)\s*([+\-*])\s*(\d+)\s*=\s*$")
# Rejection sampling of a split gives up after this many draws per requested problem, which only
# happens when the digit range is so small that the split holds (almost) no problems.
_MAX_DRAWS_PER_PROBLEM = 1000


@dataclass(frozen=True, kw_only=True)
class ArithmeticTaskConfig:
    """Which problems the task draws."""

    min_digits: int = 1
    """Fewest digits of each operand (1 allows 0..9)."""
    max_digits: int = 2
    """Most digits of each operand."""
    operations: tuple[str, ...] = ("+",)
    """Operators drawn uniformly, from "+", "-", "*"."""
    eval_percent: int = 10
    """Share (in percent) of all problems reserved for the held-out eval split."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"min_digits and max_digits must satisfy 1 <= min_digits <= max_digits, "
                f"got min_digits={self.min_digits}, max_digits={self.max_digits}"
            )
        if self.max_digits > 9:
            raise ValueError(f"max_digits must be <= 9 (the tiny model's context is 64 tokens), got {self.max_digits}")
        unknown = [operation for operation in self.operations if operation not in OPERATIONS]
        if not self.operations or unknown:
            raise ValueError(f"operations must be a non-empty subset of {OPERATIONS}, got {self.operations}")
        if not 1 <= self.eval_percent <= 50:
            raise ValueError(f"eval_percent must lie in [1, 50], got {self.eval_percent}")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem."""

    left: int
    operation: str
    right: int

    @property
    def prompt(self) -> str:
        return f"{self.left}{self.operation}{self.right}="

    @property
    def answer(self) -> str:
        return str(_evaluate(self.left, self.operation, self.right))

    def split(self, eval_percent: int) -> str:
        """'eval' or 'train', from a hash of the prompt text that is stable across runs and machines."""
        bucket = int.from_bytes(hashlib.sha256(self.prompt.encode()).digest()[:8], "big") % 100
        return "eval" if bucket < eval_percent else "train"


def _evaluate(left: int, operation: str, right: int) -> int:
    if operation == "+":
        return left + right
    if operation == "-":
        return left - right
    return left * right


def parse_prompt(prompt: str) -> Problem:
    """The problem a prompt states; ValueError when the text is not "<int><op><int>="."""
    match = _PROBLEM_RE.match(prompt)
    if match is None:
        raise ValueError(f"not an arithmetic prompt of the form '12+345=': {prompt!r}")
    return Problem(int(match.group(1)), match.group(2), int(match.group(3)))


def _draw_operand(rng: random.Random, config: ArithmeticTaskConfig) -> int:
    digits = rng.randint(config.min_digits, config.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def sample_problems(num_problems: int, *, split: str, seed: int, config: ArithmeticTaskConfig) -> list[Problem]:
    """`num_problems` problems of one split, drawn with replacement, deterministic in `seed`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    rng = random.Random(f"{seed}:{split}")
    problems: list[Problem] = []
    draws = 0
    while len(problems) < num_problems:
        draws += 1
        if draws > _MAX_DRAWS_PER_PROBLEM * max(num_problems, 1):
            raise ValueError(
                f"could not draw {num_problems} {split} problems with {config}: the digit range holds too few"
            )
        problem = Problem(_draw_operand(rng, config), rng.choice(config.operations), _draw_operand(rng, config))
        if problem.split(config.eval_percent) == split:
            problems.append(problem)
    return problems


def prompt_rows(num_problems: int, *, split: str, seed: int, config: ArithmeticTaskConfig) -> list[dict]:
    """Rows for a prompt dataset: {"prompt": "12+345=", "answer": "357"}."""
    return [
        {"prompt": problem.prompt, "answer": problem.answer}
        for problem in sample_problems(num_problems, split=split, seed=seed, config=config)
    ]


def sft_rows(num_problems: int, *, split: str, seed: int, config: ArithmeticTaskConfig) -> list[dict]:
    """Rows for supervised fine-tuning: {"prompt": "12+345=", "response": "357"}."""
    return [
        {"prompt": problem.prompt, "response": problem.answer}
        for problem in sample_problems(num_problems, split=split, seed=seed, config=config)
    ]


def plausible_wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A wrong answer of the kind a weak model writes: one digit off, a dropped carry, a lost or doubled digit."""
    correct = problem.answer
    sign, digits = ("-", correct[1:]) if correct.startswith("-") else ("", correct)
    candidates = []
    position = rng.randrange(len(digits))
    for delta in (1, -1):
        changed = str((int(digits[position]) + delta) % 10)
        candidates.append(digits[:position] + changed + digits[position + 1 :])
    if problem.operation == "+":
        no_carry = "".join(
            str((int(a) + int(b)) % 10)
            for a, b in zip(str(problem.left).zfill(len(digits)), str(problem.right).zfill(len(digits)))
        )
        candidates.append(no_carry)
    candidates.append(digits[:-1] if len(digits) > 1 else digits + digits)
    candidates.append(digits + digits[-1])
    wrong = [sign + candidate.lstrip("0") if candidate.lstrip("0") else "0" for candidate in candidates]
    wrong = [answer for answer in wrong if answer != correct]
    assert wrong, f"no wrong answer generated for {problem}"
    return rng.choice(wrong)


def preference_rows(num_problems: int, *, split: str, seed: int, config: ArithmeticTaskConfig) -> list[dict]:
    """Rows for reward-model training: {"prompt", "chosen": correct answer, "rejected": a plausible wrong one}."""
    rng = random.Random(f"{seed}:{split}:rejected")
    return [
        {"prompt": problem.prompt, "chosen": problem.answer, "rejected": plausible_wrong_answer(problem, rng)}
        for problem in sample_problems(num_problems, split=split, seed=seed, config=config)
    ]


def score(prompt: str, response: str, **extra_fields) -> float:
    """The exact checker: 1.0 when the response (whitespace-stripped) is the correct answer, else 0.0.

    Follows the reward plug-in signature, so `hybridflow.data.builtin.arithmetic:score` can be
    given as a reward function; the answer is recomputed from the prompt (an `answer` field, when
    present, is used instead).
    """
    expected = extra_fields.get("answer")
    if expected is None:
        expected = parse_prompt(prompt).answer
    return 1.0 if response.strip() == str(expected).strip() else 0.0
