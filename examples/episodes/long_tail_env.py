"""A long-tail environment: episodes of very different lengths, for asynchronous RL with episodes (docs/async.md,
"Episodes on the rollout pool").

Each data row fixes how many turns its episodes take (``turns``) and how long the tool sleeps before each of its
answers (``tool_s``). ``make_rows`` draws both from heavy-tailed distributions: most episodes end after one or two
turns with a tool that answers at once, a few run up to ``MAX_TURNS`` turns with a tool that sleeps seconds, so the
slowest episode of a step takes far longer than the typical one (the long tail that holds a synchronous step back).
The reward counts the distinct characters the model wrote over the episode (tenths): a dense signal that a random
tiny model can learn, and that differs between the samples of one prompt (GRPO's groups).

    env.class: examples/episodes/long_tail_env.py:LongTailEnvironment
"""

from __future__ import annotations

import random
import time

from hybridflow.agents import AssistantTurn, Environment, EpisodeStart, TurnResult

MAX_TURNS = 6


class LongTailEnvironment(Environment):
    """``row["turns"]`` turns; after each but the last a tool message that arrives after ``row["tool_s"]`` seconds."""

    max_turns = MAX_TURNS

    def start(self, row: dict) -> EpisodeStart:
        self.turns, self.tool_s = int(row["turns"]), float(row["tool_s"])
        self.written: set[str] = set()
        return EpisodeStart([{"role": "user", "content": row["prompt"]}])

    def step(self, turn: AssistantTurn) -> TurnResult:
        self.written.update(turn.text)
        if turn.turn_index + 1 >= self.turns:
            return TurnResult([], reward=len(self.written) / 10, done=True)
        time.sleep(self.tool_s)  # a slow tool: a search, a test run, a remote call
        return TurnResult([{"role": "tool", "content": str(17 * (turn.turn_index + 1))}],
                          info={"tool_s": self.tool_s})


def make_rows(count: int, *, seed: int = 0, slow_s: float = 1.0) -> list[dict]:
    """``count`` rows: turns 1 + a geometric draw (p = 1/2, at most ``MAX_TURNS``); the tool's seconds
    ``slow_s`` x a Pareto draw (shape 1.5) / 20, at most ``2 x slow_s``: a median of about 0.08 ``slow_s``, one
    row in ten above 0.23 ``slow_s``."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        turns = 1
        while turns < MAX_TURNS and rng.random() < 0.5:
            turns += 1
        tool_s = min(slow_s * rng.paretovariate(1.5) / 20, 2 * slow_s)
        rows.append({"prompt": f"Look up item {index} and answer with its number.", "turns": turns,
                     "tool_s": round(tool_s, 4)})
    return rows
