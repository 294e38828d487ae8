"""The environment interface of agentic RL: an episode starts from a data row, takes the model's turns, answers them.

An environment is text-level and gym-like: ``start(row)`` gives the opening messages and the tools on
offer, ``step(turn)`` takes the model's turn (its decoded text and the tool calls parsed from it) and
returns what comes back (tool results, a user message), a reward and whether the episode is over. The
episode runner owns the token ids: nothing an environment returns is used to re-tokenize what the
model sampled. One instance serves one episode. Torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.agents.tools import Tool, ToolCall

Message = dict
"""An OpenAI-style chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``, optionally with
``tool_calls`` (assistant), ``name`` and ``tool_call_id`` (tool)."""

OBSERVATION_ROLES = ("tool", "user", "system")
"""Roles an environment may return after a turn (assistant text is always the model's own, sampled)."""


@dataclass
class EpisodeStart:
    """How an episode opens."""

    messages: list[dict]
    """The opening messages, rendered by the model's chat template (usually a system and a user message)."""
    tools: list[Tool] = field(default_factory=list)
    """The tools offered in this episode; their schemas go to the chat template's ``tools=``."""


@dataclass
class AssistantTurn:
    """One turn of the model, as the environment sees it."""

    text: str
    """The decoded text of the turn (for the environment only: it is never re-encoded for training)."""
    tool_calls: list[ToolCall]
    """The calls parsed from the text in the model's tool-call format (empty if none)."""
    parse_errors: list[str]
    """Calls that could not be parsed, each described; each becomes an error tool message."""
    turn_index: int
    """0 for the model's first turn of the episode."""


@dataclass
class TurnResult:
    """What the environment answers to one turn."""

    messages: list[dict]
    """What comes back: tool results (role "tool") and/or a user message; [] if none."""
    reward: float | None = None
    """This turn's reward (None: none this turn); when ``done``, the episode's final reward."""
    done: bool = False
    """The episode is over."""
    info: dict = field(default_factory=dict)
    """Free-form facts about the turn, recorded in the episode JSONL (``tool_calls``: see ToolEnvironment)."""


class Environment(ABC):
    """One instance per episode, constructed with no arguments or with the env config's ``kwargs``.

    Subclasses implement ``start`` and ``step``; ``close`` is called once the episode is over (also after a
    failure) for cleanup. ``max_turns`` bounds the model's turns (the config's ``env.max_turns`` overrides it).
    """

    max_turns: int = 1
    """Most turns of the model in one episode; the episode ends (truncated) after the last."""

    @abstractmethod
    def start(self, row: dict) -> EpisodeStart:
        """Open an episode for one dataset row (all its fields)."""

    @abstractmethod
    def step(self, turn: AssistantTurn) -> TurnResult:
        """Answer the model's turn."""

    def close(self) -> None:
        """Release what the episode held (processes, files); the default holds nothing."""


@dataclass(frozen=True)
class EnvironmentFailure:
    """An environment raised: the episode ends, marked failed (``env.on_env_error`` says what the batch does)."""

    class_name: str
    """The environment class (module-qualified)."""
    method: str
    """The method that raised: ``__init__``, ``start``, ``step`` or ``close``."""
    error_type: str
    """The exception's class name."""
    message: str
    """The exception's text."""
    traceback: str = ""
    """The formatted traceback, for the episode record."""

    def describe(self) -> str:
        """One line for logs: which method of which class raised what."""
        return f"{self.class_name}.{self.method} raised {self.error_type}: {self.message}"


def row_messages(row: dict, *, prompt_key: str = "prompt", messages_key: str = "messages",
                 system_prompt: str | None = None) -> list[dict]:
    """A data row's opening chat, as the prompt datasets read it: its ``messages``, or its prompt text as one user
    turn; ``system_prompt`` goes first unless the chat opens with a system message. ValueError for a row with
    neither field."""
    messages = row.get(messages_key)
    if messages is None:
        prompt = row.get(prompt_key)
        if not isinstance(prompt, str):
            raise ValueError(f"the row has no {messages_key!r} chat and no {prompt_key!r} text "
                             f"(fields: {sorted(row)})")
        messages = [{"role": "user", "content": prompt}]
    messages = [dict(message) for message in messages]
    if system_prompt is not None and (not messages or messages[0].get("role") != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
