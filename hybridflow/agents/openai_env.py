"""An environment whose episodes an agent program drives through the OpenAI-compatible endpoint (docs/agents.md).

The user writes the agent loop itself against the ``openai`` client, ``async def agent(self, client, row) ->
float`` (or a plain ``def`` taking a synchronous ``openai.OpenAI``), and returns the episode's reward. The client's
``base_url`` points at the episode's path on the endpoint the step serves (``hybridflow.agents.endpoint``), which
records the token ids of every call; the step trains on them. Torch-free.
"""

from __future__ import annotations

from abc import abstractmethod

from hybridflow.agents.env import AssistantTurn, Environment, EpisodeStart, TurnResult, row_messages


class OpenAIAgentEnvironment(Environment):
    """One instance per episode; ``agent`` runs once per episode against the endpoint.

    ``max_turns`` bounds the chat-completion calls of one episode: a call past it is refused (HTTP 400) and the
    episode ends truncated (``max_turns``). ``start`` and ``step`` are not used by the endpoint runner (the agent
    drives the turns); ``start`` is kept so that the preflight check can open an episode on a data row.
    """

    max_turns: int = 8

    @abstractmethod
    async def agent(self, client, row: dict) -> float:
        """Run one episode with ``client`` (an ``openai.AsyncOpenAI``; an ``openai.OpenAI`` if ``agent`` is a plain
        ``def``) on the data row ``row``; return the episode's reward (a finite number)."""

    def start(self, row: dict) -> EpisodeStart:
        """The row's opening chat (what ``row_messages`` reads); only the preflight check calls it."""
        return EpisodeStart(row_messages(row))

    def step(self, turn: AssistantTurn) -> TurnResult:
        raise TypeError(f"{type(self).__name__} is driven by its agent() through the OpenAI-compatible endpoint; "
                        "step() is never called")
