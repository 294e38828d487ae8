"""Single-turn RL as the one-turn special case of an episode: an existing ``reward.function`` as an Environment.

``RewardFunctionEnvironment(function="math")`` opens with the row's chat (or its prompt text), takes one
turn, and scores it with the reward function exactly as the single-turn trainer does (same prompt text,
same row fields, same checks of the value, see hybridflow/rewards/plugin.py). A reward function that
raises ends the episode as failed (``env.on_env_error``) instead of stopping the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from hybridflow.agents.env import AssistantTurn, Environment, EpisodeStart, TurnResult, row_messages
from hybridflow.rewards import RuleReward


@functools.cache
def _rule_reward(spec: str) -> RuleReward:
    """One RuleReward per spec per process: episodes share it instead of importing the function each time."""
    return RuleReward(spec, timeout_s=None)


class RewardFunctionEnvironment(Environment):
    """A one-turn episode scored by a rule-based reward function ``fn(prompt, response, **row_fields)``."""

    max_turns = 1

    def __init__(self, function: str | Callable[..., float], *, prompt_key: str = "prompt",
                 messages_key: str = "messages", system_prompt: str | None = None) -> None:
        self.rule = _rule_reward(function) if isinstance(function, str) else RuleReward(function, timeout_s=None)
        self.prompt_key, self.messages_key, self.system_prompt = prompt_key, messages_key, system_prompt

    def start(self, row: dict) -> EpisodeStart:
        self.row = row
        messages = row_messages(row, prompt_key=self.prompt_key, messages_key=self.messages_key,
                                system_prompt=self.system_prompt)
        user_turns = [message["content"] for message in messages if message.get("role") == "user"]
        # the prompt text a reward function receives, as PromptDataset gives it (raw_prompt)
        self.prompt = row[self.prompt_key] if row.get(self.messages_key) is None else \
            (user_turns[-1] if user_turns else messages[-1]["content"])
        return EpisodeStart(messages)

    def step(self, turn: AssistantTurn) -> TurnResult:
        fields = {key: value for key, value in self.row.items() if key not in (self.prompt_key, self.messages_key)}
        return TurnResult([], self.rule.score_one(0, self.prompt, turn.text, fields), True)
