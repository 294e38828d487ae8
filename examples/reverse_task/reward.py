"""The task's reward: 1.0 when the response is the reversed digit string, else 0.0."""


def exact(prompt: str, response: str, *, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0
