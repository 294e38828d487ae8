"""Mixture-of-experts layers (Qwen3-MoE) as one grouped computation, and the router's load-balancing loss.

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts per token, A = T * K
(token, expert) assignments, C capacity (the most assignments any expert got in this call).

transformers stores the experts stacked: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]. Its eager
forward loops over the experts in Python; ``grouped_experts`` instead sorts the assignments by expert, lays them
out as an [E, C, H] batch (each expert's tokens in its row, zero rows after them) and runs both projections as
one batched matmul each, forward and backward. Nothing is dropped: C is the largest group, so the padding costs
E * C - A rows of compute, and every token's expert outputs are summed in ascending expert order, as the loop
does. (``torch.nn.functional.grouped_mm`` would skip the padding, but on CPU in torch 2.13 it requires 16-byte
strides and its backward fails on some group layouts.) Expert parallel (``hybridflow.parallel.expert_parallel``)
runs ``grouped_experts`` on each rank's share of the experts, between two all-to-alls.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

GROUPED_EXPERTS = "hybridflow_grouped"
"""Name under which ``grouped_experts_forward`` is registered with transformers' experts interface."""


def local_part(tensor: Tensor) -> Tensor:
    """A DTensor's local tensor (the whole tensor under tensor parallelism, which replicates the experts; this
    rank's experts under expert parallel, ``hybridflow.parallel.expert_parallel``); any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def grouped_experts(hidden_TH: Tensor, top_k_index_TK: Tensor, top_k_weights_TK: Tensor, gate_up_E2IH: Tensor,
                    down_EHI: Tensor, activation, *, static_shapes: bool = False) -> Tensor:
    """sum_k weight[t, k] * expert_{index[t, k]}(hidden[t]) for every token, as two batched matmuls ([T, H]).

    C is the largest group, read on the host; ``static_shapes`` makes it T instead (a token's K experts are
    distinct, so no group is larger): no host sync and shapes that depend on T alone, which a CUDA graph can
    capture, for E * T rows of compute. The decoder's fixed-shape decode steps (one token per row) take it."""
    num_tokens, top_k = top_k_index_TK.shape
    num_experts = gate_up_E2IH.shape[0]
    expert_A = top_k_index_TK.reshape(-1)
    order_A = torch.argsort(expert_A, stable=True)  # assignments grouped by expert, tokens ascending inside
    sorted_expert_A = expert_A[order_A]
    token_A = order_A // top_k
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_A.device).index_add_(
        0, sorted_expert_A, torch.ones_like(sorted_expert_A))  # bincount, without its host sync
    capacity = num_tokens if static_shapes else int(counts_E.max())
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
    return grouped_experts(local_part(hidden_states_TH), local_part(top_k_index_TK), local_part(top_k_weights_TK),
                           local_part(module.gate_up_proj), local_part(module.down_proj), module.act_fn)


def route(hidden_TH: Tensor, router_EH: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(router logits [T, E], top-k weights [T, K], top-k experts [T, K]) as Qwen3-MoE routes: softmax in fp32,
    the k largest probabilities, renormalised to sum to one when ``normalize`` (``norm_topk_prob``)."""
    logits_TE = F.linear(hidden_TH, router_EH)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
    weights_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return logits_TE, weights_TK.to(logits_TE.dtype), experts_TK


def replayed_weights(router_logits_TE: Tensor, experts_TK: Tensor, normalize: bool) -> Tensor:
    """The top-k weights [T, K] ``route`` gives experts ``experts_TK`` (any K experts per token, not necessarily the
    largest): their softmax probabilities in fp32, renormalised when ``normalize``, in the logits' dtype. Gradients
    reach the router through the probabilities, as in an ordinary forward."""
    probs_TE = torch.softmax(router_logits_TE, dim=-1, dtype=torch.float)
    weights_TK = probs_TE.gather(-1, experts_TK)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(router_logits_TE.dtype)


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


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers (``mlp.gate`` with ``top_k`` and ``num_experts``) of ``model``'s mixture-of-experts layers, in
    layer order (dense layers, e.g. Qwen3-MoE's ``mlp_only_layers``, have none)."""
    return [module for name, module in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(module, "top_k") and hasattr(module, "num_experts")]


class RouterLogitsRecorder:
    """Keeps the router logits of every MoE layer of ``model`` from its last training forward (forward hooks on
    the routers; inference and activation-checkpointing recomputation are not recorded twice: the list restarts
    at each forward of ``model`` itself)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self.top_k = self.routers[0].top_k if self.routers else 0
        self.logits: list[Tensor] = []
        for router in self.routers:
            router.register_forward_hook(self._record)
        model.register_forward_pre_hook(lambda module, inputs: self.logits.clear())

    def _record(self, module, inputs, outputs) -> None:
        if module.training and torch.is_grad_enabled():
            self.logits.append(local_part(outputs[0]))

    def balancing_loss(self, num_tokens: int) -> Tensor:
        """``load_balancing_loss`` over the first ``num_tokens`` tokens (the real ones) of every recorded layer,
        concatenated as transformers does."""
        return load_balancing_loss(torch.cat([logits_NE[:num_tokens] for logits_NE in self.logits]), self.top_k)


# ----- routing replay (R3) ------------------------------------------------------------------------------------------
ROUTED_EXPERTS = "routed_experts"
"""Batch key of a rollout's routing: [B, S, L, K] (S the ``input_ids`` columns, L the MoE layers in layer order, K
experts per token), the experts each MoE layer's router chose for each token, ``ROUTING_PAD`` where none was
recorded."""
ROUTING_PAD = -1
"""``routed_experts`` of a token with no recorded routing (padding; a response's last token, which no decode step
reads): a replaying forward routes it by its own top-k."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer dtype holding expert ids 0..num_experts-1 and ``ROUTING_PAD``."""
    return torch.int8 if num_experts <= torch.iinfo(torch.int8).max + 1 else torch.int16


class RoutingReplay:
    """Makes the routers of ``model`` send each token to given experts instead of their own top-k (routing replay,
    R3: train with the experts the rollout chose, so a near-tie that another precision or kernel breaks the other
    way cannot move a token to other experts between generation and training).

    Forward hooks on the routers replace their (logits, weights, experts) outputs inside ``replaying``: the experts
    are the recorded ones (the router's own where a token's are ``ROUTING_PAD``), the weights their probabilities
    under this forward's router logits (``replayed_weights``), so the router still learns through them. Hooks run
    again, with the same experts, when activation checkpointing recomputes a layer in backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self.top_k = self.routers[0].top_k if self.routers else 0
        self.experts_NLK: Tensor | None = None
        self._overridden: list[tuple[Tensor, Tensor]] = []  # per routed layer: (tokens rerouted, tokens recorded)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._replay, layer))

    def check(self, experts_BSLK: Tensor, input_ids_BS: Tensor) -> None:
        """ValueError unless ``experts_BSLK`` is a routing of these routers for the tokens of ``input_ids_BS``."""
        expected = (*input_ids_BS.shape, len(self.routers), self.top_k)
        if tuple(experts_BSLK.shape) != expected or experts_BSLK.is_floating_point():
            raise ValueError(f"{ROUTED_EXPERTS} must be integer expert ids of shape [B, S, MoE layers, top_k] = "
                             f"{list(expected)}; got {experts_BSLK.dtype} {list(experts_BSLK.shape)}")

    @contextlib.contextmanager
    def replaying(self, experts_NLK: Tensor):
        """Inside the block the routers route token n of every forward to ``experts_NLK[n, layer]``."""
        self.experts_NLK = experts_NLK
        self._overridden.clear()
        try:
            yield
        finally:
            self.experts_NLK = None

    @property
    def active(self) -> bool:
        """Inside ``replaying``."""
        return self.experts_NLK is not None

    def overridden_fraction(self) -> Tensor:
        """Of the recorded (token, MoE layer) routings of the forwards inside this ``replaying`` block, the fraction
        whose recorded expert set differs from the router's own top-k: how much the replay changed."""
        if not self._overridden:
            return torch.zeros(())
        rerouted, recorded = (torch.stack(counts).sum() for counts in zip(*self._overridden))
        return rerouted / recorded.clamp(min=1)

    def _replay(self, layer: int, module, inputs, outputs):
        if self.experts_NLK is None:
            return None
        logits_TE, own_weights_TK, own_experts_TK = outputs  # DTensors under tensor parallelism
        own_TK = local_part(own_experts_TK)
        recorded_TK = self.experts_NLK[:, layer].to(device=own_TK.device, dtype=torch.long)
        assert recorded_TK.shape == own_TK.shape, (recorded_TK.shape, own_TK.shape)
        recorded_T = recorded_TK[:, 0] >= 0
        experts_TK = torch.where(recorded_T[:, None], recorded_TK, own_TK)
        rerouted_T = (recorded_TK.sort(-1).values != own_TK.sort(-1).values).any(-1) & recorded_T
        self._overridden.append((rerouted_T.sum(), recorded_T.sum()))
        weights_TK = replayed_weights(local_part(logits_TE), experts_TK, module.norm_topk_prob)
        return logits_TE, _like(weights_TK, own_weights_TK), _like(experts_TK, own_experts_TK)


def _like(local: Tensor, reference: Tensor) -> Tensor:
    """``local`` as a DTensor laid out like ``reference`` when that is one (tensor parallelism), else itself."""
    if not hasattr(reference, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, reference.device_mesh, reference.placements, run_check=False)
