"""The reward both sides call: 1.0 when the completion is the exact sum of the prompt's "a+b=", else 0.0.

Plain Python with no imports from either framework, so TRL and hybridflow score identically.
"""

from __future__ import annotations


def addition_reward(prompt: str, response: str, **extra_fields) -> float:
    left, _, _ = prompt.partition("=")
    first, _, second = left.partition("+")
    try:
        expected = int(first) + int(second)
    except ValueError:
        return 0.0
    return 1.0 if response.strip() == str(expected) else 0.0
