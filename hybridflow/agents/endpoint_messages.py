"""The request side of the OpenAI-compatible endpoint: checking a chat-completion body, finding the messages a call
adds to its episode (refusing one that edits the history), and the sampling options it sets. Torch-free.

The history rule: the messages of a call must begin with the episode's conversation as the endpoint has it (the
opening messages, each reply exactly as returned, the messages added since). Messages are compared by role and
text (``content``, a string or a list of text parts; ``None`` is ""), and tool messages also by ``tool_call_id``:
an assistant message sent back from the reply object (``response.choices[0].message``) or rebuilt as
``{"role": "assistant", "content": reply.content}`` both match. The tools must stay the same.
"""

from __future__ import annotations

import math
import numbers

from hybridflow.agents.env import OBSERVATION_ROLES

MESSAGE_ROLES = ("system", "user", "assistant", "tool")
UNSUPPORTED = {"stream": (None, False), "n": (None, 1), "echo": (None, False)}
"""Request fields the endpoint serves only at these values (anything else is refused)."""


class EndpointError(Exception):
    """A call the endpoint refuses (HTTP 400 with OpenAI's error body)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise EndpointError("bad_content", f"message content {str(content)[:200]!r}; allowed: a string or text parts")


def _message(message) -> dict:
    """A message as the chat template gets it: role, text content, and a tool message's ``tool_call_id``/``name``."""
    if not isinstance(message, dict) or message.get("role") not in MESSAGE_ROLES:
        raise EndpointError("bad_message", f"message {str(message)[:200]!r}; allowed: a dict with a role in "
                            f"{MESSAGE_ROLES}")
    kept = {"role": message["role"], "content": _text(message.get("content"))}
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            kept[key] = message[key]
    return kept


def check_body(body) -> tuple[list[dict], list[dict]]:
    """The messages and tools of a request body, checked."""
    if not isinstance(body, dict):
        raise EndpointError("bad_body", "the request body must be a JSON object")
    for key, allowed in UNSUPPORTED.items():
        if body.get(key) not in allowed:
            raise EndpointError(f"unsupported_{key}", f"{key}={body[key]!r} is not served; allowed: "
                                f"{' or '.join(repr(value) for value in allowed if value is not None)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError("bad_messages", "messages must be a non-empty list")
    messages = [_message(message) for message in messages]
    if messages[-1]["role"] == "assistant":
        raise EndpointError("assistant_prefill", "the last message is the assistant's; continuing an assistant "
                            "message is not served (every reply starts a new assistant turn)")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(item, dict) and item.get("type") == "function"
                                              and isinstance(item.get("function"), dict) for item in tools):
        raise EndpointError("bad_tools", "tools must be a list of {'type': 'function', 'function': {...}}")
    return messages, tools


def _same(sent: dict, kept: dict) -> bool:
    keys = ("role", "content") if kept["role"] == "assistant" else ("role", "content", "tool_call_id")
    return all(sent.get(key) == kept.get(key) for key in keys)


def new_messages(history: list[dict], history_tools: list[dict], messages: list[dict],
                 tools: list[dict]) -> list[dict]:
    """What ``messages`` add to the episode's ``history`` (tool results, user or system messages; possibly none);
    EndpointError if they do not extend it or change the tools."""
    if tools != history_tools:
        raise EndpointError("tools_changed", "the tools differ from the episode's first call's; they are part of "
                            "its prompt ids")
    if len(messages) < len(history):
        raise EndpointError("history_edited", f"the call sends {len(messages)} messages, fewer than the "
                            f"{len(history)} of the episode so far")
    for position, (sent, kept) in enumerate(zip(messages, history)):
        if not _same(sent, kept):
            raise EndpointError("history_edited", f"message {position} ({kept['role']}) differs from the "
                                f"episode's: sent {sent['content'][:120]!r}, kept {kept['content'][:120]!r}")
    new = messages[len(history):]
    for message in new:
        if message["role"] not in OBSERVATION_ROLES:
            raise EndpointError("history_edited", f"a new {message['role']!r} message; allowed after a reply: "
                                f"{OBSERVATION_ROLES} (assistant turns are sampled, never sent)")
    return new


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not low <= value <= high:
        raise EndpointError(f"bad_{key}", f"{key}={value!r}; allowed: a number in [{low}, {high}]")
    return float(value)


def sampling_changes(body: dict, encode, *, max_new_tokens: int) -> dict:
    """The ``SamplingOptions`` fields a call sets: ``temperature`` (0: greedy), ``top_p``, ``max_tokens`` (or
    ``max_completion_tokens``, at most ``max_new_tokens``: the step's limit and the episode's room), ``stop`` (each
    string as its token ids) and ``seed``."""
    changes = {}
    temperature = _number(body, "temperature", 0.0, 100.0)
    if temperature == 0.0:
        changes["greedy"] = True
    elif temperature is not None:
        changes["temperature"] = temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None and top_p > 0:
        changes["top_p"] = top_p
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise EndpointError("bad_max_tokens", f"max_tokens={limit!r}; allowed: an integer >= 1")
    changes["max_new_tokens"] = min(limit or max_new_tokens, max_new_tokens)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(text, str) and text for text in stops):
        raise EndpointError("bad_stop", f"stop={stop!r}; allowed: a string or a list of non-empty strings")
    if stops:
        changes["stop_sequences"] = tuple(tuple(encode(text)) for text in stops)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise EndpointError("bad_seed", f"seed={seed!r}; allowed: an integer")
        changes["seed"] = seed
    return changes
