"""Tensor parallelism (DTensor) for the supported decoder families, following the shard table in sharding.py.

``apply_tensor_parallel(model, tp_mesh)`` turns every parameter of a Hugging Face decoder of a supported family
(``hybridflow.models.families``; causal LM or scalar-head model, whole or one pipeline stage) into a DTensor on
``tp_mesh``:

- q/k/v, gate/up (and Qwen2's q/k/v biases): ColwiseParallel, local shard = i-th chunk of dim 0;
- o_proj, down_proj: RowwiseParallel, i-th chunk of dim 1, output all-reduced;
- embed_tokens: vocabulary-parallel (RowwiseParallel on the embedding: rows = vocab), output all-reduced;
- lm_head: vocabulary-parallel (ColwiseParallel), logits all-gathered so callers see the full vocab;
- q_norm / k_norm (Qwen3): Replicate weights applied to the rank's heads, their gradient all-reduced;
- everything else (norms, the value/score head): Replicate DTensors, so the optimizer, gradient
  clipping and checkpointing see one kind of parameter.

Attention needs no patching: transformers 5.23 reshapes q/k/v with ``view(..., -1, head_dim)``, so a
rank's local projection yields heads/tp query heads and kv_heads/tp key/value heads, and the GQA
ratio ``num_key_value_groups`` it keeps is unchanged. Tied input/output embeddings stay one
parameter (both sides are Shard(0) over the vocabulary).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from transformers import PretrainedConfig

from hybridflow.parallel.sharding import COLUMN_PARALLEL, HEAD_NORMS, ROW_PARALLEL, tp_shard_dim

ADAPTERS = ("lora_A", "lora_B")
"""Children of a LoRA-adapted layer (``models/lora.py``): laid out by their layer's style, never on their own."""

# Config fields a tensor-parallel size must divide, in the order errors list them.
TP_DIVIDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def allowed_tp_sizes(config: PretrainedConfig) -> list[int]:
    """Every tensor-parallel size that divides all of ``TP_DIVIDED_FIELDS`` of ``config``."""
    values = [int(getattr(config, name)) for name in TP_DIVIDED_FIELDS]
    return [size for size in range(1, min(values) + 1) if all(value % size == 0 for value in values)]


def validate_tp_size(config: PretrainedConfig, tp_size: int) -> None:
    """Raise ValueError unless ``tp_size`` divides the head counts, intermediate size and vocabulary of ``config``.

    Runs without any process group, so parallel configs are checked before anything starts.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    failing = {name: int(getattr(config, name)) for name in TP_DIVIDED_FIELDS
               if int(getattr(config, name)) % tp_size != 0}
    if failing:
        values = ", ".join(f"{name}={int(getattr(config, name))}" for name in TP_DIVIDED_FIELDS)
        not_divided = ", ".join(f"{name}={value}" for name, value in failing.items())
        raise ValueError(f"tp_size {tp_size} does not divide {not_divided} (model has {values}); "
                         f"allowed tp sizes for this model: {allowed_tp_sizes(config)}")


class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors; the module sees DTensor inputs and returns local tensors.

    For modules whose inputs are already identical on every tensor-parallel rank (norms, scalar heads):
    no communication in forward or backward, each rank computes the same gradient.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=None,
                                 input_fn=self._to_dtensor, output_fn=self._to_local)

    @staticmethod
    def _to_dtensor(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(value, device_mesh, [Replicate()], run_check=False)
                     if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value
                     for value in inputs)

    @staticmethod
    def _to_local(module: nn.Module, outputs, device_mesh: DeviceMesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _partition_by_shard_table(path: str, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Make ``module``'s own parameters DTensors placed as ``tp_shard_dim`` says for their full names (``path`` is
    the layer's, ``name`` the submodule's inside it)."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        dim = tp_shard_dim(".".join(part for part in (path, name, param_name) if part))
        placement = Replicate() if dim is None else Shard(dim)
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                           requires_grad=param.requires_grad))


class AdaptedColwiseParallel(ColwiseParallel):
    """ColwiseParallel of a LoRA-adapted layer: W and B split by output rows, A replicated, so the adapter's
    output is split like the layer's (stock ColwiseParallel would split A too)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def _partition_linear_fn(self, name, module, device_mesh):
        _partition_by_shard_table(self.path, name, module, device_mesh)


class AdaptedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel of a LoRA-adapted layer: W and A split by input columns, B replicated; both partial sums
    leave through the layer's one all-reduce."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def _partition_linear_fn(self, name, module, device_mesh):
        _partition_by_shard_table(self.path, name, module, device_mesh)


class HeadShardedNormParallel(ParallelStyle):
    """A per-head norm (Qwen3's q_norm / k_norm) applied to this rank's heads: its weight is Replicate, its input
    ``[..., heads, D]`` Shard(heads).

    Each rank normalises only its own heads, so the weight's gradient is a partial sum over heads; declaring the
    input sharded over heads lets DTensor all-reduce that gradient (marking the input Replicate would keep each
    rank's partial sum as if it were the whole gradient).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=None,
                                 input_fn=self._to_dtensor, output_fn=ReplicateParallel._to_local)

    @staticmethod
    def _to_dtensor(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(value, device_mesh, [Shard(value.ndim - 2)], run_check=False)
                     if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value
                     for value in inputs)


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The per-module plan for ``model``: module name -> parallel style (every module that owns parameters)."""
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        leaf = name.rsplit(".", 1)[-1]
        adapted = hasattr(module, ADAPTERS[0])
        if leaf in ADAPTERS:
            continue
        if leaf in COLUMN_PARALLEL:
            plan[name] = AdaptedColwiseParallel(name) if adapted else ColwiseParallel()
        elif leaf in ROW_PARALLEL:
            plan[name] = AdaptedRowwiseParallel(name) if adapted else RowwiseParallel()
        elif leaf == "embed_tokens":
            plan[name] = RowwiseParallel(input_layouts=Replicate())  # vocab-parallel lookup, all-reduced
        elif leaf == "lm_head":
            plan[name] = ColwiseParallel(output_layouts=Replicate())  # full-vocabulary logits on every rank
        elif leaf in HEAD_NORMS:
            plan[name] = HeadShardedNormParallel()
        else:
            plan[name] = ReplicateParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` (a supported Hugging Face decoder, or a pipeline stage of one) over the 1-D ``tp_mesh``.

    Validates the tp size against ``model.config`` first. Modifies ``model`` in place and returns it;
    afterwards every parameter is a DTensor whose local shard follows ``sharding.tp_shard_dim``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be a 1-D device mesh, got {tp_mesh.ndim} dims {tp_mesh.mesh_dim_names}")
    validate_tp_size(model.config, tp_mesh.size())
    embedding, output = _tied_pair(model)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    if embedding is not None:
        output.weight = embedding.weight  # re-tie: both are the same Shard(0) layout over the vocabulary
    for name, param in model.named_parameters():
        if name in frozen:  # the parallel styles wrap every weight in a new trainable Parameter
            param.requires_grad_(False)
    check_shard_contract(model)
    return model


def _tied_pair(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(embed_tokens, lm_head) when they share one weight, else (None, None)."""
    modules = dict(model.named_modules())
    embedding = next((m for n, m in modules.items() if n.rsplit(".", 1)[-1] == "embed_tokens"), None)
    output = modules.get("lm_head")
    if embedding is not None and output is not None and output.weight is embedding.weight:
        return embedding, output
    return None, None


def check_shard_contract(model: nn.Module) -> None:
    """Assert every parameter is a DTensor placed as ``tp_shard_dim`` of its name says (internal invariant)."""
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} was not converted to a DTensor"
        dim = tp_shard_dim(name)
        expected = Replicate() if dim is None else Shard(dim)
        assert tuple(param.placements) == (expected,), f"{name}: placements {param.placements}, expected {expected}"
