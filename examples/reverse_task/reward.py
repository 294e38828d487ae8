"""The task's rewards: ``exact`` (1.0 for the reversed digit string, else 0.0) and ``partial`` (the share of
positions right, 0 when the length is wrong): a denser signal for RL than exact match alone."""


def exact(prompt: str, response: str, *, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


def partial(prompt: str, response: str, *, answer: str) -> float:
    response = response.strip()
    if len(response) != len(answer):
        return 0.0
    return sum(got == want for got, want in zip(response, answer)) / len(answer)
