"""Checks of the files a run needs, made before the tokenizer, the datasets or any model is built.

``preflight(config)`` reads only small things: each data file's rows, each model directory's
``config.json``, tokenizer file names and safetensors headers, and the reward function's module. A
missing or broken file is then a ``ValueError`` naming the config key and the file within about the
time of loading the config, not after every worker group has built its model.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from hybridflow.data.files import read_rows
from hybridflow.models.config import ModelConfig
from hybridflow.trainers.config.rl import RLConfig

# A Hugging Face tokenizer directory holds at least one of these (fast, SentencePiece or BPE/WordPiece vocabularies).
# Roles whose tokenizer is loaded (the others read the actor's token ids).
TOKENIZER_ROLES = ("actor", "reward", "cost")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def preflight(config: RLConfig) -> None:
    """Raise ValueError naming the key and the file for the first unusable data file, model directory
    or reward function of ``config``, and for a generation longer than the actor's positions."""
    data = config.data
    for key in ("train_path", "val_path"):
        if getattr(data, key) is not None:
            _check_prompt_file(f"data.{key}", getattr(data, key), data.prompt_key)
    if config.actor.loss.ptx_coef > 0 and data.ptx_path is not None:
        read_rows(data.ptx_path)
    for role, key, model in _model_sections(config):
        check_model(key, model, needs_tokenizer=role in TOKENIZER_ROLES)
    if config.reward.function is not None:
        from hybridflow.rewards.plugin import load_reward_function

        try:
            load_reward_function(config.reward.function)
        except ValueError as error:
            raise ValueError(f"config key reward.function: {error}") from None
    _warn(inert_options(config))
    limit = max_positions(config.actor.model)
    max_new_tokens = config.actor.generation.max_new_tokens
    if limit is not None and max_new_tokens >= limit:
        raise ValueError(f"config key actor.generation.max_new_tokens got {max_new_tokens}; allowed: an integer "
                         f"below the actor model's max_position_embeddings = {limit} (the prompt needs positions too)")


def check_sequence_length(config: RLConfig, longest_prompt: int) -> None:
    """Raise unless the longest kept prompt plus ``max_new_tokens`` fits the actor's positions."""
    limit = max_positions(config.actor.model)
    max_new_tokens = config.actor.generation.max_new_tokens
    if limit is not None and longest_prompt + max_new_tokens > limit:
        raise ValueError(
            f"config key actor.generation.max_new_tokens got {max_new_tokens}; allowed: at most "
            f"{limit - longest_prompt}: the longest prompt kept has {longest_prompt} tokens (data.max_prompt_tokens="
            f"{config.data.max_prompt_tokens}) and the actor model's max_position_embeddings is {limit}; lower "
            f"max_new_tokens or data.max_prompt_tokens")


def max_positions(model: ModelConfig) -> int | None:
    """The model's ``max_position_embeddings`` (None when its config does not say)."""
    if model.path is not None:
        value = json.loads((Path(model.path) / "config.json").read_text()).get("max_position_embeddings")
    elif model.builtin is not None:
        from hybridflow.data.builtin import builtin_model_config

        value = builtin_model_config().max_position_embeddings
    else:
        from hybridflow.models.tiny import tiny_config

        value = getattr(tiny_config(model.family or "llama", **model.tiny), "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def _model_sections(config: RLConfig) -> list[tuple[str, str, ModelConfig]]:
    """(role, config key, model section) of every active role with a model of its own."""
    sections = [("actor", "actor.model", config.actor.model)]
    for role in config.active_roles:
        model = config.section_of(role).model
        if role != "actor" and model is not None:
            sections.append((role, f"{config.section_key(role)}.model", model))
    return sections


def _check_prompt_file(key: str, path: str, prompt_key: str) -> None:
    try:
        rows = read_rows(path)
    except ValueError as error:
        raise ValueError(f"config key {key}: {error}") from None
    for index, row in enumerate(rows):
        if row.get(prompt_key) is None and row.get("messages") is None:
            raise ValueError(f"config key {key}: row {index} of {path!r} has neither the prompt field "
                             f"{prompt_key!r} (data.prompt_key) nor 'messages'; fields present: {sorted(row)}")


def check_model(key: str, model: ModelConfig, *, needs_tokenizer: bool) -> None:
    """Raise ValueError naming ``key`` unless a ``path`` model directory holds config.json, sound safetensors
    headers and (``needs_tokenizer``) tokenizer files."""
    if model.path is not None:
        directory = Path(model.path)
        if not directory.is_dir():
            raise ValueError(f"config key {key}.path: model directory {model.path!r} does not exist (a local Hugging "
                             f"Face directory is expected; nothing is downloaded)")
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise ValueError(f"config key {key}.path: model directory {model.path!r} has no config.json")
        try:
            json.loads(config_file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"config key {key}.path: {str(config_file)!r} is not valid JSON: {error}") from None
        for weights in sorted(directory.glob("*.safetensors")):
            _check_safetensors_header(key, weights)
    tokenizer_dir = model.tokenizer_path if model.tokenizer_path is not None else model.path
    if needs_tokenizer and tokenizer_dir is not None:
        tokenizer_key = f"{key}.tokenizer_path" if model.tokenizer_path is not None else f"{key}.path"
        directory = Path(tokenizer_dir)
        if not directory.is_dir():
            raise ValueError(f"config key {tokenizer_key}: tokenizer directory {tokenizer_dir!r} does not exist")
        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"config key {tokenizer_key}: directory {tokenizer_dir!r} has no tokenizer files (one "
                             f"of {', '.join(TOKENIZER_FILES)}); copy the tokenizer there or set "
                             f"{key}.tokenizer_path")


def _check_safetensors_header(key: str, path: Path) -> None:
    """A safetensors file starts with an 8-byte little-endian header length and that many bytes of JSON."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        problem = None
        if length is None or length > size - 8:
            problem = f"its header length does not fit the file's {size} bytes (truncated or not safetensors)"
        else:
            try:
                header = json.loads(handle.read(length))
            except (ValueError, UnicodeDecodeError) as error:
                header, problem = None, f"its header is not valid JSON ({error})"
            if header is not None:
                problem = _safetensors_data_problem(header, size - 8 - length)
    if problem is not None:
        raise ValueError(f"config key {key}.path: weights file {str(path)!r} is corrupt: {problem}; re-copy or "
                         f"re-export the model")


def _safetensors_data_problem(header: object, data_bytes: int) -> str | None:
    """Why the tensors a safetensors header lists do not exactly cover the bytes after it (None when they do)."""
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [entry.get("data_offsets", [0, 0])[1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict)]
    needed = max(ends, default=0)
    if needed != data_bytes:
        return (f"its header lists {needed} bytes of tensors but {data_bytes} follow it "
                f"({'truncated' if needed > data_bytes else 'trailing bytes'})")
    return None


def inert_options(config: RLConfig) -> list[str]:
    """Options the user set that the rest of the config makes do nothing, each naming both keys."""
    found = []
    if config.reference.model is not None and "reference" not in config.active_roles:
        found.append("reference.model is set but algorithm.kl_mode is 'none': no reference model is built")
    if config.data.ptx_path is not None and config.actor.loss.ptx_coef <= 0:
        found.append(f"data.ptx_path is set but actor.loss.ptx_coef is {config.actor.loss.ptx_coef}: the ptx rows "
                     f"are never read (set ptx_coef > 0 to train on them)")
    if config.trainer.keep_last and not config.trainer.save_every:
        found.append(f"trainer.keep_last is {config.trainer.keep_last} but trainer.save_every is 0: no checkpoint "
                     f"is saved")
    if config.trainer.save_on_signal and not config.trainer.resume:
        found.append("trainer.save_on_signal is set but trainer.resume is false: the next run will not resume "
                     "from the checkpoint a signal saves")
    return found


def _warn(lines: list[str]) -> list[str]:
    for line in lines:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    return lines


def warn_local_pools(config: RLConfig) -> list[str]:
    """``--local`` runs every worker in one process: warn for each pool asking for more than one device."""
    return _warn([f"placement.pools.{name} asks for {sum(counts)} devices but --local runs every worker in this "
                  f"one process (world size 1)" for name, counts in config.placement.pools.items() if sum(counts) > 1])
