"""Tools: plain Python functions with type hints and a docstring, offered to the model as OpenAI function schemas.

``tool(fn)`` reads the schema from the function: its name, the docstring's first paragraph as the
description, each parameter's type from its hint and its description from the docstring's ``Args:``
section (Google style) or ``:param name:`` lines. ``Tool.call(arguments)`` checks the model's arguments
against that schema before the function runs, so a wrong call is reported to the model, not raised
into the trainer. Torch-free.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Union

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}
_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
_SECTION_HEADER = re.compile(r"^\s*(Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_GOOGLE_ARG = re.compile(r"^\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_ARG = re.compile(r"^\s*:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


class ToolArgumentError(ValueError):
    """The model's arguments do not fit the tool's schema (the message says what is wrong)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments, with the text it was parsed from."""

    name: str
    """The tool the model named."""
    arguments: dict
    """The arguments it gave (a JSON object)."""
    raw: str = ""
    """The text of the call as the model wrote it."""
    id: str = ""
    """An id to pair the call with its tool message (``tool_call_id``); the parser numbers them."""

    def message_entry(self) -> dict:
        """The call as an entry of an assistant message's ``tool_calls`` (OpenAI format)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class _Parameter:
    name: str
    annotation: Any
    required: bool
    schema: dict


@dataclass
class Tool:
    """A function the model may call; ``schema`` is what the chat template's ``tools=`` receives.

    Build one with ``tool(fn)``. ``timeout_s`` (None: the environment's ``tool_timeout_s``) bounds one call.
    """

    function: Callable[..., Any]
    """What runs when the model calls the tool (keyword arguments from the model's JSON)."""
    name: str = ""
    """The name the model calls it by (default: the function's name)."""
    description: str = ""
    """What the model reads about it (default: the docstring's first paragraph)."""
    timeout_s: float | None = None
    """Seconds one call may take; None: the environment's ``tool_timeout_s``."""
    parameters: list[_Parameter] = field(default_factory=list, init=False, repr=False)
    """The parameters read from the signature, with their JSON schemas."""

    def __post_init__(self) -> None:
        if not callable(self.function):
            raise ValueError(f"a tool wraps a function, got {type(self.function).__name__} {self.function!r:.80}")
        qualname = getattr(self.function, "__qualname__", repr(self.function))
        self.name = self.name or getattr(self.function, "__name__", "")
        if not re.fullmatch(r"[A-Za-z_][\w-]{0,63}", self.name):
            raise ValueError(f"tool {qualname}: name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0 seconds or None, got {self.timeout_s!r}")
        summary, argument_docs = _parse_docstring(inspect.getdoc(self.function) or "")
        self.description = self.description or summary
        if not self.description:
            raise ValueError(f"tool {qualname} needs a docstring (its first paragraph tells the model what it does)")
        self.parameters = _parameters(self.function, qualname, argument_docs)

    @property
    def schema(self) -> dict:
        """The OpenAI function schema: ``{"type": "function", "function": {name, description, parameters}}``."""
        properties = {parameter.name: parameter.schema for parameter in self.parameters}
        required = [parameter.name for parameter in self.parameters if parameter.required]
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": required}}}

    def checked_arguments(self, arguments: Any) -> dict:
        """The arguments as keyword arguments; ToolArgumentError when they do not fit the schema."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments of {self.name} must be a JSON object, got {_json_type(arguments)}")
        known = {parameter.name: parameter for parameter in self.parameters}
        unknown = sorted(set(arguments) - set(known))
        if unknown:
            raise ToolArgumentError(f"{self.name} has no parameter {unknown[0]!r}; its parameters: "
                                    f"{', '.join(known) or 'none'}")
        missing = [name for name, parameter in known.items() if parameter.required and name not in arguments]
        if missing:
            raise ToolArgumentError(f"{self.name} requires the argument {missing[0]!r}")
        return {name: _checked_value(known[name], value, self.name) for name, value in arguments.items()}

    def call(self, arguments: dict) -> str:
        """Run the tool on the model's arguments -> the text the model reads (non-text results as JSON)."""
        result = self.function(**self.checked_arguments(arguments))
        if isinstance(result, str):
            return result
        if result is None:
            return ""
        try:
            return json.dumps(result, ensure_ascii=False)
        except TypeError:
            return str(result)


def tool(function: Callable | None = None, *, name: str = "", description: str = "",
         timeout_s: float | None = None) -> Tool | Callable[[Callable], Tool]:
    """A Tool from a function with type hints and a docstring; usable as ``@tool`` or ``@tool(timeout_s=5)``."""
    if function is None:
        return lambda wrapped: Tool(wrapped, name=name, description=description, timeout_s=timeout_s)
    return Tool(function, name=name, description=description, timeout_s=timeout_s)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph, {parameter: description}) of a Google- or Sphinx-style docstring."""
    lines = doc.splitlines()
    summary_lines = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line) or _SPHINX_ARG.match(line):
            break
        summary_lines.append(line.strip())
    descriptions: dict[str, str] = {}
    in_args, current, entry_indent = False, None, 0
    for line in lines:
        indent = len(line) - len(line.lstrip())
        sphinx, google = _SPHINX_ARG.match(line), _GOOGLE_ARG.match(line)
        if sphinx:
            current = sphinx.group(1)
            descriptions[current] = sphinx.group(2).strip()
        elif _ARGS_HEADER.match(line):
            in_args, current = True, None
        elif _SECTION_HEADER.match(line) or line.strip().startswith(":"):
            in_args, current = False, None
        elif in_args and google and (current is None or indent <= entry_indent):
            current, entry_indent = google.group(1), indent
            descriptions[current] = google.group(3).strip()
        elif current is not None and line.strip():  # a continuation line of the current entry
            descriptions[current] = f"{descriptions[current]} {line.strip()}".strip()
    return " ".join(summary_lines), descriptions


def _parameters(function: Callable, qualname: str, argument_docs: dict[str, str]) -> list[_Parameter]:
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
    except (TypeError, ValueError, NameError) as error:
        raise ValueError(f"tool {qualname}: cannot read its signature and type hints: {error}") from None
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.POSITIONAL_ONLY):
            raise ValueError(f"tool {qualname}: parameter {parameter.name!r} must be a named parameter "
                             "(no *args, **kwargs or positional-only parameters): the model calls tools by keyword")
        if parameter.name not in hints:
            raise ValueError(f"tool {qualname}: parameter {parameter.name!r} needs a type hint (str, int, float, "
                             "bool, list[...], dict, Literal[...] or Optional of one)")
        schema = _json_schema(hints[parameter.name], f"tool {qualname}: parameter {parameter.name!r}")
        if argument_docs.get(parameter.name):
            schema["description"] = argument_docs[parameter.name]
        parameters.append(_Parameter(parameter.name, hints[parameter.name], parameter.default is parameter.empty,
                                     schema))
    return parameters


def _json_schema(annotation: Any, where: str) -> dict:
    """The JSON schema of one type hint; ValueError naming ``where`` for a type the model cannot write."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is Literal:
        kinds = {type(choice) for choice in arguments}
        if len(kinds) != 1 or next(iter(kinds)) not in _JSON_TYPES:
            raise ValueError(f"{where}: Literal choices must be all str, all int, ... (got {arguments})")
        return {"type": _JSON_TYPES[next(iter(kinds))], "enum": list(arguments)}
    if origin in (Union, types.UnionType):
        options = [argument for argument in arguments if argument is not type(None)]
        if len(options) == 1:
            return {**_json_schema(options[0], where), "nullable": True}
        return {"anyOf": [_json_schema(option, where) for option in options]}
    if origin in (list, tuple):
        return {"type": "array", "items": _json_schema(arguments[0], where)} if arguments else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    raise ValueError(f"{where}: type {annotation!r} has no JSON form; use str, int, float, bool, list[...], dict, "
                     "Literal[...] or Optional of one")


def _json_type(value: Any) -> str:
    for python_type, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                              (list, "array"), (dict, "object")):
        if isinstance(value, python_type):
            return f"{name} {json.dumps(value)[:60]}"
    return "null" if value is None else type(value).__name__


def _checked_value(parameter: _Parameter, value: Any, tool_name: str) -> Any:
    """``value`` if it fits the parameter's type (an integer is accepted for a float), else ToolArgumentError."""
    if _fits(parameter.annotation, value):
        return float(value) if parameter.annotation is float else value
    expected = parameter.schema.get("enum") or parameter.schema.get("type") or "one of the allowed types"
    raise ToolArgumentError(f"argument {parameter.name!r} of {tool_name} must be {expected}, got {_json_type(value)}")


def _fits(annotation: Any, value: Any) -> bool:
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in _JSON_TYPES:
        return isinstance(value, annotation)
    if origin is Literal:
        return value in arguments and type(value) is type(arguments[0])
    if origin in (Union, types.UnionType):
        return any(value is None if option is type(None) else _fits(option, value) for option in arguments)
    if origin in (list, tuple):
        return isinstance(value, list) and (not arguments or all(_fits(arguments[0], item) for item in value))
    if origin is dict:
        return isinstance(value, dict)
    return False
