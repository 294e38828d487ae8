"""The built-in math reward: a response's final answer (\\boxed{}, "#### 42", last number) against the row's answer."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_HASHES_RE = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is\s*:?|:)\s*([^\n]+)", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    position = text.index("{", start) + 1
    depth = 1
    for end in range(position, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[position:end]
    return None


def extract_final_answer(text: str) -> str | None:
    """The answer a response commits to, by priority: the last \\boxed{}, a "#### X" line,
    "the answer is X" (the first number after the marker, else the rest of its line), else the
    last number in the text; None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES_RE, _ANSWER_IS_RE):
        matches = pattern.findall(text)
        if matches:
            numbers = _NUMBER_RE.findall(matches[-1])
            return numbers[0] if numbers else matches[-1].strip().rstrip(".")
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """A number written in `text` ("1,234", "$42.50", "3/4", "-0.5", "\\frac{3}{4}", "42."), exactly; None if none."""
    cleaned = text.replace("\\!", "").replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    fraction = re.fullmatch(r"\s*(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}\s*", cleaned)
    if fraction:
        sign, numerator, denominator = fraction.groups()
        cleaned = f"{sign}{numerator}/{denominator}"
    numbers = _NUMBER_RE.findall(cleaned)
    if len(numbers) != 1:
        return None
    try:
        value = Fraction(numbers[0].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return value


def answers_match(predicted: str, expected: str) -> bool:
    """Equal as numbers (commas, currency, trailing zeros ignored), else equal as whitespace-normalized text."""
    predicted_number, expected_number = parse_number(predicted), parse_number(expected)
    if predicted_number is not None and expected_number is not None:
        return predicted_number == expected_number
    return " ".join(predicted.split()).lower() == " ".join(expected.split()).lower()


def math_reward(prompt: str, response: str, *, answer, **extra_fields) -> float:
    """1.0 when the response's final answer equals the row's `answer`, else 0.0.

    `answer` may be a number or text; a GSM8K-style solution ending in "#### 42" counts as 42.
    """
    expected = str(answer)
    if "####" in expected or "\\boxed" in expected:
        expected = extract_final_answer(expected) or expected
    predicted = extract_final_answer(response)
    return 1.0 if predicted is not None and answers_match(predicted, expected) else 0.0
