"""The ``env`` config section: which environment class runs the episodes, and the limits of an episode."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_FORMATS = ("auto", "hermes", "llama3")
ON_ENV_ERROR = ("drop", "zero_reward")
_CLASS_SPEC = re.compile(r"^[^:\s]+:[A-Za-z_][\w.]*$")


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """A multi-turn environment (docs/agents.md): the class, its arguments and the limits of one episode."""

    class_path: str = field(metadata={"key": "class"})
    """The environment class, ``path/to/file.py:Class`` or ``package.module:Class`` (a subclass of
    ``hybridflow.agents.Environment``). Written ``env.class`` in YAML and overrides (the field is ``class_path``
    in Python, ``class`` being a keyword)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class's constructor (one instance per episode)."""
    max_turns: int | None = None
    """Most turns of the model per episode; null: the class's own ``max_turns``."""
    max_episode_tokens: int | None = None
    """Most tokens of one episode (prompt, sampled and observation ids together); an episode that reaches it
    ends, truncated. Null: the actor model's ``max_position_embeddings``."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call may take (a tool's own ``timeout_s`` overrides it); past it the model reads a
    timeout error as the tool's result and the episode goes on."""
    agent_timeout_s: float = 600.0
    """Seconds the agent program of an endpoint environment (``OpenAIAgentEnvironment.agent``) may run for one
    episode; past it the episode ends failed (``agent/env_failures``) and the step goes on without it."""
    tool_format: Literal["auto", "hermes", "llama3"] = "auto"
    """How tool calls are written: ``hermes`` (``<tool_call>{json}</tool_call>``, Hermes/Qwen), ``llama3`` (the
    turn is ``{"name": ..., "parameters": ...}``), ``auto``: the format the model's chat template renders."""
    on_env_error: Literal["drop", "zero_reward"] = "drop"
    """An episode whose environment raised: ``drop`` trains nothing of it (its row stays, so mini-batches stay
    whole, with an empty loss mask, scoring its group's mean so a group baseline is unchanged); ``zero_reward``
    trains its sampled tokens with reward 0. Counted either way (``agent/env_failures``)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.class_path, str) and bool(_CLASS_SPEC.match(self.class_path)), "class",
                 self.class_path, "'path/to/file.py:Class' or 'package.module:Class'")
        _require(isinstance(self.kwargs, dict) and all(isinstance(key, str) for key in self.kwargs), "kwargs",
                 self.kwargs, "a mapping of argument names to values")
        for name in ("max_turns", "max_episode_tokens"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                     name, value, "an integer >= 1 or null")
        for name in ("tool_timeout_s", "agent_timeout_s"):
            _require(_positive_number(getattr(self, name)), name, getattr(self, name), "a number of seconds > 0")
        _require(self.tool_format in TOOL_FORMATS, "tool_format", self.tool_format, ", ".join(TOOL_FORMATS))
        _require(self.on_env_error in ON_ENV_ERROR, "on_env_error", self.on_env_error, ", ".join(ON_ENV_ERROR))


def _require(condition: bool, key: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ValueError(f"config key {key} got {value!r}; allowed: {allowed}")
