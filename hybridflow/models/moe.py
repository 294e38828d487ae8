"""Mixture-of-experts layers (Qwen3-MoE) as one grouped computation, and the router's load-balancing loss.

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts per token, A = T * K
(token, expert) assignments, C capacity (the most assignments any expert got in this call).

transformers stores the experts stacked: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]. Its eager
forward loops over the experts in Python; ``grouped_experts`` instead sorts the assignments by expert, lays them
out as an [E, C, H] batch (each expert's tokens in its row, zero rows after them) and runs both projections as
one batched matmul each, forward and backward. Nothing is dropped: C is the largest group, so the padding costs
E * C - A rows of compute, and every token's expert outputs are summed in ascending expert order, as the loop
does. (``torch.nn.functional.grouped_mm`` would skip the padding, but on CPU in torch 2.13 it requires 16-byte
strides and its backward fails on some group layouts.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

GROUPED_EXPERTS = "hybridflow_grouped"
"""Name under which ``grouped_experts_forward`` is registered with transformers' experts interface."""


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local tensor (replicated under tensor parallelism: the experts are not sharded there)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def grouped_experts(hidden_TH: Tensor, top_k_index_TK: Tensor, top_k_weights_TK: Tensor, gate_up_E2IH: Tensor,
                    down_EHI: Tensor, activation) -> Tensor:
    """sum_k weight[t, k] * expert_{index[t, k]}(hidden[t]) for every token, as two batched matmuls ([T, H])."""
    num_tokens, top_k = top_k_index_TK.shape
    num_experts = gate_up_E2IH.shape[0]
    expert_A = top_k_index_TK.reshape(-1)
    order_A = torch.argsort(expert_A, stable=True)  # assignments grouped by expert, tokens ascending inside
    sorted_expert_A = expert_A[order_A]
    token_A = order_A // top_k
    counts_E = torch.bincount(sorted_expert_A, minlength=num_experts)
    capacity = int(counts_E.max())
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    slot_A = torch.arange(order_A.numel(), device=order_A.device) - starts_E[sorted_expert_A]  # place in its group
    batch_ECH = hidden_TH.new_zeros(num_experts, capacity, hidden_TH.shape[-1])
    batch_ECH = batch_ECH.index_put((sorted_expert_A, slot_A), hidden_TH[token_A])
    gate_ECI, up_ECI = torch.bmm(batch_ECH, gate_up_E2IH.transpose(1, 2)).chunk(2, dim=-1)
    out_ECH = torch.bmm(activation(gate_ECI) * up_ECI, down_EHI.transpose(1, 2))
    out_AH = out_ECH[sorted_expert_A, slot_A] * top_k_weights_TK.reshape(-1)[order_A, None].to(out_ECH.dtype)
    return hidden_TH.new_zeros(num_tokens, hidden_TH.shape[-1]).index_add(0, token_A, out_AH.to(hidden_TH.dtype))


def grouped_experts_forward(module, hidden_states_TH: Tensor, top_k_index_TK: Tensor,
                            top_k_weights_TK: Tensor) -> Tensor:
    """transformers experts function (``config._experts_implementation``): ``grouped_experts`` on the module's
    stacked weights."""
    return grouped_experts(_local(hidden_states_TH), _local(top_k_index_TK), _local(top_k_weights_TK),
                           _local(module.gate_up_proj), _local(module.down_proj), module.act_fn)


def route(hidden_TH: Tensor, router_EH: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(router logits [T, E], top-k weights [T, K], top-k experts [T, K]) as Qwen3-MoE routes: softmax in fp32,
    the k largest probabilities, renormalised to sum to one when ``normalize`` (``norm_topk_prob``)."""
    logits_TE = F.linear(hidden_TH, router_EH)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
    weights_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return logits_TE, weights_TK.to(logits_TE.dtype), experts_TK


def load_balancing_loss(router_logits_TE: Tensor, top_k: int) -> Tensor:
    """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (f_e: fraction of assignments routed to expert e,
    P_e: mean router probability of e), 1 when the load is uniform; as transformers' ``load_balancing_loss_func``
    without an attention mask (packed micro-batches hold real tokens only)."""
    num_experts = router_logits_TE.shape[-1]
    probs_TE = torch.softmax(router_logits_TE.float(), dim=-1)
    chosen_TKE = F.one_hot(torch.topk(probs_TE, top_k, dim=-1).indices, num_experts).float()
    fraction_KE = chosen_TKE.mean(dim=0)
    return num_experts * (fraction_KE * probs_TE.mean(dim=0)[None]).sum()


def register() -> None:
    """Make ``GROUPED_EXPERTS`` a valid ``experts_implementation`` of transformers."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(GROUPED_EXPERTS, grouped_experts_forward)


register()


STACKED_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""A stacked expert parameter -> the per-expert Linear weights it concatenates (dim 0), as checkpoints on the hub
store them (``mlp.experts.<e>.gate_proj.weight``); transformers converts between the two when it loads and saves."""


def per_expert_names(name: str, available) -> list[list[str]] | None:
    """For a stacked expert parameter ``name`` (``...mlp.experts.gate_up_proj``) missing from a checkpoint, the
    per-expert names that make it up, expert by expert, when ``available`` (a container of names) holds them."""
    prefix, _, kind = name.rpartition(".")
    if kind not in STACKED_EXPERT_PARTS or not prefix.endswith("mlp.experts"):
        return None
    experts = []
    while all(f"{prefix}.{len(experts)}.{part}.weight" in available for part in STACKED_EXPERT_PARTS[kind]):
        experts.append([f"{prefix}.{len(experts)}.{part}.weight" for part in STACKED_EXPERT_PARTS[kind]])
    return experts or None


def stack_experts(parts: list[list[Tensor]]) -> Tensor:
    """The stacked parameter [E, ...] from each expert's weights (concatenated along dim 0 within an expert)."""
    return torch.stack([torch.cat(expert, dim=0) for expert in parts])


class RouterLogitsRecorder:
    """Keeps the router logits of every MoE layer of ``model`` from its last training forward (forward hooks on
    the routers; inference and activation-checkpointing recomputation are not recorded twice: the list restarts
    at each forward of ``model`` itself)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [module for name, module in model.named_modules()
                        if name.endswith("mlp.gate") and hasattr(module, "top_k") and hasattr(module, "num_experts")]
        self.top_k = self.routers[0].top_k if self.routers else 0
        self.logits: list[Tensor] = []
        for router in self.routers:
            router.register_forward_hook(self._record)
        model.register_forward_pre_hook(lambda module, inputs: self.logits.clear())

    def _record(self, module, inputs, outputs) -> None:
        if module.training and torch.is_grad_enabled():
            self.logits.append(_local(outputs[0]))

    def balancing_loss(self, num_tokens: int) -> Tensor:
        """``load_balancing_loss`` over the first ``num_tokens`` tokens (the real ones) of every recorded layer,
        concatenated as transformers does."""
        return load_balancing_loss(torch.cat([logits_NE[:num_tokens] for logits_NE in self.logits]), self.top_k)
