"""Meta-device initialisation: materialise a sharded stage on its device and read only this rank's shard.

Building the whole model on every rank before sharding costs 4 bytes per parameter per GPU in fp32
(28 GB for 7B on every GPU, impossible beyond ~13B). Instead the engine builds the architecture on
the meta device, cuts the pipeline stage, applies tensor parallelism and FSDP (still on meta), and
only then allocates: ``to_empty`` gives each rank exactly its shards, and every parameter is filled
from the checkpoint's safetensors one tensor at a time (memory-mapped; each rank slices its own
part with ``distribute_tensor(..., src_data_rank=None)``, so there is no communication and at most
one full tensor on the host at a time).
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridflow.models.heads import SCALAR_HEAD, init_scalar_head
from hybridflow.models.lora import is_adapter_parameter
from hybridflow.models.moe import per_expert_names, stack_experts

EMBEDDING, OUTPUT_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def checkpoint_files(path: str) -> dict[str, str]:
    """Parameter name -> safetensors file of the Hugging Face directory ``path`` (single or sharded)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"model directory {path!r} has neither model.safetensors nor model.safetensors.index.json; "
                         f"hybridflow loads safetensors checkpoints only")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the Hugging Face directory ``path`` (one ``model.safetensors``, or the files of a sharded
    export with its index) as one CPU state dict."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(checkpoint_files(path).values())):
        state.update(load_file(file))
    return state


def _reset_computed_buffers(stage: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers computed at construction (rotary inverse frequencies; Gemma 3's embedding scale) are
    not in the checkpoint and hold garbage after ``to_empty``: recompute them."""
    for name, module in list(stage.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(config=module.config).to(device)
            for buffer_name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, buffer_name, buffer)
        if hasattr(module, "scalar_embed_scale"):  # Gemma3TextScaledWordEmbedding
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)


def _fill(param: nn.Parameter, full: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def _read(handles: dict, files: dict[str, str], name: str) -> torch.Tensor:
    """Tensor ``name`` of the checkpoint, opening its safetensors file once."""
    from safetensors import safe_open

    file = files[name]
    if file not in handles:
        handles[file] = safe_open(file, framework="pt")
    return handles[file].get_tensor(name)


def materialize_and_load(stage: nn.Module, *, device: torch.device, path: str, head: str, seed: int,
                         ties_embeddings: bool) -> None:
    """Allocate ``stage`` (built on meta and already sharded) on ``device`` and load its shards from ``path``.

    Names are the Hugging Face names the stage keeps. A tied output head reads the embedding; a
    value/score head missing from a causal-LM checkpoint is initialised from ``seed`` (with a
    warning), exactly as ``build_model`` does; any other missing weight is a ValueError.
    """
    stage.to_empty(device=device)
    _reset_computed_buffers(stage, device)
    files = checkpoint_files(path)
    # LoRA adapters are not in a base checkpoint: the engine initialises them (models/lora.py)
    params = {name: param for name, param in stage.named_parameters(remove_duplicate=False)
              if not is_adapter_parameter(name)}
    missing = [name for name in params if name not in files
               and not (name == OUTPUT_HEAD and ties_embeddings and EMBEDDING in files)
               and name.split(".")[0] != SCALAR_HEAD and per_expert_names(name, files) is None]
    if missing:
        shown = missing[:5] + (["..."] if len(missing) > 5 else [])
        raise ValueError(f"checkpoint {path!r} lacks weights that head {head!r} needs: {shown}")
    handles: dict[str, object] = {}
    try:
        for name, param in params.items():
            source = EMBEDDING if name == OUTPUT_HEAD and name not in files and ties_embeddings else name
            experts = per_expert_names(source, files) if source not in files else None
            if experts is not None:  # stacked experts from a checkpoint that stores one Linear per expert
                full = stack_experts([[_read(handles, files, part) for part in expert] for expert in experts])
            elif source not in files:  # a new scalar head
                if name.endswith(".weight"):
                    warnings.warn(f"{path!r} has no {head} head: initialising a new one from seed {seed}",
                                  stacklevel=3)
                    linear = nn.Linear(param.shape[1], param.shape[0], bias=False)
                    init_scalar_head(linear, seed=seed)
                    full = linear.weight.detach()
                else:
                    full = torch.zeros(param.shape)
            else:
                full = _read(handles, files, source)
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint {path!r}: {source} has shape {tuple(full.shape)}, the model expects "
                                 f"{tuple(param.shape)}")
            _fill(param, full.to(dtype=param.dtype))
    finally:
        handles.clear()
