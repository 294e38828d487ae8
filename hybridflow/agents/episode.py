"""One episode's tokens, token-exact: prompt ids, then the sampled ids of each turn and the observation ids
between turns, with a loss mask that is 1 exactly on the sampled ids.

Nothing sampled is ever decoded and re-encoded for training. The prompt is the chat template applied to the
episode's opening messages (with the tools' schemas); what comes back between two turns (tool results, a user
message, and the template's glue: the end of the assistant turn, the next headers, the next assistant header)
is rendered on its own as a *delta* (``ChatTokens.observation_ids``): a fixed dummy conversation is rendered
with the new messages appended, and the text after the dummy assistant turn is tokenized alone and appended as
ids. The sampled turn before it never passes through the template again, so a template that rewrites history
(reasoning templates drop ``<think>`` blocks of earlier turns) or a tokenizer whose merges would join the end of
a turn with the following glue cannot change what is trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DUMMY_TURN = "hybridflowTurnMark"
"""The dummy assistant content the observation delta is cut after (no whitespace: templates that trim keep it)."""
DUMMY_CONVERSATION = ({"role": "user", "content": "hybridflowUserMark"}, {"role": "assistant", "content": DUMMY_TURN})


class ChatTokens:
    """Prompt and observation token ids of a tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("env.class needs a tokenizer with a chat template (episodes are chats: the opening "
                             "messages, tool results and user turns are rendered through it); the actor's tokenizer "
                             "has none")
        self.tokenizer = tokenizer

    def _render(self, messages: list[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The opening messages rendered with the generation prompt (the first assistant header), tokenized."""
        return self.encode(self._render(messages, tools, generation_prompt=True))

    def observation_text(self, new_messages: list[dict], tools: list[dict] | None = None, *,
                         closed_by: str | None = None) -> str:
        """The template's text between the end of an assistant turn's content and the next turn's first sampled
        token: the turn's end, ``new_messages``, the next assistant header. ``closed_by``: the text of the token
        the sampled turn ended with (its end-of-turn token, already among the sampled ids), cut from the start of
        the delta; None for a turn cut by its length, whose end the template's glue supplies."""
        rendered = self._render([*DUMMY_CONVERSATION, *new_messages], tools, generation_prompt=True)
        cut = rendered.rfind(DUMMY_TURN)
        if cut < 0:
            raise ValueError("the chat template does not render the assistant message's content verbatim; "
                             "observation tokens cannot be cut from it")
        delta = rendered[cut + len(DUMMY_TURN):]
        if closed_by and delta.startswith(closed_by):
            delta = delta[len(closed_by):]
        return delta

    def observation_ids(self, new_messages: list[dict], tools: list[dict] | None = None, *,
                        closed_by: str | None = None) -> list[int]:
        """``observation_text`` tokenized on its own: the ids appended after a turn's sampled ids."""
        return self.encode(self.observation_text(new_messages, tools, closed_by=closed_by))


@dataclass
class Segment:
    """A run of an episode's tokens after the prompt: one turn's sampled ids, or the observation after it."""

    kind: str
    """"sampled" or "observation"."""
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    """Sampled log-probs (sampled segments only)."""


@dataclass
class Episode:
    """One episode's conversation and tokens, and what happened in it (turns, rewards, truncation, failure)."""

    index: int
    """Row of the episode in the step's batch (prompt-major: prompt i's samples are i*n .. i*n+n-1)."""
    prompt_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """The whole conversation as text: opening messages, each turn's decoded text, the observations."""
    tools: list[dict] = field(default_factory=list)
    """The tools' schemas the prompt was rendered with."""
    segments: list[Segment] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    """The reward each turn's step returned (0 where it returned None)."""
    turns: int = 0
    done: bool = False
    """The environment said the episode is over."""
    truncated: str | None = None
    """Why the episode ended without the environment saying so: "max_turns", "token_budget"; None otherwise."""
    failed: str | None = None
    """The environment's failure (an exception in start or step), as text; None if it did not fail."""
    tool_records: list[dict] = field(default_factory=list)
    """One ``ToolOutcome.record()`` per tool call the environment ran (``TurnResult.info["tool_calls"]``)."""
    tool_seconds: float = 0.0
    """Seconds this episode's environment steps (and so its tools) took, measured in the thread that ran them."""
    generation_seconds: float = 0.0
    """Seconds from each turn's submission to its output (shared with the other requests it was batched with)."""
    finished_at: float = 0.0
    """perf_counter() when the episode ended."""
    placeholder: bool = False
    """Its only sampled token is a placeholder (it sampled nothing); it is never trained."""

    def add_sampled(self, token_ids, logprobs) -> None:
        self.segments.append(Segment("sampled", list(token_ids), list(logprobs)))

    def add_observation(self, token_ids) -> None:
        self.segments.append(Segment("observation", list(token_ids)))

    @property
    def response_ids(self) -> list[int]:
        """Every token after the prompt, in order (what is trained after the prompt)."""
        return [token for segment in self.segments for token in segment.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 on each sampled token, 0 on each observation token (aligned with ``response_ids``)."""
        return [int(segment.kind == "sampled") for segment in self.segments for _ in segment.token_ids]

    @property
    def sampled_logprobs(self) -> list[float]:
        """The sampled log-prob of each sampled token, 0 on observation tokens (aligned with ``response_ids``)."""
        return [value for segment in self.segments
                for value in (segment.logprobs if segment.kind == "sampled" else [0.0] * len(segment.token_ids))]

    def num_tokens(self, kind: str) -> int:
        return sum(len(segment.token_ids) for segment in self.segments if segment.kind == kind)

    @property
    def length(self) -> int:
        """Prompt and response tokens."""
        return len(self.prompt_ids) + sum(len(segment.token_ids) for segment in self.segments)

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its turns' rewards."""
        return float(sum(self.turn_rewards))

    def turn_reward_positions(self) -> list[tuple[int, float]]:
        """(response position of each rewarded turn's last sampled token, that turn's reward)."""
        positions, offset, turn = [], 0, 0
        for segment in self.segments:
            offset += len(segment.token_ids)
            if segment.kind == "sampled":
                if turn < len(self.turn_rewards) and segment.token_ids:
                    positions.append((offset - 1, self.turn_rewards[turn]))
                turn += 1
        return positions

    def record(self) -> dict:
        """The episode as one JSON-ready dict (the ``env.record_every`` file's lines)."""
        return {"index": self.index, "messages": self.messages, "tools": self.tools, "prompt_ids": self.prompt_ids,
                "response_ids": self.response_ids, "loss_mask": self.loss_mask, "turn_rewards": self.turn_rewards,
                "reward": self.reward, "turns": self.turns, "done": self.done, "truncated": self.truncated,
                "failed": self.failed, "tool_calls": self.tool_records,
                "sampled_tokens": self.num_tokens("sampled"), "observation_tokens": self.num_tokens("observation"),
                "tool_seconds": self.tool_seconds, "generation_seconds": self.generation_seconds,
                "placeholder": self.placeholder}
