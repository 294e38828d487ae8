"""Typed construction of config dataclasses from YAML and dotted `key=value` overrides.

A config file is plain YAML; every key must name a field of the target dataclass (nested sections
are nested dataclasses). Values are checked against the field's annotation before the dataclass is
built, so a typo or a wrong type fails with the dotted key, the given value and what is allowed,
before any worker starts. Each dataclass then validates its own values in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

ConfigT = TypeVar("ConfigT")
_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read one YAML mapping from ``path`` (an empty file is an empty mapping)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    with path.open() as handle:
        data = yaml.safe_load(handle)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level, "
                         f"got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``a.b.c=value`` applied (value parsed as YAML: 3, 1e-5, true, [1, 2])."""
    result = _deep_copy(data)
    for override in overrides:
        if "=" not in override:
            raise ValueError(f"override {override!r} must look like key.path=value")
        dotted_key, raw_value = override.split("=", 1)
        keys = dotted_key.strip().split(".")
        if not all(keys):
            raise ValueError(f"override {override!r} has an empty key segment")
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
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
    return result


def build_dataclass(cls: type[ConfigT], data: dict[str, Any] | None, *, path: str = "") -> ConfigT:
    """Instantiate ``cls`` from a nested mapping, checking keys and types field by field."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path or 'config'} must be a mapping of keys to values, got {data!r}")
    fields = {field.name: field for field in dataclasses.fields(cls) if field.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(f"unknown config key {where}{unknown[0]}; allowed keys here: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, _join(path, name)) for name, value in data.items()}
    missing = sorted(name for name, field in fields.items() if name not in kwargs
                     and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING)
    for name in list(missing):
        if dataclasses.is_dataclass(hints[name]):
            kwargs[name] = build_dataclass(hints[name], {}, path=_join(path, name))  # names the deepest missing key
            missing.remove(name)
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
        raise


def to_plain(config: Any) -> Any:
    """A config dataclass as nested dicts/lists (for logging, checkpoints and YAML dumps)."""
    if dataclasses.is_dataclass(config):
        return {field.name: to_plain(getattr(config, field.name)) for field in dataclasses.fields(config)}
    if isinstance(config, dict):
        return {key: to_plain(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_plain(value) for value in config]
    return config


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


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
