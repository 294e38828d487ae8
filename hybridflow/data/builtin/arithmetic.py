"""The built-in verifiable task: multi-digit arithmetic ("12+345=" -> "357") with an exact checker.

Prompts are the bare expression followed by "=", responses the decimal answer (a leading "-" when
negative). With `reverse_answer` the answer's digits are written least-significant first
("57+68=" -> "521" for 125), the order in which a carry is computed: small transformers learn
addition several times faster that way. The expected response of a row is stored in its `answer`
field, which the exact checker uses when present. Train and eval problems are disjoint by construction: a problem belongs to the eval
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
    reverse_answer: bool = False
    """Write answers least-significant digit first (the sign, if any, stays in front)."""
    fixed_width: bool = False
    """Zero-pad the operands to ``max_digits`` and the answer to its widest length (``max_digits`` + 1 for "+",
    ``max_digits`` for "-", 2 x ``max_digits`` for "*"), so every digit sits at the same position in every problem."""

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
    reverse_answer: bool = False
    """Whether the expected response writes the digits least-significant first."""
    width: int = 0
    """Digits the operands are zero-padded to (0: no padding); the answer is padded to its widest length."""

    @property
    def prompt(self) -> str:
        return f"{self.left:0{self.width}d}{self.operation}{self.right:0{self.width}d}="

    @property
    def answer(self) -> str:
        """The expected response text (digits reversed when ``reverse_answer``, zero-padded when ``width``)."""
        return self.write(_evaluate(self.left, self.operation, self.right))

    def write(self, value: int) -> str:
        """A number as this problem's response text (padding and digit order of the problem)."""
        answer_width = {"+": self.width + 1, "-": self.width, "*": 2 * self.width}[self.operation] if self.width else 0
        return _write(value, reverse=self.reverse_answer, width=answer_width)

    def split(self, eval_percent: int) -> str:
        """'eval' or 'train', from a hash of the unpadded problem text: stable across runs, machines and formats."""
        text = f"{self.left}{self.operation}{self.right}="
        bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 100
        return "eval" if bucket < eval_percent else "train"


def _write(value: int, *, reverse: bool, width: int = 0) -> str:
    """An integer as response text: decimal digits zero-padded to ``width``, optionally reversed (sign in front)."""
    sign, digits = ("-" if value < 0 else ""), str(abs(value)).zfill(width)
    return sign + (digits[::-1] if reverse else digits)


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


def sample_problems(num_problems: int, *, split: str, seed: int,
                    config: ArithmeticTaskConfig | None = None) -> list[Problem]:
    """`num_problems` problems of one split ("train" or "eval"), drawn with replacement, deterministic in `seed`.

    ``config`` picks the problems and the answer format (default ``ArithmeticTaskConfig()``: sums of
    1- and 2-digit operands, answers in the normal digit order).
    """
    config = ArithmeticTaskConfig() if config is None else config
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
        problem = Problem(_draw_operand(rng, config), rng.choice(config.operations), _draw_operand(rng, config),
                          reverse_answer=config.reverse_answer, width=config.max_digits if config.fixed_width else 0)
        if problem.split(config.eval_percent) == split:
            problems.append(problem)
    return problems


def prompt_rows(num_problems: int, *, split: str, seed: int, config: ArithmeticTaskConfig | None = None) -> list[dict]:
    """Rows for a prompt dataset: {"prompt": "12+345=", "answer": "357"} (``config`` as in `sample_problems`)."""
    return [
        {"prompt": problem.prompt, "answer": problem.answer}
        for problem in sample_problems(num_problems, split=split, seed=seed, config=config)
    ]


def sft_rows(num_problems: int, *, split: str, seed: int, config: ArithmeticTaskConfig | None = None,
             forget_carry_rate: float = 0.0, drop_final_carry_rate: float = 0.0) -> list[dict]:
    """Rows for supervised fine-tuning: {"prompt": "12+345=", "response": "357"} (``config`` as in `sample_problems`).

    Two imperfect demonstrators (both 0: a perfect one):
    - ``forget_carry_rate``: on that share of the additions that carry, the response is the
      column-wise sum without any carry ("57+68=" -> "15" instead of "125");
    - ``drop_final_carry_rate``: on that share of the additions whose sum is longer than both
      operands (the last carry opens a new digit), that digit is left out ("57+68=" -> "25"),
      every other digit being right.
    """
    for name, rate in (("forget_carry_rate", forget_carry_rate), ("drop_final_carry_rate", drop_final_carry_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {rate}")
    rng = random.Random(f"{seed}:{split}:demonstrator")
    rows = []
    for problem in sample_problems(num_problems, split=split, seed=seed, config=config):
        response = problem.answer
        if problem.operation == "+" and rng.random() < forget_carry_rate:
            response = problem.write(carry_free_sum(problem.left, problem.right))
        elif problem.operation == "+" and drop_final_carry_rate and final_carry_opens_digit(problem):
            if rng.random() < drop_final_carry_rate:
                total = problem.left + problem.right
                if problem.width:  # the answer keeps its fixed width: the carry's digit becomes a padding zero
                    response = problem.write(total - 10 ** (len(str(total)) - 1))
                else:  # drop the digit itself (50+50 -> "00", not "0")
                    response = response[:-1] if problem.reverse_answer else response[1:]
        rows.append({"prompt": problem.prompt, "response": response})
    return rows


def final_carry_opens_digit(problem: Problem) -> bool:
    """Whether an addition's sum has more digits than either operand (57 + 68 = 125)."""
    total = problem.left + problem.right
    return problem.operation == "+" and len(str(total)) > max(len(str(problem.left)), len(str(problem.right)))


def carry_free_sum(left: int, right: int) -> int:
    """Column-wise sum of two non-negative integers with every carry dropped (57 + 68 -> 15)."""
    total, place = 0, 1
    while left or right:
        total += ((left % 10 + right % 10) % 10) * place
        left, right, place = left // 10, right // 10, place * 10
    return total


def plausible_wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A wrong answer of the kind a weak model writes: one digit off, a dropped carry, a lost or doubled digit."""
    correct = str(_evaluate(problem.left, problem.operation, problem.right))
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
    return problem.write(int(rng.choice(wrong)))


def preference_rows(num_problems: int, *, split: str, seed: int,
                    config: ArithmeticTaskConfig | None = None) -> list[dict]:
    """Rows for reward-model training: {"prompt", "chosen": correct answer, "rejected": a plausible wrong one}
    (``config`` as in `sample_problems`)."""
    rng = random.Random(f"{seed}:{split}:rejected")
    return [
        {"prompt": problem.prompt, "chosen": problem.answer, "rejected": plausible_wrong_answer(problem, rng)}
        for problem in sample_problems(num_problems, split=split, seed=seed, config=config)
    ]


def score(prompt: str, response: str, **extra_fields) -> float:
    """The exact checker: 1.0 when the response (whitespace-stripped) is the correct answer, else 0.0.

    Follows the reward plug-in signature, so `hybridflow.data.builtin.arithmetic:score` can be
    given as a reward function; the answer is recomputed from the prompt in the plain format (an
    `answer` field, when present, is used instead: the generators always write one, so rows of
    the reversed or fixed-width formats are checked against their own expected text).
    """
    expected = extra_fields.get("answer")
    if expected is None:
        expected = parse_prompt(prompt).answer
    return 1.0 if response.strip() == str(expected).strip() else 0.0
