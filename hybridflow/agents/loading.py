"""Loading an environment class named in the config, refusing a bad definition early, and calling it safely.

``load_environment`` runs before any model is built: a class that is not an Environment, lacks ``start``
or ``step`` or takes the wrong arguments is a ValueError naming the class and the method;
``check_environment`` builds one instance and starts it on a data row, refusing a constructor that fails
or a ``start`` that returns the wrong type. At run time ``checked_start`` / ``checked_step`` /
``checked_close`` turn an exception raised by the environment, and a result of the wrong type (an
EnvironmentDefinitionError naming the class, the method, what was returned and what is allowed), into an
``EnvironmentFailure`` value: the episode ends, marked failed, and the run goes on. Torch-free.
"""

from __future__ import annotations

import inspect
import math
import numbers
import traceback
from collections.abc import Callable
from typing import Any

from hybridflow.agents.env import (
    OBSERVATION_ROLES,
    AssistantTurn,
    Environment,
    EnvironmentFailure,
    EpisodeStart,
    TurnResult,
)
from hybridflow.agents.tools import Tool

_MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class EnvironmentDefinitionError(ValueError):
    """An environment class is unusable as written (the message names the class and the method)."""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_spec(spec: str) -> Any:
    """The object named by ``file.py:Name`` or ``package.module:Name`` (``Name`` may be dotted)."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"env.class must look like 'path/to/file.py:Class' or 'package.module:Class', "
                         f"got {spec!r}")
    from hybridflow.rewards.plugin import import_named  # the reward functions' loader (it imports torch)

    return import_named(spec, f"env.class {spec!r}", module_prefix="hybridflow_user_env_")


def load_environment(spec: str | type, kwargs: dict | None = None) -> type[Environment]:
    """The Environment subclass named by ``spec`` (or given), checked: ValueError naming class and method."""
    cls = _import_spec(spec) if isinstance(spec, str) else spec
    if not inspect.isclass(cls):
        raise EnvironmentDefinitionError(f"env.class {spec!r} names a {type(cls).__name__}, not a class")
    name = _qualified(cls)
    if not issubclass(cls, Environment):
        raise EnvironmentDefinitionError(f"{name} is not a subclass of hybridflow.agents.Environment; allowed: "
                                         "a class deriving from Environment (or ToolEnvironment)")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise EnvironmentDefinitionError(f"{name} does not define {', '.join(f'{m}()' for m in missing)}; an "
                                         "Environment must define start(self, row) and step(self, turn)")
    for method, arguments in (("start", ({},)), ("step", (None,)), ("close", ())):
        _check_method(cls, name, method, arguments)
    _check_max_turns(cls.max_turns, name)
    try:
        inspect.signature(cls).bind(**(kwargs or {}))
    except TypeError as error:
        raise EnvironmentDefinitionError(f"{name}.__init__ cannot take env.kwargs {sorted(kwargs or {})}: "
                                         f"{error}; its signature is {inspect.signature(cls)}") from None
    except ValueError:
        pass  # a constructor without a readable signature: trust it
    return cls


def _check_method(cls: type, name: str, method: str, arguments: tuple) -> None:
    function = getattr(cls, method)
    if not callable(function):
        raise EnvironmentDefinitionError(f"{name}.{method} is a {type(function).__name__}, not a method")
    if inspect.iscoroutinefunction(function):
        raise EnvironmentDefinitionError(f"{name}.{method} is async; allowed: a plain method (the episode runner "
                                         "calls environments from its own threads)")
    try:
        inspect.signature(function).bind(None, *arguments)
    except TypeError:
        expected = {"start": "start(self, row)", "step": "step(self, turn)", "close": "close(self)"}[method]
        raise EnvironmentDefinitionError(f"{name}.{method} has the signature {method}{inspect.signature(function)}; "
                                         f"allowed: {expected}") from None


def _check_max_turns(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EnvironmentDefinitionError(f"{name}.max_turns is {value!r}; allowed: an integer >= 1")


def make_environment(cls: type[Environment], kwargs: dict | None = None, *,
                     max_turns: int | None = None) -> Environment | EnvironmentFailure:
    """One instance for one episode (``max_turns`` from the config overrides the class's), or the failure."""
    try:
        environment = cls(**(kwargs or {}))
    except Exception as error:  # noqa: BLE001 - a constructor that raises fails its episode only
        return _failure(environment_class=cls, method="__init__", error=error)
    if max_turns is not None:
        environment.max_turns = max_turns
    return environment


def check_environment(cls: type[Environment], kwargs: dict | None = None, row: dict | None = None) -> None:
    """Preflight (before any model is built): construct one instance and, given a row, start and close it.

    Raises ValueError naming the class and method when that fails (e.g. a sandbox the environment's tools
    need is not installed) or when ``start`` returns something other than an EpisodeStart.
    """
    environment = make_environment(cls, kwargs)
    if isinstance(environment, EnvironmentFailure):
        raise EnvironmentDefinitionError(f"cannot build the environment: {environment.describe()}")
    try:
        if row is not None:
            started = checked_start(environment, row)
            if isinstance(started, EnvironmentFailure):
                raise EnvironmentDefinitionError(f"the environment fails on the first data row: {started.describe()}")
    finally:
        checked_close(environment)


def _failure(*, environment_class: type, method: str, error: BaseException) -> EnvironmentFailure:
    return EnvironmentFailure(class_name=_qualified(environment_class), method=method,
                              error_type=type(error).__name__, message=str(error)[:2000],
                              traceback="".join(traceback.format_exception(error))[-8000:])


def _guarded(environment: Environment, method: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - an environment that raises fails its episode, not the run
        return _failure(environment_class=type(environment), method=method, error=error)


def checked_start(environment: Environment, row: dict) -> EpisodeStart | EnvironmentFailure:
    """``environment.start(row)`` with its result checked, or the EnvironmentFailure of what went wrong."""
    where = f"{_qualified(type(environment))}.start"
    return _guarded(environment, "start", lambda: _checked_episode_start(environment.start(row), where))


def checked_step(environment: Environment, turn: AssistantTurn) -> TurnResult | EnvironmentFailure:
    """``environment.step(turn)`` with its result checked, or the EnvironmentFailure of what went wrong."""
    where = f"{_qualified(type(environment))}.step"
    return _guarded(environment, "step", lambda: _checked_turn_result(environment.step(turn), where))


def _checked_episode_start(result: Any, where: str) -> EpisodeStart:
    if not isinstance(result, EpisodeStart):
        raise _bad_return(where, result, "an EpisodeStart(messages=[...], tools=[...])")
    if not isinstance(result.messages, list) or not result.messages:
        raise _bad_return(where, result.messages, "EpisodeStart.messages as a non-empty list of message dicts",
                          what="messages")
    for index, message in enumerate(result.messages):
        _check_message(message, where, f"messages[{index}]", _MESSAGE_ROLES)
    if not isinstance(result.tools, list) or not all(isinstance(item, Tool) for item in result.tools):
        raise _bad_return(where, result.tools, "EpisodeStart.tools as a list of Tool (wrap functions with "
                          "hybridflow.agents.tool)", what="tools")
    names = [item.name for item in result.tools]
    if len(set(names)) != len(names):
        raise _bad_return(where, names, "tools with distinct names", what="tools")
    return result


def _checked_turn_result(result: Any, where: str) -> TurnResult:
    if not isinstance(result, TurnResult):
        raise _bad_return(where, result, "a TurnResult(messages=[...], reward=None|float, done=bool, info={})")
    if not isinstance(result.messages, list):
        raise _bad_return(where, result.messages, "TurnResult.messages as a list of message dicts", what="messages")
    for index, message in enumerate(result.messages):
        _check_message(message, where, f"messages[{index}]", OBSERVATION_ROLES)
    reward = result.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(float(reward))):
        raise _bad_return(where, reward, "TurnResult.reward as None or a finite number", what="reward")
    if not isinstance(result.done, bool):
        raise _bad_return(where, result.done, "TurnResult.done as True or False", what="done")
    if not isinstance(result.info, dict):
        raise _bad_return(where, result.info, "TurnResult.info as a dict", what="info")
    return result


def checked_close(environment: Environment) -> EnvironmentFailure | None:
    """``environment.close()``; an exception it raises comes back as EnvironmentFailure (else None)."""
    result = _guarded(environment, "close", environment.close)
    return result if isinstance(result, EnvironmentFailure) else None


def _check_message(message: Any, where: str, what: str, roles: tuple[str, ...]) -> None:
    if not isinstance(message, dict) or message.get("role") not in roles or not isinstance(message.get("content"),
                                                                                           str):
        raise _bad_return(where, message, f"a message dict with a role in {roles} and a str content", what=what)


def _bad_return(where: str, value: Any, allowed: str, *, what: str = "") -> EnvironmentDefinitionError:
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    part = f" {what}" if what else ""
    return EnvironmentDefinitionError(f"{where} returned{part} {shown} ({type(value).__name__}); allowed: {allowed}")
