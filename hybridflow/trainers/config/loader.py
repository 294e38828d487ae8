"""Typed construction of config dataclasses from YAML and dotted `key=value` overrides.

A config file is plain YAML; every key must name a field of the target dataclass (nested sections
are nested dataclasses: the components' own configs, e.g. ``EngineConfig``). Values are checked
against the field's annotation before the dataclass is built, so a typo or a wrong type fails with
the dotted key, the given value and what is allowed, before any worker starts. Each dataclass then
validates its own values in ``__post_init__``.

Every field of a config dataclass is a key the user may set: what the trainer derives from the keys
(seeds, step counts, token ids, the updates' mini-batch sizes) is passed to the components as build
arguments and never stored in a config.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

ConfigT = TypeVar("ConfigT")
_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (plain YAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping (first at line {seen[key] + 1}); yaml "
                    f"would silently keep the last", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read one YAML mapping from ``path`` (an empty file is an empty mapping; a key twice in a mapping is an
    error)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a directory; give a YAML file")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    with path.open("rb") as handle:
        if handle.read(2) == b"\x1f\x8b":
            raise ValueError(f"config file {str(path)!r} is gzip-compressed; decompress it (gunzip) first")
    try:
        with path.open(encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as error:
        raise ValueError(_yaml_error_line(path, error)) from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(error).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level, "
                         f"got {type(data).__name__}")
    return data


def _yaml_error_line(path: Path, error: yaml.MarkedYAMLError) -> str:
    """yaml's several-line parser message as one line: ``file:line:column: problem (context at line N)``."""
    mark = error.problem_mark or error.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = error.problem or error.context or "invalid YAML"
    context = ""
    if error.context and error.problem:
        context_line = f" at line {error.context_mark.line + 1}" if error.context_mark is not None else ""
        context = f" ({error.context}{context_line})"
    return f"config file {where}: YAML syntax error: {problem}{context}"


def apply_overrides(data: dict[str, Any], overrides: list[str], cls: type | None = None) -> dict[str, Any]:
    """A copy of ``data`` with each ``a.b.c=value`` applied (value parsed as YAML: 3, 1e-5, true, [1, 2]).

    With the target dataclass ``cls``, an override of one of a section's alternative keys (its
    ``ALTERNATIVES`` groups, e.g. a model's ``path`` / ``tiny`` / ``builtin``) replaces the
    alternative the YAML set: ``model.path=DIR`` over ``model: {builtin: arithmetic}`` gives
    ``{path: DIR}``. Two alternatives both given as overrides stay both (the section's own check
    then names the conflict).
    """
    # a str or a dict would iterate as characters or keys: "override 't' must look like ..." says nothing useful
    if not isinstance(overrides, (str, bytes, dict)):
        overrides = list(overrides)
    if not isinstance(overrides, list) or not all(isinstance(item, str) for item in overrides):
        raise ValueError(f"overrides must be a list of 'key.path=value' strings, got {overrides!r}")
    result = _deep_copy(data)
    set_by_override: set[tuple[str, ...]] = set()
    for override in overrides:
        if "=" not in override:
            raise ValueError(f"override {override!r} must look like key.path=value")
        dotted_key, raw_value = override.split("=", 1)
        keys = dotted_key.strip().split(".")
        if not all(keys):
            raise ValueError(f"override {override!r} has an empty key segment")
        try:
            value = yaml.load(raw_value, Loader=_UniqueKeyLoader) if raw_value.strip() else ""
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or " ".join(str(error).split())
            raise ValueError(f"override {override!r}: its value is not valid YAML: {problem} (quote the value or "
                             f"fix its brackets)") from None
        node = result
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                prefix = ".".join(keys[: depth + 1])
                raise ValueError(f"override {override!r}: {prefix} is a value ({child!r}), not a section")
            node = child
        node[keys[-1]] = value
        if value is not None:
            for sibling in _alternatives_of(cls, keys):
                if sibling in node and (*keys[:-1], sibling) not in set_by_override:
                    del node[sibling]
        set_by_override.add(tuple(keys))
    return result


def _alternatives_of(cls: type | None, keys: list[str]) -> tuple[str, ...]:
    """The keys that exclude ``keys[-1]`` in its section (its group in the section's ``ALTERNATIVES``), if any."""
    section = cls
    for key in keys[:-1]:
        fields = {field.name: field for field in dataclasses.fields(section)} if section is not None else {}
        if key not in fields:
            return ()
        section = _section_type(typing.get_type_hints(section)[key])
    for group in getattr(section, "ALTERNATIVES", ()):
        if keys[-1] in group:
            return tuple(name for name in group if name != keys[-1])
    return ()


def config_key(field: dataclasses.Field) -> str:
    """The key a field is written under in YAML and overrides: its name, or ``metadata["key"]`` where the natural
    key is a Python keyword (``env.class`` is the field ``class_path``)."""
    return field.metadata.get("key", field.name)


def build_dataclass(cls: type[ConfigT], data: dict[str, Any] | None, *, path: str = "",
                    base: Any = None) -> ConfigT:
    """Instantiate ``cls`` from a nested mapping, checking keys and types field by field.

    Keys not given take ``base``'s values when given, else the class defaults; a section given in part starts
    from its field's own default (the actor's ``engine`` keeps the actor's learning rate when only
    ``actor.engine.micro_batch_tokens`` is set)."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path or 'config'} must be a mapping of keys to values, got {data!r}")
    fields = {config_key(field): field for field in dataclasses.fields(cls) if field.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        refused = getattr(cls, "REFUSED_KEYS", {})
        if unknown[0] in refused:
            raise ValueError(f"config key {where}{unknown[0]} is not allowed here: {refused[unknown[0]]}")
        raise ValueError(f"unknown config key {where}{unknown[0]}; allowed keys here: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        name = fields[key].name
        default = getattr(base, name) if base is not None else _section_default(fields[key])
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            kwargs[name] = build_dataclass(type(default), value, path=_join(path, key), base=default)
        else:
            kwargs[name] = _coerce(hints[name], value, _join(path, key))
    if base is not None:
        kwargs = {**{field.name: getattr(base, field.name) for field in fields.values()}, **kwargs}
    missing = sorted(key for key, field in fields.items() if field.name not in kwargs
                     and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING)
    for key in list(missing):
        name = fields[key].name
        if dataclasses.is_dataclass(hints[name]):
            kwargs[name] = build_dataclass(hints[name], {}, path=_join(path, key))  # names the deepest missing key
            missing.remove(key)
    if missing:
        raise ValueError(f"config key {_join(path, missing[0])} is required but missing")
    try:
        return cls(**kwargs)
    except ValueError as error:
        # Sections name their own fields; prefix the section's dotted path so the user sees the full key.
        message = str(error)
        if path and message.startswith("config key "):
            message = f"config key {path}." + message[len("config key "):]
            raise ValueError(message) from None
        if path and not message.startswith("config key "):
            # a component's own check (e.g. EngineConfig's) names its field; add where the section sits
            raise ValueError(f"config key {path}: {message}") from None
        raise


def to_plain(config: Any) -> Any:
    """A config dataclass as nested dicts/lists (for logging, checkpoints and YAML dumps): the result loads back
    as an equal config."""
    if dataclasses.is_dataclass(config):
        return {config_key(field): to_plain(getattr(config, field.name)) for field in dataclasses.fields(config)}
    if isinstance(config, dict):
        return {key: to_plain(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_plain(value) for value in config]
    return config


def dump_yaml(config: Any) -> str:
    """The config's knobs as YAML: loading it back gives an equal config."""
    return yaml.safe_dump(to_plain(config), sort_keys=False, default_flow_style=None, width=100)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), base classes included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def config_reference(cls: type, *, prefix: str = "", instance: Any = None) -> list[dict[str, str]]:
    """One row per leaf field of ``cls`` (nested sections flattened to dotted keys): key, type, default, doc.

    Defaults come from ``instance`` when given (a section whose default differs from its class's, such as
    the critic's learning rate), else from the class; a required field's default reads ``required``.
    """
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key = _join(prefix, config_key(field))
        annotation = hints[field.name]
        section = _section_type(annotation)
        default = _default_of(field, instance)
        if section is not None:
            rows.append({"key": key, "type": "section" + (" or null" if section is not annotation else ""),
                         "default": "required" if default is dataclasses.MISSING else
                         ("null" if default is None else "(below)"), "doc": docs.get(field.name, "")})
            rows.extend(config_reference(section, prefix=key, instance=default if dataclasses.is_dataclass(default)
                                         else None))
            continue
        doc = docs.get(field.name, "")
        shown = "required" if default is dataclasses.MISSING else yaml.safe_dump(to_plain(default),
                                                                                   default_flow_style=True).strip()
        shown = shown.removesuffix("\n...").strip()
        rows.append({"key": key, "type": _describe(annotation), "default": shown, "doc": doc})
    return rows


def _section_type(annotation: Any):
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        sections = [arg for arg in typing.get_args(annotation) if dataclasses.is_dataclass(arg)]
        if len(sections) == 1:
            return sections[0]
    return None


def _default_of(field: dataclasses.Field, instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, field.name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _section_default(field: dataclasses.Field) -> Any:
    """A section field's default instance when its factory makes one (None otherwise)."""
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
        return default if dataclasses.is_dataclass(default) else None
    return field.default if dataclasses.is_dataclass(field.default) else None


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {key: _deep_copy(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_deep_copy(value) for value in data]
    return data


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if dataclasses.is_dataclass(annotation):
        return "a mapping"
    if origin is not None:
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))


def _coerce(annotation: Any, value: Any, key: str) -> Any:
    """``value`` checked against ``annotation`` (ints widen to floats; nothing else is converted)."""
    origin = typing.get_origin(annotation)
    wrong = ValueError(f"config key {key} got {value!r} ({type(value).__name__}); allowed: {_describe(annotation)}")
    if dataclasses.is_dataclass(annotation):
        return build_dataclass(annotation, value, path=key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(annotation):
            return None  # null is null, also for an optional section whose every field has a default
        sections = [arg for arg in typing.get_args(annotation) if dataclasses.is_dataclass(arg)]
        if isinstance(value, dict) and len(sections) == 1:
            # an optional section given as a mapping: its own errors name the key inside it
            return build_dataclass(sections[0], value, path=key)
        for arg in typing.get_args(annotation):
            try:
                return _coerce(arg, value, key)
            except ValueError:
                continue
        raise wrong
    if annotation is type(None):
        if value is None:
            return None
        raise wrong
    if origin is Literal:
        if value in typing.get_args(annotation) and not isinstance(value, bool):
            return value
        raise wrong
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise wrong
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string; users mean a float
        raise wrong
    if annotation is str:
        if isinstance(value, str):
            return value
        raise wrong
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise wrong
        (item_type, *_) = typing.get_args(annotation)
        items = [_coerce(item_type, item, f"{key}[{index}]") for index, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong
        key_type, value_type = typing.get_args(annotation)
        return {_coerce(key_type, item_key, key): _coerce(value_type, item, f"{key}.{item_key}")
                for item_key, item in value.items()}
    if annotation is Any:
        return value
    raise TypeError(f"config loader does not support annotation {annotation!r} (key {key})")
