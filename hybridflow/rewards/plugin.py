"""Rule-based rewards as plug-ins: load `module:function`, score batches naming failing samples, combine by weight.

A reward function has the signature `fn(prompt: str, response: str, **extra_fields) -> float`,
where extra_fields are the dataset row's other fields (e.g. `answer`, `tests`): the framework fills the
first two parameters, and passes each row field the function can take (a parameter of that name, or
`**kwargs`). Row fields never collide with the framework's arguments: a function with a `row` parameter
gets the whole row as one dict; otherwise a field named like one of the first two parameters (e.g. a
`response` field) arrives as `row_<name>` (`row_response`) through `**kwargs`. A function may carry a
`preflight` attribute, a callable that raises ValueError when the function cannot run here
(RuleReward calls it when built, before any model is loaded).
Shape legend: B = samples.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

BUILTIN_REWARDS = {
    "math": "hybridflow.rewards.math_answer:math_reward",
    "code": "hybridflow.rewards.code:code_reward",
    "arithmetic": "hybridflow.data.builtin.arithmetic:score",
}
"""Short names accepted wherever a `module:function` spec is."""

_PROMPT_EXCERPT_CHARS = 80
DEFAULT_REWARD_TIMEOUT_S = 300.0
"""How long one batch may take to score before the reward function is reported as hung."""


FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest reward a float32 score tensor holds (a larger one would be stored as inf)."""


class RewardError(ValueError):
    """A reward function failed or returned a bad value on one sample (the message names the sample)."""


def load_reward_function(spec: str) -> Callable[..., float]:
    """The function named by `spec`: "package.module:function", "path/to/file.py:function",
    "module:Class.method", or a built-in short name (math, code, arithmetic)."""
    spec = BUILTIN_REWARDS.get(spec, spec)
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(
            f"reward function spec must look like 'module:function' (or one of {sorted(BUILTIN_REWARDS)}), got {spec!r}"
        )
    target = import_named(spec, f"reward function {spec!r}", module_prefix="hybridflow_user_reward_")
    if not callable(target):
        raise ValueError(f"reward function {spec!r} names a {type(target).__name__}, not a function")
    _refuse_async(target, spec)
    _check_signature(target, spec)
    return target


def _refuse_async(function: Callable, name: str) -> None:
    """An ``async def`` reward would return a coroutine, never a number: refused where it is named."""
    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None)):
        raise ValueError(f"reward function {name!r} is an async def; allowed: a plain def returning a float (the "
                         f"scorer calls it from threads; run an async client with asyncio.run inside it)")


def import_named(spec: str, what: str, *, module_prefix: str) -> Any:
    """The object ``spec`` names, ``package.module:Name`` or ``path/to/file.py:Name`` (``Name`` may be dotted;
    the caller has checked the form). ``what`` begins every error (``"reward function 'f.py:score'"``); a file is
    imported as module ``<module_prefix><stem>``, registered in ``sys.modules`` (dataclasses and pickling look
    modules up by name), with its directory on ``sys.path`` (appended: installed packages win), so modules beside
    it import as they would in ``python file.py``."""
    module_name, attribute_path = spec.split(":")
    try:
        module = (_import_file(Path(module_name), what, module_prefix) if module_name.endswith(".py")
                  else importlib.import_module(module_name))
    except ImportError as error:
        raise ValueError(f"{what}: cannot import module {module_name!r}: {error}") from error
    target = module
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise ValueError(f"{what}: module {module_name!r} has no attribute {attribute_path!r}")
        target = getattr(target, attribute)
    return target


def _import_file(path: Path, what: str, module_prefix: str):
    if not path.is_file():
        raise ValueError(f"{what}: file {str(path)!r} does not exist")
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.append(directory)
    name = f"{module_prefix}{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def _check_signature(function: Callable, spec: str) -> None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    try:
        signature.bind_partial("prompt", "response")
    except TypeError as error:
        raise ValueError(
            f"reward function {spec!r} must accept (prompt, response, **extra_fields); its signature is "
            f"{signature}: {error}"
        ) from None


class _Binding:
    """How one function's signature takes a row: which fields it accepts by name, whether it takes ``**kwargs``
    or a ``row`` dict, which fields it requires, and the names of the two parameters the framework fills."""

    def __init__(self, function: Callable) -> None:
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):  # builtins without a signature: every field as a keyword
            self.inspectable = False
            return
        self.inspectable = True
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        self.framework = {p.name for p in positional if p.kind is p.POSITIONAL_OR_KEYWORD}
        keyword = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p not in positional]
        self.takes_row = any(p.name == "row" for p in keyword)
        self.named = {p.name for p in keyword if p.name != "row"}
        self.required = sorted(p.name for p in keyword if p.name != "row" and p.default is p.empty)
        self.var_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)

    def keywords(self, fields: Mapping) -> dict:
        """The keyword arguments for one row; ``KeyError`` listing required parameters the row lacks."""
        if not self.inspectable:
            return dict(fields)
        keywords = {"row": dict(fields)} if self.takes_row else {}
        for name, value in fields.items():
            if name in self.framework or (name == "row" and self.takes_row):
                if self.var_keyword and not self.takes_row:  # namespaced, never "got multiple values"
                    keywords.setdefault(f"row_{name}", value)
            elif name in self.named or self.var_keyword:
                keywords[name] = value
        missing = [name for name in self.required if name not in keywords]
        if missing:
            raise KeyError(missing)
        return keywords


def _excerpt(prompt: str) -> str:
    text = str(prompt)
    return repr(text if len(text) <= _PROMPT_EXCERPT_CHARS else text[:_PROMPT_EXCERPT_CHARS] + "...")


class RuleReward:
    """One reward function, called per sample with its output checked to be a finite number.

    A batch that is not scored within `timeout_s` raises RewardError naming the function and the
    samples it was still working on; the stuck calls are abandoned on daemon threads (Python
    cannot stop a thread), so they never block the trainer's exit.
    """

    def __init__(self, function: str | Callable[..., float], *, num_workers: int = 1,
                 timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0 seconds (or None for no limit), got {timeout_s}")
        if isinstance(function, str):
            self.name = function
            self.function = load_reward_function(function)
        else:
            self.name = f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"
            _refuse_async(function, self.name)
            self.function = function
        self.binding = _Binding(self.function)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        preflight = getattr(self.function, "preflight", None)
        if preflight is not None:  # e.g. the code reward checks that its sandbox can run here
            try:
                preflight()
            except ValueError as error:
                raise ValueError(f"reward function {self.name!r} cannot run here: {error}") from None

    def score_one(self, index: int, prompt: str, response: str, extra_fields: Mapping | None) -> float:
        """The reward of one sample; RewardError naming the sample when the function fails."""
        fields = dict(extra_fields or {})
        try:
            keywords = self.binding.keywords(fields)
        except KeyError as error:
            raise RewardError(
                f"reward function {self.name!r} requires the row field(s) {error.args[0]} but sample {index}'s row "
                f"has {sorted(fields)} (prompt {_excerpt(prompt)}); allowed: give those parameters a default, take "
                f"**extra_fields or a `row` parameter, or add the fields to the dataset"
            ) from None
        try:
            value = self.function(prompt, response, **keywords)
        except Exception as error:
            raise RewardError(
                f"reward function {self.name!r} raised {type(error).__name__} on sample {index} "
                f"(prompt {_excerpt(prompt)}): {error}"
            ) from error
        except KeyboardInterrupt:
            if threading.current_thread() is threading.main_thread():
                raise  # Ctrl-C while this sample scored: the run stops as for any SIGINT
            raise RewardError(
                f"reward function {self.name!r} raised KeyboardInterrupt on sample {index} (prompt "
                f"{_excerpt(prompt)}) in a scoring thread, where no Ctrl-C arrives; a reward function must return a "
                f"float") from None
        except SystemExit as error:
            raise RewardError(
                f"reward function {self.name!r} called sys.exit({error.code!r}) on sample {index} "
                f"(prompt {_excerpt(prompt)}); a reward function must return a float"
            ) from None
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, str) or not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward function {self.name!r} returned a {type(value).__name__} ({value!r:.80}) on sample {index} "
                f"(prompt {_excerpt(prompt)}); it must return a float"
            )
        if not math.isfinite(float(value)) or abs(float(value)) > FLOAT32_MAX:
            raise RewardError(
                f"reward function {self.name!r} returned {float(value)} on sample {index} "
                f"(prompt {_excerpt(prompt)}); rewards must be finite in float32 (|r| <= {FLOAT32_MAX:.4g}: the "
                f"scores are float32 tensors)"
            )
        return float(value)

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], extra_fields: Sequence[Mapping] | None = None
    ) -> Tensor:
        """Rewards of a batch -> scores_B (float32), computed on `num_workers` threads within `timeout_s`."""
        if len(prompts) != len(responses) or (extra_fields is not None and len(extra_fields) != len(prompts)):
            raise ValueError(
                f"prompts ({len(prompts)}), responses ({len(responses)}) and extra_fields "
                f"({'none' if extra_fields is None else len(extra_fields)}) must have one entry per sample"
            )
        extras = extra_fields if extra_fields is not None else [None] * len(prompts)
        return torch.tensor(_BatchScoring(self, prompts, responses, extras).run(), dtype=torch.float32)


class _BatchScoring:
    """One batch scored on daemon threads, sample by sample, with a deadline for the whole batch."""

    def __init__(self, reward: RuleReward, prompts, responses, extras) -> None:
        self.reward = reward
        self.samples = list(zip(prompts, responses, extras))
        self.values: list[float | None] = [None] * len(self.samples)
        self.in_flight: set[int] = set()
        self.next_index = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.finished_threads = 0

    def run(self) -> list[float]:
        if not self.samples:
            return []
        num_threads = min(self.reward.num_workers, len(self.samples))
        for _ in range(num_threads):
            threading.Thread(target=self._work, args=(num_threads,), daemon=True,
                             name=f"reward:{self.reward.name}").start()
        started = time.monotonic()
        if not self.done.wait(self.reward.timeout_s):
            with self.lock:
                stuck = sorted(self.in_flight)
                self.error = self.error or RuntimeError("timed out")  # tells the threads to stop taking samples
            raise RewardError(
                f"reward function {self.reward.name!r} did not finish a batch of {len(self.samples)} samples within "
                f"{self.reward.timeout_s:g} s (waited {time.monotonic() - started:.0f} s); still running on "
                + ", ".join(f"sample {index} (prompt {_excerpt(self.samples[index][0])})" for index in stuck[:3])
                + (f" and {len(stuck) - 3} more" if len(stuck) > 3 else "")
                + "; raise the reward timeout or fix the function"
            )
        if self.error is not None:
            raise self.error
        return self.values

    def _work(self, num_threads: int) -> None:
        while True:
            with self.lock:
                if self.error is not None or self.next_index >= len(self.samples):
                    break
                index = self.next_index
                self.next_index += 1
                self.in_flight.add(index)
            try:
                value = self.reward.score_one(index, *self.samples[index])
            except BaseException as error:  # noqa: BLE001 - every failure, SystemExit included, is reported
                with self.lock:
                    self.error = self.error or error
                self.done.set()  # fail the batch now, even if another thread is stuck
                break
            with self.lock:
                self.values[index] = value
                self.in_flight.discard(index)
        with self.lock:
            self.finished_threads += 1
            if self.finished_threads == num_threads:
                self.done.set()


def combine_scores(scores: Mapping[str, Tensor], weights: Mapping[str, float]) -> Tensor:
    """Weighted sum of named per-sample scores (rule functions, reward model, ...) -> scores_B.

    Every name in `weights` must have scores and vice versa, so a misspelt source cannot be
    silently dropped.
    """
    if set(scores) != set(weights) or not scores:
        raise ValueError(
            f"scores {sorted(scores)} and weights {sorted(weights)} must name the same non-empty set of sources"
        )
    shapes = {name: tuple(value.shape) for name, value in scores.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"every source needs one score per sample (shape [B]); got {shapes}")
    total_B = None
    for name, value in scores.items():
        weighted_B = weights[name] * value.float()
        total_B = weighted_B if total_B is None else total_B + weighted_B
    return total_B


class RewardMix:
    """Several rule-based reward functions with weights; `score_batch` returns each source and their weighted sum."""

    def __init__(self, weights: Mapping[str, float], *, num_workers: int = 1,
                 timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S) -> None:
        if not weights:
            raise ValueError("RewardMix needs at least one reward function spec with a weight")
        self.weights = dict(weights)
        self.rewards = {spec: RuleReward(spec, num_workers=num_workers, timeout_s=timeout_s) for spec in self.weights}

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], extra_fields: Sequence[Mapping] | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(weighted total scores_B, {spec: unweighted scores_B}) for logging each source."""
        per_source = {
            spec: reward.score_batch(prompts, responses, extra_fields) for spec, reward in self.rewards.items()
        }
        return combine_scores(per_source, self.weights), per_source
