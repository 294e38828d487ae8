"""FSDP2 (``fully_shard``) over data-parallel ranks: one unit per decoder layer plus the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.device import device_type


def apply_fsdp(stage: nn.Module, dp_mesh: DeviceMesh, *, cpu_offload: bool = False,
               param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``stage`` (a ``DecoderStage``) over ``dp_mesh`` in place and return it.

    FSDP2 averages gradients over ``dp_mesh``; hybridflow losses are already normalised by global
    token/sequence counts and need the sum, so the engine scales each loss by the dp size before
    backward (``set_gradient_divide_factor(1)`` would use PREMUL_SUM, which gloo lacks).

    ``param_dtype`` (the compute dtype when it is not fp32): parameters are all-gathered in it, which
    halves the all-gather volume and memory for bf16, while gradients are reduced and the master
    weights kept in fp32.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy(pin_memory=device_type() == "cuda") if cpu_offload else OffloadPolicy()
    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in stage.model.layers.values():
        fully_shard(layer, mesh=dp_mesh, offload_policy=offload, mp_policy=precision, reshard_after_forward=True)
    fully_shard(stage, mesh=dp_mesh, offload_policy=offload, mp_policy=precision, reshard_after_forward=True)
    return stage


def dp_shard_rows(num_rows: int, dp_size: int, dp_rank: int) -> range:
    """The rows of dim 0 that ``fully_shard`` gives data-parallel rank ``dp_rank`` of ``dp_size``.

    FSDP2 cuts every parameter along dim 0 as ``torch.chunk`` does: chunks of ceil(rows / dp_size) rows,
    the last ones shorter or empty (the local tensor holds only the real rows, no padding).
    """
    chunk = -(-num_rows // dp_size)
    start = min(dp_rank * chunk, num_rows)
    return range(start, min(start + chunk, num_rows))
