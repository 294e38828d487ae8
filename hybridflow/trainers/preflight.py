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
from hybridflow.models.checkpoint_check import has_score_head, tokenizer_size, weights_vs_config
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
    for key, model, lora, head in _lora_sections(config):
        check_lora_targets(key, model, lora, head=head)
    _check_scoring_models(config)
    _check_token_ids(config)
    if config.reward.function is not None:
        check_reward_function("reward.function", config.reward.function)
    _warn(inert_options(config))
    limit = max_positions(config.actor.model)
    if config.env is not None:
        _check_env(config, limit)
    max_new_tokens = config.actor.generation.max_new_tokens
    if limit is not None and max_new_tokens >= limit:
        raise ValueError(f"config key actor.generation.max_new_tokens got {max_new_tokens}; allowed: an integer "
                         f"below the actor model's max_position_embeddings = {limit} (the prompt needs positions too)")


def _check_env(config: RLConfig, limit: int | None) -> None:
    """The environment class loads and is well defined (ValueError naming the class and method), and an episode's
    token budget fits the actor's positions."""
    from hybridflow.agents.loading import load_environment

    env = config.env
    load_environment(env.class_path, dict(env.kwargs))
    if limit is not None and env.max_episode_tokens is not None and env.max_episode_tokens > limit:
        raise ValueError(f"config key env.max_episode_tokens got {env.max_episode_tokens}; allowed: at most the actor "
                         f"model's max_position_embeddings = {limit}")


def check_sequence_length(config: RLConfig, longest_prompt: int) -> None:
    """Raise unless the longest kept prompt plus ``max_new_tokens`` fits the actor's positions."""
    limit = max_positions(config.actor.model)
    max_new_tokens = config.actor.generation.max_new_tokens
    if limit is not None and longest_prompt >= limit:  # no max_new_tokens can fit: the prompts must be shorter
        raise ValueError(
            f"config key data.max_prompt_tokens got {config.data.max_prompt_tokens}; allowed: at most "
            f"{limit - max_new_tokens}: the longest prompt kept has {longest_prompt} tokens, which alone fill the "
            f"actor model's max_position_embeddings = {limit}; with actor.generation.max_new_tokens={max_new_tokens}, "
            f"data.max_prompt_tokens={limit - max_new_tokens} drops the prompts that cannot fit")
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


def _lora_sections(config: RLConfig) -> list[tuple[str, ModelConfig, object, str]]:
    """(config key of the lora section, the model it adapts, the LoraConfig, head) of every active LoRA role."""
    sections = []
    for role in ("actor", "critic", "cost_critic"):
        if role in config.active_roles and config.section_of(role).lora is not None:
            section = config.section_of(role)
            sections.append((f"{config.section_key(role)}.lora", section.model or config.actor.model, section.lora,
                             "lm" if role == "actor" else "value"))
    return sections


def check_lora_targets(key: str, model: ModelConfig, lora, *, head: str = "lm") -> None:
    """Raise ValueError naming ``key`` when a ``lora.target_modules`` entry matches no linear layer of the model's
    decoder layers (the architecture is built on the meta device: no weights are read)."""
    from hybridflow.models.loader import build_model
    from hybridflow.models.lora import target_names
    from hybridflow.trainers.build import model_config_of

    target_names(build_model(model_config_of(model), head=head, device="meta"), lora, key=key)


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
        if directory.is_file():
            raise ValueError(f"config key {key}.path: {model.path!r} is a file, not a model directory; give the "
                             f"directory holding it ({str(directory.parent)!r})")
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
        _check_shard_files(key, directory)
        problem = weights_vs_config(directory)
        if problem is not None:
            raise ValueError(f"config key {key}.path: model directory {model.path!r}: {problem}; re-export the "
                             f"model or fix its config.json")
    tokenizer_dir = model.tokenizer_path if model.tokenizer_path is not None else model.path
    if needs_tokenizer and tokenizer_dir is not None:
        tokenizer_key = f"{key}.tokenizer_path" if model.tokenizer_path is not None else f"{key}.path"
        directory = Path(tokenizer_dir)
        if directory.is_file():
            raise ValueError(f"config key {tokenizer_key}: {tokenizer_dir!r} is a file, not a tokenizer directory; "
                             f"give the directory holding it ({str(directory.parent)!r})")
        if not directory.is_dir():
            raise ValueError(f"config key {tokenizer_key}: tokenizer directory {tokenizer_dir!r} does not exist")
        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"config key {tokenizer_key}: directory {tokenizer_dir!r} has no tokenizer files (one "
                             f"of {', '.join(TOKENIZER_FILES)}); copy the tokenizer there or set "
                             f"{key}.tokenizer_path")
        _check_vocabulary(key, tokenizer_key, model)


def model_vocab_size(model: ModelConfig) -> int | None:
    """``vocab_size`` of a ``path`` model's config.json (None for built-in and tiny models, or when unset)."""
    if model.path is None:
        return None
    value = json.loads((Path(model.path) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    return value if isinstance(value, int) else None


def _check_vocabulary(key: str, tokenizer_key: str, model: ModelConfig) -> None:
    """A tokenizer with ids beyond the model's embedding would fail mid-generation with an IndexError."""
    vocab_size = model_vocab_size(model)
    tokens = tokenizer_size(model.tokenizer_path if model.tokenizer_path is not None else model.path)
    if vocab_size is not None and tokens is not None and tokens > vocab_size:
        raise ValueError(f"config key {tokenizer_key}: the tokenizer has token ids up to {tokens - 1} but the model "
                         f"in {key}.path has vocab_size={vocab_size} (config.json): ids >= {vocab_size} have no "
                         f"embedding; use the model's own tokenizer")


def _check_shard_files(key: str, directory: Path) -> None:
    """Every shard that ``model.safetensors.index.json`` maps a tensor to must be in the directory (a missing one
    would otherwise surface as tensors "lacking" from a correct checkpoint)."""
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
    except (ValueError, UnicodeDecodeError, AttributeError) as error:
        raise ValueError(f"config key {key}.path: {str(index)!r} is not a valid index ({error})") from None
    missing = sorted({name for name in weight_map.values() if not (directory / name).is_file()})
    if missing:
        raise ValueError(f"config key {key}.path: {str(index)!r} names shard files that are not in the directory: "
                         f"{', '.join(missing)}; copy every shard of the model")


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


def check_reward_function(key: str, spec: str) -> None:
    """Load the reward function ``spec``; a module that ends the process while it is imported (``sys.exit``,
    ``os._exit``) is reported naming the key instead of ending the run without a word."""
    import os

    from hybridflow.rewards.plugin import load_reward_function

    real_exit = os._exit

    def refuse_exit(code: int = 0) -> None:
        raise SystemExit(f"os._exit({code})")

    os._exit = refuse_exit  # only while the user's module is imported here, in the driver
    try:
        load_reward_function(spec)
    except ValueError as error:
        raise ValueError(f"config key {key}: {error}") from None
    except Exception as error:  # a syntax error or an exception while the module runs
        raise ValueError(f"config key {key}: reward function {spec!r}: importing it raised "
                         f"{type(error).__name__}: {' '.join(str(error).split())}") from None
    except SystemExit as error:
        call = error.code if isinstance(error.code, str) and error.code.startswith("os._exit") \
            else f"sys.exit({error.code!r})"
        raise ValueError(f"config key {key}: reward function {spec!r}: its module called {call} while being "
                         f"imported; a reward module must not end the process") from None
    finally:
        os._exit = real_exit


def _check_scoring_models(config: RLConfig) -> None:
    """A reward or cost model given as a plain causal LM would score with a randomly initialised head."""
    for section, key in ((config.reward, "reward"), (config.cost, "cost")):
        if section is None or section.model is None or section.model.path is None:
            continue
        if getattr(section, "model_type", "score_head") != "score_head":
            continue
        if not has_score_head(section.model.path):
            architectures = json.loads((Path(section.model.path) / "config.json").read_text()).get("architectures")
            raise ValueError(f"config key {key}.model.path: {section.model.path!r} has no trained score head (no "
                             f"'score.*' tensor; architectures {architectures}): its scores would come from a random "
                             f"head; give a model trained by `hybridflow rm`"
                             + (", or reward.model_type=likelihood" if key == "reward" else ""))


def _check_token_ids(config: RLConfig) -> None:
    """Suppressed and stop token ids must exist in the actor's vocabulary."""
    vocab_size = model_vocab_size(config.actor.model)
    if vocab_size is None:
        return
    generation = config.actor.generation
    for name in ("suppress_tokens", "stop_token_ids"):
        beyond = [token for token in getattr(generation, name, ()) or () if token >= vocab_size]
        if beyond:
            raise ValueError(f"config key actor.generation.{name} got {beyond}; allowed: token ids below the actor "
                             f"model's vocab_size = {vocab_size}")
