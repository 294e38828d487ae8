"""ToolEnvironment: the standard tool-using episode, so that a user writes only the opening and the reward.

Each turn of the model is read for tool calls: calls are run (concurrently, with a timeout, every failure
an error text the model reads) and their results come back as tool messages; a turn without a call is
the final answer, and ``reward(row, messages)`` scores the whole conversation. A turn that calls a tool
on the last allowed turn also ends the episode (its calls are not run) and is scored the same way.
Torch-free.
"""

from __future__ import annotations

import functools
import inspect
from abc import abstractmethod
from concurrent.futures import Executor

from hybridflow.agents.env import AssistantTurn, Environment, EpisodeStart, TurnResult, row_messages
from hybridflow.agents.tool_calls import run_tool_calls
from hybridflow.agents.tools import Tool

TOOL_OUTCOMES_KEY = "tool_calls"
"""The key of ``TurnResult.info`` holding one ``ToolOutcome.record()`` per call of the turn."""


class ToolEnvironment(Environment):
    """A multi-turn episode with tools: define ``reward`` (and ``tools``, or ``start`` to open differently).

    The default ``start`` opens with the row's ``messages`` (or its ``prompt`` as one user turn), after
    ``system_prompt`` if set, and offers ``tools``. Whatever ``start`` a subclass writes, the row and the
    opening are recorded, so ``step`` can hand ``reward`` the row and the whole conversation.
    """

    tools: tuple[Tool, ...] | list[Tool] = ()
    """The tools offered when ``start`` does not say otherwise."""
    max_turns: int = 4
    tool_timeout_s: float = 30.0
    """Seconds one call may take (set from ``env.tool_timeout_s`` when the episode runner builds the instance)."""
    system_prompt: str | None = None
    """A system message put before the row's chat by the default ``start`` (unless the chat opens with one)."""
    executor: Executor | None = None
    """Where tool calls run (None: a process-wide thread pool)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "start" in cls.__dict__:  # record what a subclass's own start opens with
            cls.start = _recording(cls.__dict__["start"])

    def start(self, row: dict) -> EpisodeStart:
        return EpisodeStart(row_messages(row, system_prompt=self.system_prompt), list(self.tools))

    @abstractmethod
    def reward(self, row: dict, messages: list[dict]) -> float:
        """The episode's reward from the row and the conversation (the last message is the model's final turn)."""

    def step(self, turn: AssistantTurn) -> TurnResult:
        assistant = {"role": "assistant", "content": turn.text}
        if turn.tool_calls:
            assistant["tool_calls"] = [call.message_entry() for call in turn.tool_calls]
        self.messages.append(assistant)
        calling = bool(turn.tool_calls or turn.parse_errors)
        if not calling or turn.turn_index + 1 >= self.max_turns:
            return TurnResult([], float(self.reward(self.row, self.messages)), True,
                              {"ended_by": "tool call on the last turn" if calling else "answer"})
        outcomes = run_tool_calls(turn.tool_calls, self.episode_tools, self.tool_timeout_s, self.executor,
                                  parse_errors=turn.parse_errors)
        replies = [outcome.message() for outcome in outcomes]
        self.messages.extend(replies)
        return TurnResult(replies, None, False, {TOOL_OUTCOMES_KEY: [outcome.record() for outcome in outcomes]})


def _recording(start):
    if inspect.iscoroutinefunction(start):
        return start  # left as written, so that load_environment refuses it by name
    @functools.wraps(start)
    def recorded_start(self: ToolEnvironment, row: dict) -> EpisodeStart:
        opening = start(self, row)
        if isinstance(opening, EpisodeStart):  # anything else is refused by checked_start
            self.row, self.messages, self.episode_tools = row, list(opening.messages), list(opening.tools)
        return opening

    return recorded_start


ToolEnvironment.start = _recording(ToolEnvironment.start)
