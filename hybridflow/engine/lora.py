"""LoRA adapters of a sharded model (``models/lora.py`` holds the layer): set each rank's slice of their initial
value, merge them into the weights a rank hands to generation, gather them whole for export.

Legend: O = out features, I = in features.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridflow.models.lora import adapted_layers, initial_adapter_weight, is_adapter_parameter


@torch.no_grad()
def reset_adapters(model: nn.Module, *, seed: int) -> None:
    """Set every adapter parameter to ``initial_adapter_weight`` (a sharded one to this rank's slice of it), so
    every layout starts from the same adapter."""
    for name, param in model.named_parameters():
        if not is_adapter_parameter(name):
            continue
        full = initial_adapter_weight(name, param.shape, seed=seed).to(dtype=param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def local_delta(layer: nn.Module) -> Tensor:
    """This rank's part of scale * B A [O, I], cut as the layer's weight is (tensor-parallel split or FSDP slice):
    B A is computed on the factors' shards (DTensor) and laid out like W."""
    delta_OI = layer.delta_weight()
    weight = layer.weight
    if isinstance(weight, DTensor):
        if tuple(delta_OI.placements) != tuple(weight.placements):
            delta_OI = delta_OI.redistribute(weight.device_mesh, weight.placements)
        return delta_OI.to_local()
    return delta_OI


@torch.no_grad()
def merge_into_shards(model: nn.Module, shards: dict[str, Tensor]) -> dict[str, Tensor]:
    """``shards`` (parameter name -> this rank's local tensor, as a training layout hands them to generation) with
    every adapted weight replaced by this rank's part of W + scale B A, a new tensor (the trained W is never
    written), and the adapters' own entries left out."""
    merged = {name: tensor for name, tensor in shards.items() if not is_adapter_parameter(name)}
    for name, layer in adapted_layers(model):
        base = merged[f"{name}.weight"]
        delta_OI = local_delta(layer)
        assert delta_OI.shape == base.shape, f"{name}: update {tuple(delta_OI.shape)} vs weight {tuple(base.shape)}"
        merged[f"{name}.weight"] = base + delta_OI.to(device=base.device, dtype=base.dtype)
    return merged


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """Every adapter parameter of ``model`` as a full CPU tensor by name (a sharded one gathered)."""
    state = {}
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            state[name] = full.detach().to("cpu", copy=True)
    return state


def base_shards(engine) -> dict[str, Tensor]:
    """What ``TrainingEngine.local_shards`` hands generation, without merging: this rank's base weights as they
    are (the adapters left out), for a rollout that applies the adapter itself (vLLM, ``vllm_sync: adapter``)."""
    shards = engine.training_layout.local_shards(engine.model, engine.device)
    return {name: tensor for name, tensor in shards.items() if not is_adapter_parameter(name)}


def generation_adapter(engine, *, dtype: torch.dtype) -> dict[str, Tensor]:
    """The whole adapter (every A and B, gathered from their shards: a collective on every rank) in the generation
    dtype, what an adapter-only sync hands the rollout. ValueError under pipeline parallelism, where a rank holds
    only its stage's adapters."""
    if engine.layout.pp_size > 1:
        raise ValueError(f"actor.lora.vllm_sync='adapter' with the actor's pp_size={engine.layout.pp_size}: a rank "
                         f"holds only its pipeline stage's adapters; allowed: vllm_sync='merged' (the hybrid engine "
                         f"gathers the merged weights across stages) or pp_size 1")
    return {name: tensor.to(dtype) for name, tensor in adapter_state(engine.model).items()}
