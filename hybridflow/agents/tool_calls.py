"""Tool calls: parsed from a turn's text in the model's own format, then run with a timeout, every failure as data.

Formats (``env.tool_format``):
- ``hermes`` (Hermes, Qwen2/2.5/3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  anywhere in the turn;
- ``llama3`` (Llama 3.1+ JSON tool calling): the turn is the call itself, ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``; several calls are separated by ``;`` or new lines;
- ``auto``: the format the model's chat template renders (``parser_for_template``).
A call that cannot be parsed becomes a parse error (shown to the model as an error tool message).
``run_tool_calls`` never raises for what a tool does: an unknown tool, bad arguments, a tool that raises
or passes its timeout each yield a ToolOutcome with an error text the model reads and an error kind
that metrics count. Torch-free.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from hybridflow.agents.config import TOOL_FORMATS
from hybridflow.agents.tools import Tool, ToolArgumentError, ToolCall

ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "raised", "timeout")
"""Why a call failed, as counted in metrics."""
UNPARSED_TOOL = "<unparsed>"
"""The tool name a parse error is counted under."""
UNKNOWN_TOOL = "<unknown>"
"""The tool name calls of tools that do not exist are counted under in metrics."""
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_RAW_EXCERPT_CHARS = 200


@dataclass(frozen=True)
class ParsedTurn:
    """The tool calls of one turn and the calls that could not be parsed (each described)."""

    calls: list[ToolCall]
    errors: list[str]


class ToolCallParser(ABC):
    """Reads the tool calls out of a turn's text; one subclass per format."""

    format_name = ""

    @abstractmethod
    def parse(self, text: str, *, id_prefix: str = "call") -> ParsedTurn:
        """The turn's calls, numbered ``<id_prefix>_<i>``, and a description of each call that cannot be parsed."""


def _call_from_json(body: str, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from one JSON call, or the reason it is not one (the raw text quoted)."""
    excerpt = body.strip()[:_RAW_EXCERPT_CHARS]
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return f"invalid JSON in tool call ({error.msg} at char {error.pos}): {excerpt}"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return f'a tool call must be a JSON object with a "name" string: {excerpt}'
    arguments = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f'the "{argument_keys[0]}" of a tool call must be a JSON object: {excerpt}'
    if not isinstance(arguments, dict):
        return f'the "{argument_keys[0]}" of a tool call must be a JSON object: {excerpt}'
    return ToolCall(value["name"], arguments, raw=body.strip())


def _numbered(items: list[ToolCall | str], id_prefix: str) -> ParsedTurn:
    calls = [item for item in items if isinstance(item, ToolCall)]
    calls = [ToolCall(call.name, call.arguments, call.raw, f"{id_prefix}_{index}") for index, call in enumerate(calls)]
    return ParsedTurn(calls, [item for item in items if isinstance(item, str)])


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn (Hermes, Qwen)."""

    format_name = "hermes"

    def parse(self, text: str, *, id_prefix: str = "call") -> ParsedTurn:
        items: list[ToolCall | str] = [_call_from_json(body, ("arguments", "parameters"))
                                       for body in _HERMES_CALL.findall(text)]
        tail = _HERMES_CALL.sub("", text)
        if _HERMES_OPEN in tail:  # the turn ended (token budget, stop) inside a call
            excerpt = tail[tail.index(_HERMES_OPEN):][:_RAW_EXCERPT_CHARS]
            items.append(f"unterminated tool call (no </tool_call>): {excerpt}")
        return _numbered(items, id_prefix)


class Llama3Parser(ToolCallParser):
    """A turn that is JSON: ``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``)."""

    format_name = "llama3"

    def parse(self, text: str, *, id_prefix: str = "call") -> ParsedTurn:
        body = text.strip()
        tagged = body.startswith(_PYTHON_TAG)
        body = body.removeprefix(_PYTHON_TAG).strip()
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        if not body.startswith("{"):
            if tagged:
                return ParsedTurn([], [f"{_PYTHON_TAG} must be followed by a JSON tool call: "
                                       f"{body[:_RAW_EXCERPT_CHARS]}"])
            return ParsedTurn([], [])  # an answer in prose, not a call
        return _numbered([_call_from_json(piece, ("parameters", "arguments")) for piece in _json_pieces(body)],
                         id_prefix)


def _json_pieces(body: str) -> list[str]:
    """The JSON objects of a turn that holds one or more, separated by ``;``, commas or white space."""
    decoder, pieces, position = json.JSONDecoder(), [], 0
    while position < len(body):
        while position < len(body) and body[position] in " \t\r\n;,":
            position += 1
        if position >= len(body):
            break
        try:
            _, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            pieces.append(body[position:])  # the rest is one malformed call: reported as such
            break
        pieces.append(body[position:end])
        position = end
    return pieces


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3": Llama3Parser}


def parser_for_template(chat_template: str | None) -> ToolCallParser:
    """The parser of the format a chat template renders tool calls in (hermes when it shows none, with a warning)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesParser()
    if _PYTHON_TAG in template or ('"parameters"' in template and "tools" in template):
        return Llama3Parser()
    warnings.warn("the chat template renders no known tool-call format; parsing tool calls in the hermes format "
                  "(<tool_call>{json}</tool_call>); set env.tool_format to choose", stacklevel=2)
    return HermesParser()


def make_parser(tool_format: str, chat_template: str | None = None) -> ToolCallParser:
    """The parser for ``env.tool_format`` (``auto``: from the chat template)."""
    if tool_format == "auto":
        return parser_for_template(chat_template)
    if tool_format not in PARSERS:
        raise ValueError(f"env.tool_format got {tool_format!r}; allowed: {', '.join(TOOL_FORMATS)}")
    return PARSERS[tool_format]()


@dataclass(frozen=True)
class ToolOutcome:
    """What one call (or one unparseable call) gave: the text the model reads, and whether it failed, and why."""

    tool: str
    """The tool's name (UNPARSED_TOOL for a parse error; the model's name for an unknown tool)."""
    content: str
    """The tool message's text: the result, or an error the model can act on."""
    error_kind: str | None = None
    """None when the call succeeded, else one of ERROR_KINDS."""
    seconds: float = 0.0
    """Wall time of the call (the timeout for one that passed it)."""
    call_id: str = ""
    """The call's id (``tool_call_id`` of its message)."""

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def message(self) -> dict:
        """The tool message (OpenAI style) that carries the outcome back to the model."""
        message = {"role": "tool", "name": self.tool, "content": self.content}
        if self.call_id:
            message["tool_call_id"] = self.call_id
        return message

    def record(self) -> dict:
        """A JSON-ready summary for the episode record and the metrics (no content)."""
        return {"tool": self.tool, "ok": self.ok, "error_kind": self.error_kind, "seconds": round(self.seconds, 6)}


_DEFAULT_EXECUTOR: ThreadPoolExecutor | None = None
_DEFAULT_EXECUTOR_LOCK = threading.Lock()
DEFAULT_TOOL_THREADS = 32


def default_executor() -> ThreadPoolExecutor:
    """The process-wide thread pool that runs tools when no executor is given."""
    global _DEFAULT_EXECUTOR
    with _DEFAULT_EXECUTOR_LOCK:
        if _DEFAULT_EXECUTOR is None:
            _DEFAULT_EXECUTOR = ThreadPoolExecutor(DEFAULT_TOOL_THREADS, thread_name_prefix="hybridflow-tool")
        return _DEFAULT_EXECUTOR


def _timed_call(tool: Tool, arguments: dict) -> tuple[str | None, BaseException | None, float]:
    """(the tool's text or None, what it raised or None, seconds it ran), measured on the thread that ran it."""
    started = time.monotonic()
    try:
        return tool.call(arguments), None, time.monotonic() - started
    except (Exception, SystemExit) as error:  # noqa: BLE001 - whatever a tool raises is reported to the model
        return None, error, time.monotonic() - started


def _finished(call: ToolCall, future, deadline: float, timeout_s: float) -> ToolOutcome:
    """The outcome of one submitted call, waiting for it until ``deadline``."""
    try:
        content, error, seconds = future.result(timeout=max(deadline - time.monotonic(), 0.0))
    except FutureTimeout:
        future.cancel()  # not started yet: never runs; running: abandoned (Python cannot stop a thread)
        return ToolOutcome(call.name, f"error: tool {call.name} did not finish within {timeout_s:g} s",
                           "timeout", timeout_s, call.id)
    if isinstance(error, ToolArgumentError):
        return ToolOutcome(call.name, f"error: bad arguments for {call.name}: {error}", "bad_arguments", seconds,
                           call.id)
    if error is not None:
        return ToolOutcome(call.name, f"error: {call.name} raised {type(error).__name__}: {error}", "raised",
                           seconds, call.id)
    return ToolOutcome(call.name, content, None, seconds, call.id)


def run_tool_calls(calls: Sequence[ToolCall], tools: Sequence[Tool], timeout_s: float,
                   executor: Executor | None = None, *, parse_errors: Sequence[str] = ()) -> list[ToolOutcome]:
    """Run a turn's calls concurrently on ``executor`` -> one outcome per call, then one per parse error.

    Each call may take ``timeout_s`` seconds (or its tool's own ``timeout_s``) from the moment it is
    submitted; a call past it is reported as timed out while the others still return their results.
    """
    if not timeout_s > 0:
        raise ValueError(f"env.tool_timeout_s got {timeout_s!r}; allowed: a number of seconds > 0")
    by_name = {tool.name: tool for tool in tools}
    executor = executor or default_executor()
    pending: list[tuple[ToolCall, object, float, float] | ToolOutcome] = []
    for call in calls:
        tool = by_name.get(call.name)
        if tool is None:
            known = ", ".join(sorted(by_name)) or "none"
            pending.append(ToolOutcome(call.name, f"error: unknown tool {call.name!r}; the tools are: {known}",
                                       "unknown_tool", 0.0, call.id))
            continue
        limit = tool.timeout_s or timeout_s
        pending.append((call, executor.submit(_timed_call, tool, call.arguments), time.monotonic() + limit, limit))
    outcomes = [item if isinstance(item, ToolOutcome) else _finished(*item) for item in pending]
    return outcomes + [ToolOutcome(UNPARSED_TOOL, f"error: could not parse a tool call: {error}", "parse")
                       for error in parse_errors]


async def arun_tool_calls(calls: Sequence[ToolCall], tools: Sequence[Tool], timeout_s: float,
                          executor: Executor | None = None, *, parse_errors: Sequence[str] = ()) -> list[ToolOutcome]:
    """``run_tool_calls`` for an asyncio episode loop: waits without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: run_tool_calls(calls, tools, timeout_s, executor, parse_errors=parse_errors))


def tool_metrics(records: Sequence[dict]) -> dict[str, float]:
    """Counts and seconds over ``ToolOutcome.record()`` dicts -> metrics named ``agent/tool_*``.

    ``agent/tool_calls``, ``agent/tool_errors``, ``agent/tool_seconds`` (sum), per tool
    ``agent/tool_calls/<tool>`` and ``agent/tool_errors/<tool>`` (unparseable calls under ``<unparsed>``, calls of
    tools that do not exist under ``<unknown>``), per kind ``agent/tool_errors_<kind>``.
    """
    metrics = {"agent/tool_calls": float(len(records)),
               "agent/tool_errors": float(sum(not record["ok"] for record in records)),
               "agent/tool_seconds": float(sum(record["seconds"] for record in records))}
    for record in records:
        # a name the model made up is counted under one key: made-up names must not multiply the metrics
        name = UNKNOWN_TOOL if record["error_kind"] == "unknown_tool" else record["tool"]
        metrics[f"agent/tool_calls/{name}"] = metrics.get(f"agent/tool_calls/{name}", 0.0) + 1
        metrics.setdefault(f"agent/tool_errors/{name}", 0.0)
        if not record["ok"]:
            metrics[f"agent/tool_errors/{name}"] += 1
            key = f"agent/tool_errors_{record['error_kind']}"
            metrics[key] = metrics.get(key, 0.0) + 1
    return metrics
