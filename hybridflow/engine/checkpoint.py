"""Checkpoints of a TrainingEngine (torch.distributed.checkpoint, any layout) and Hugging Face export.

Checkpoints are keyed by Hugging Face parameter names (global layer indices), so a checkpoint saved
under one layout loads under another: DCP reads each rank's slices of the saved tensors. Both
writers are atomic: they write ``<dir>.tmp`` and rename it over ``<dir>`` only when complete, so a
crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from hybridflow.models.families import causal_lm_class_name

if TYPE_CHECKING:
    from hybridflow.engine.training import TrainingEngine

ENGINE_FILE = "engine.json"


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when torch.distributed is off; that is intended here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _layout_record(engine: "TrainingEngine") -> dict:
    layout = engine.layout
    return {"layout": engine.config.layout, "pp_size": layout.pp_size, "tp_size": layout.tp_size,
            "dp_size": layout.dp_size, "head": engine.head, "lora": engine.lora is not None}


def _begin_atomic(directory: str) -> str:
    tmp = directory.rstrip("/") + ".tmp"
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    return tmp


def _commit_atomic(tmp: str, directory: str) -> None:
    _barrier()
    if _is_rank0():
        old = directory.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(directory):
            os.rename(directory, old)
        os.rename(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


EMBEDDING, OUTPUT_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _state(engine: "TrainingEngine") -> tuple[dict, dict]:
    """(DCP state keyed by HF names, optimizer template); a tied embedding appears once, as EMBEDDING."""
    # get_optimizer_state_dict creates the (zero) optimizer state if no step ran yet, so the same
    # keys exist before loading as after saving; an inference-only engine has no optimizer
    optim_state = (get_optimizer_state_dict(engine.model, engine.optimizer) if engine.optimizer is not None
                   else {"state": {}, "param_groups": []})
    # a LoRA run keeps only what it trains (the adapters, a new value/score head): the base is the model's source
    model_state = get_model_state_dict(engine.model,
                                       options=StateDictOptions(ignore_frozen_params=engine.lora is not None))
    optim_tensors = dict(optim_state["state"])
    if engine.ties_embeddings:
        # pp=1 holds both names for one tensor; the last stage under pp>1 holds only the head's copy
        head = model_state.pop(OUTPUT_HEAD, None)
        if EMBEDDING not in model_state and head is not None:
            model_state[EMBEDDING] = head
            if OUTPUT_HEAD in optim_tensors:
                optim_tensors[EMBEDDING] = optim_tensors.pop(OUTPUT_HEAD)
    return {"model": model_state, "optim": optim_tensors}, optim_state


def _local_names(engine: "TrainingEngine", state: dict) -> dict:
    """Undo the tied-embedding renaming of ``_state`` for a stage that holds only the output head."""
    names = {name for name, _ in engine.model.named_parameters()}
    if engine.ties_embeddings and EMBEDDING not in names and EMBEDDING in state:
        state = dict(state)
        state[OUTPUT_HEAD] = state.pop(EMBEDDING)
    return state


def save_checkpoint(engine: "TrainingEngine", directory: str) -> None:
    """Write model + optimizer state (DCP) and engine.json (step, layout, the resolved auto token budget) to
    ``directory``."""
    tmp = _begin_atomic(directory)
    state, _ = _state(engine)
    try:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    except CheckpointException as error:  # a BaseException: `except Exception` handlers would never see it
        cause = _with_full_disk_named(first_checkpoint_failure(error), tmp)  # before the cleanup frees space
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise cause from None
    if _is_rank0():
        with open(os.path.join(tmp, ENGINE_FILE), "w") as handle:
            json.dump({"step": engine.step, **_layout_record(engine),
                       "token_budget": engine.resolved_auto_token_budget}, handle, indent=2)
    _commit_atomic(tmp, directory)


def first_checkpoint_failure(error: CheckpointException) -> BaseException:
    """The exception of the lowest failing rank inside DCP's ``CheckpointException`` (an ``OSError`` such as
    ENOSPC keeps its class and errno, so callers can say what happened); an interrupt (Ctrl-C, a signal) that
    arrived mid-save before anything else, as it is; a RuntimeError when it holds none."""
    for rank in sorted(error.failures):
        if isinstance(error.failures[rank][0], KeyboardInterrupt):
            return error.failures[rank][0]
    for rank in sorted(error.failures):
        cause = error.failures[rank][0]
        if isinstance(cause, Exception):
            return cause
    return RuntimeError(f"distributed checkpoint failed on ranks {sorted(error.failures)}")


# torch's file writer reports a full disk as "unexpected pos N vs M" without an errno; with less free space than
# this left where it wrote, the failure is named as what it is
FULL_BELOW_BYTES = 1 << 20


def _with_full_disk_named(cause: BaseException, directory: str) -> BaseException:
    """``cause``, or an ENOSPC ``OSError`` carrying its text when it has no errno and ``directory``'s file system is
    (almost) full."""
    if not isinstance(cause, Exception) or (isinstance(cause, OSError) and cause.errno is not None):
        return cause
    try:
        full = shutil.disk_usage(directory).free < FULL_BELOW_BYTES
    except OSError:
        full = False
    if not full:
        return cause
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({type(cause).__name__}: "
                                 f"{' '.join(str(cause).split())})", directory)


def load_checkpoint(engine: "TrainingEngine", directory: str) -> None:
    """Restore model, optimizer and step from ``directory``, resharding to this engine's layout."""
    record_path = os.path.join(directory, ENGINE_FILE)
    if not os.path.isfile(record_path):
        raise ValueError(f"checkpoint directory {directory!r} has no {ENGINE_FILE}; expected a directory "
                         f"written by TrainingEngine.save_checkpoint")
    with open(record_path) as handle:
        record = json.load(handle)
    if record["head"] != engine.head:
        raise ValueError(f"checkpoint {directory!r} holds a head={record['head']!r} model; this engine has "
                         f"head={engine.head!r}")
    if record.get("lora", False) != (engine.lora is not None):
        saved, mine = ("LoRA adapters" if flag else "full weights" for flag in (record.get("lora", False),
                                                                               engine.lora is not None))
        raise ValueError(f"checkpoint {directory!r} holds {saved} but this engine trains {mine}; resume with the "
                         f"same lora setting the checkpoint was written with")
    state, optim_template = _state(engine)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    except CheckpointException as error:
        cause = first_checkpoint_failure(error)
        raise ValueError(f"checkpoint {directory!r} cannot be read: {type(cause).__name__}: "
                         f"{' '.join(str(cause).split())}") from None
    # strict=False: with tied embeddings at pp=1 the head shares the embedding's tensor
    set_model_state_dict(engine.model, _local_names(engine, state["model"]),
                         options=StateDictOptions(strict=False))
    if engine.optimizer is not None:
        set_optimizer_state_dict(engine.model, engine.optimizer,
                                 {"state": _local_names(engine, state["optim"]),
                                  "param_groups": optim_template["param_groups"]})
    engine.step = int(record["step"])
    engine.restore_auto_token_budget(record.get("token_budget"))  # absent in checkpoints written before it


def _full_stage_tensors(engine: "TrainingEngine", keep=None) -> dict[str, torch.Tensor]:
    """This rank's stage as full CPU tensors (HF names; ``keep(name)`` selects some): tensor/data-parallel shards
    gathered one parameter at a time, so device memory holds at most one full parameter beyond the shards."""
    local: dict[str, torch.Tensor] = {}
    for name, tensor in engine.model.state_dict().items():
        if "rotary_emb" in name or (keep is not None and not keep(name)):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        local[name] = full.detach().to("cpu", copy=True)
    return local


def _merged(engine: "TrainingEngine", state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stage's full tensors with each LoRA-adapted weight merged (W + scale B A) and the adapters left out."""
    from hybridflow.models.lora import adapted_layers, is_adapter_parameter

    merged = {name: tensor for name, tensor in state.items() if not is_adapter_parameter(name)}
    for name, layer in adapted_layers(engine.model):
        delta = state[f"{name}.lora_B.weight"].float() @ state[f"{name}.lora_A.weight"].float() * layer.scale
        weight = merged[f"{name}.weight"]
        merged[f"{name}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def gather_full_state_dict(engine: "TrainingEngine", keep=None) -> dict[str, torch.Tensor]:
    """Full CPU tensors of every parameter (HF names; ``keep(name)`` selects some) on global rank 0, {} on the
    other ranks."""
    local = _full_stage_tensors(engine, keep)
    if engine.layout.pp_size == 1:
        return local if _is_rank0() else {}
    # one rank per stage (dp 0, tp 0) contributes its stage's tensors
    coords = engine.coords
    mine = local if coords.dp_rank == 0 and coords.tp_rank == 0 else {}
    gathered = [None] * dist.get_world_size() if _is_rank0() else None
    dist.gather_object(mine, gathered, dst=0)
    if not _is_rank0():
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


def export_hf(engine: "TrainingEngine", directory: str) -> None:
    """Write config.json + safetensors that ``from_pretrained`` loads (any layout -> full weights).

    Nothing is gathered across pipeline stages: one rank per stage (dp 0, tp 0) writes its stage's
    file, ``model-0000k-of-0000p.safetensors``, and rank 0 writes the index Hugging Face reads
    (``model.safetensors.index.json``); with one stage it is a single ``model.safetensors``.
    """
    from safetensors.torch import save_file

    state = _full_stage_tensors(engine)
    if engine.lora is not None:
        state = _merged(engine, state)  # a LoRA model exports as the merged model (export_adapter: the adapter)
    tied = bool(getattr(engine.hf_config, "tie_word_embeddings", False))
    if tied:
        state.pop(OUTPUT_HEAD, None)  # transformers re-ties it to the input embedding
    pp_size, coords = engine.layout.pp_size, engine.coords
    writes = coords.dp_rank == 0 and coords.tp_rank == 0
    file_name = ("model.safetensors" if pp_size == 1
                 else f"model-{coords.pp_rank + 1:05d}-of-{pp_size:05d}.safetensors")
    tmp = _begin_atomic(directory)
    if writes:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, file_name),
                  metadata={"format": "pt"})
    if pp_size > 1:
        mine = {name: (file_name, t.numel() * t.element_size()) for name, t in state.items()} if writes else {}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # names and sizes only
        if _is_rank0():
            weight_map, total = {}, 0
            for part in everyone:
                for name, (file, size) in part.items():
                    weight_map[name] = file
                    total += size
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as handle:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                          handle, indent=2)
    if _is_rank0():
        hf_config = copy.deepcopy(engine.hf_config)
        family = type(engine.hf_config).__name__.removesuffix("Config")
        hf_config.architectures = [causal_lm_class_name(engine.hf_config) if engine.head == "lm"
                                   else family + "ForTokenClassification"]
        hf_config.save_pretrained(tmp)
    _commit_atomic(tmp, directory)


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def export_adapter(engine: "TrainingEngine", directory: str, *, base_model: str | None) -> None:
    """Write the LoRA adapter as PEFT does (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
    ``peft.PeftModel.from_pretrained(<base model>, directory)``; a value/score head is saved with it as PEFT's
    ``modules_to_save``. ``base_model`` goes into the config (the base's directory; None for a tiny model)."""
    from safetensors.torch import save_file

    from hybridflow.models.heads import SCALAR_HEAD
    from hybridflow.models.lora import is_adapter_parameter, peft_adapter_config, peft_name

    if engine.lora is None:
        raise ValueError("export_adapter needs an engine with LoRA adapters (lora=...); export_hf writes full models")
    head_saved = engine.head != "lm"
    state = gather_full_state_dict(engine, keep=lambda name: is_adapter_parameter(name)
                                   or (head_saved and name.split(".")[0] == SCALAR_HEAD))
    tmp = _begin_atomic(directory)
    if _is_rank0():
        save_file({peft_name(name): tensor.contiguous() for name, tensor in state.items()},
                  os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = peft_adapter_config(engine.lora, base_model=base_model,
                                     modules_to_save=[SCALAR_HEAD] if head_saved else None,
                                     task_type="CAUSAL_LM" if engine.head == "lm" else "TOKEN_CLS")
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as handle:
            json.dump(config, handle, indent=2)
    _commit_atomic(tmp, directory)
