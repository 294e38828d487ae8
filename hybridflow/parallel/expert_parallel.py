"""Expert parallelism: the experts of every mixture-of-experts layer split over ``ep_size`` ranks, tokens sent to
the ranks that hold their experts with an all-to-all and their outputs brought back with the reverse one.

Legend: T tokens of this rank, H hidden size, K experts per token, A = T * K (token, expert) assignments this rank
sends, R assignments it receives, E experts of a layer, L = E / ep_size experts held per rank, P = ep_size.

Mesh: ``("edp", "ep")`` of shape (world / ep_size, ep_size) in global rank order, so an expert-parallel group is a
block of ``ep_size`` consecutive ranks and ``edp`` joins the ranks that hold the same experts. The stacked expert
parameters (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) become DTensors placed ``(Replicate(),
Shard(0))``: rank ``ep_rank`` holds experts ``ep_rank * L ..< (ep_rank + 1) * L`` of every layer, so checkpoints
(DCP) reshard them and ``full_tensor()`` gathers whole experts for export and generation. Everything else (attention,
norms, the routers, embeddings) is replicated on every rank and trained data-parallel over the whole group.

Forward of one MoE layer on each rank of an ep group (``expert_parallel_forward``): the router picks K experts per
local token as in one process; the assignments are sorted by expert (hence by owning rank), each rank's counts are
exchanged, the hidden rows and local expert ids go to their owners (``all_to_all_single`` with split sizes), the
owners run the grouped computation (``hybridflow.models.moe.grouped_experts``) on their L experts, the outputs come
back by the reverse all-to-all and are weighted by the router's weights and summed per token in ascending expert
order, as one process sums them. The all-to-all's backward is the reverse all-to-all (``_AllToAll``), so gradients
of a rank's experts collect the contributions of every token routed to them across its ep group; the layout then
sums expert gradients over ``edp`` and the others over the whole group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.models.moe import grouped_experts, local_part

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The stacked expert parameters sharded along dim 0 (experts)."""


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every stacked-experts module (``mlp.experts`` holding ``gate_up_proj`` and ``down_proj``)."""
    return [(name, module) for name, module in model.named_modules()
            if name.endswith("mlp.experts") and all(hasattr(module, p) for p in EXPERT_PARAMS)]


def validate_ep_size(model: nn.Module, ep_size: int, world_size: int) -> None:
    """ValueError unless ``ep_size`` (``engine.ep_size``) divides the world and every MoE layer's experts, and the
    model has MoE layers at all."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    experts = expert_modules(model)
    if not experts:
        raise ValueError(f"engine.ep_size={ep_size} needs a mixture-of-experts model; model_type {model_type!r} has "
                         f"no experts; allowed: ep_size 1 for dense models")
    check_ep_world(ep_size, world_size)
    num_experts = experts[0][1].gate_up_proj.shape[0]
    if num_experts % ep_size:
        raise ValueError(f"engine.ep_size={ep_size} must divide the {num_experts} experts of {model_type!r}; allowed "
                         f"(also dividing the world size {world_size}): "
                         f"{[d for d in range(1, world_size + 1) if world_size % d == 0 and num_experts % d == 0]}")


def check_ep_world(ep_size: int, world_size: int) -> None:
    """ValueError unless ``ep_size`` (``engine.ep_size``) divides ``world_size``."""
    if world_size % ep_size:
        raise ValueError(f"engine.ep_size={ep_size} must divide the world size {world_size}; allowed: "
                         f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")


def build_ep_mesh(ep_size: int):
    """The ("edp", "ep") device mesh over the default group: ep groups are blocks of ``ep_size`` consecutive ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.device import device_type

    world = dist.get_world_size() if dist.is_initialized() else 1
    return init_device_mesh(device_type(), (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with split sizes whose backward is the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, rows_AH: Tensor, recv_sizes: list[int], send_sizes: list[int], group) -> Tensor:
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        return _exchange(rows_AH, recv_sizes, send_sizes, group)

    @staticmethod
    def backward(ctx, grad_RH: Tensor):
        recv_sizes, send_sizes = ctx.sizes
        return _exchange(grad_RH.contiguous(), send_sizes, recv_sizes, ctx.group), None, None, None


def _exchange(rows: Tensor, recv_sizes: list[int], send_sizes: list[int], group) -> Tensor:
    """Send ``rows`` (dim 0 cut by ``send_sizes``, one piece per rank of ``group``) and receive ``recv_sizes`` rows."""
    out = rows.new_empty((sum(recv_sizes), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
    return out


def expert_parallel_forward(module: nn.Module, hidden_TH: Tensor, top_k_index_TK: Tensor,
                            top_k_weights_TK: Tensor) -> Tensor:
    """The experts' output [T, H] for this rank's tokens, computed by the ranks of ``module.ep_group`` that hold
    their experts (module docstring)."""
    hidden_TH, index_TK, weights_TK = local_part(hidden_TH), local_part(top_k_index_TK), local_part(top_k_weights_TK)
    gate_up_L2IH, down_LHI = local_part(module.gate_up_proj), local_part(module.down_proj)
    group, num_local = module.ep_group, gate_up_L2IH.shape[0]
    expert_A = index_TK.reshape(-1)
    order_A = torch.argsort(expert_A, stable=True)  # by expert, hence by owning rank; tokens ascending inside
    sorted_expert_A = expert_A[order_A]
    token_A = order_A // index_TK.shape[1]
    send_counts_P = torch.bincount(sorted_expert_A // num_local, minlength=dist.get_world_size(group))
    recv_counts_P = torch.empty_like(send_counts_P)
    dist.all_to_all_single(recv_counts_P, send_counts_P, group=group)
    send_sizes, recv_sizes = send_counts_P.tolist(), recv_counts_P.tolist()
    local_expert_R = _exchange(sorted_expert_A % num_local, recv_sizes, send_sizes, group)
    rows_RH = _AllToAll.apply(hidden_TH[token_A], recv_sizes, send_sizes, group)
    ones_R1 = torch.ones(rows_RH.shape[0], 1, dtype=weights_TK.dtype, device=rows_RH.device)
    out_RH = grouped_experts(rows_RH, local_expert_R[:, None], ones_R1, gate_up_L2IH, down_LHI, module.act_fn)
    out_AH = _AllToAll.apply(out_RH, send_sizes, recv_sizes, group)
    out_AH = out_AH * weights_TK.reshape(-1)[order_A, None].to(out_AH.dtype)
    return hidden_TH.new_zeros(hidden_TH.shape).index_add(0, token_A, out_AH.to(hidden_TH.dtype))


def shard_experts(stage: nn.Module, ep_mesh) -> list[nn.Parameter]:
    """Cut the stacked experts of every MoE layer of ``stage`` over ``ep_mesh["ep"]`` in place (DTensor parameters
    placed ``(Replicate(), Shard(0))``, this rank's experts only) and route their forward through the all-to-all;
    returns the expert parameters. Works on a meta stage too (shapes only; the weights are read later)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ep_size, ep_rank = ep_mesh["ep"].size(), ep_mesh["ep"].get_local_rank()
    sharded = []
    for _, module in expert_modules(stage):
        for name in EXPERT_PARAMS:
            full = getattr(module, name)
            local = full.detach().chunk(ep_size, dim=0)[ep_rank].clone()
            param = nn.Parameter(DTensor.from_local(local, ep_mesh, (Replicate(), Shard(0)), run_check=False),
                                 requires_grad=full.requires_grad)
            setattr(module, name, param)
            sharded.append(param)
        module.ep_group = ep_mesh.get_group("ep")
        module.forward = functools.partial(expert_parallel_forward, module)
    return sharded
