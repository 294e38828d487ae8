"""Per-token losses for policy and value training: PPO clipped policy loss (and dual-clip), clipped value loss, entropy.

Shape legend: B = batch (sequences), T = response tokens, V = vocabulary.
Every loss is returned per token (`loss_BT`) with per-token diagnostics; the caller reduces it
with `masked.aggregate_loss`, passing global token/sequence counts so that micro-batch splits do
not change the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PolicyLossOutput:
    """Per-token PPO policy loss and the quantities it is logged by."""

    loss_BT: Tensor
    """-A * ratio after clipping (the quantity to minimize), per token."""
    ratio_BT: Tensor
    """pi / pi_old per token (detached)."""
    clipped_BT: Tensor
    """True where the clipped branch was taken (no gradient flows through the ratio)."""
    dual_clipped_BT: Tensor
    """True where the dual-clip bound -c * A was taken (only for A < 0 with `dual_clip_ratio`)."""
    approx_kl_BT: Tensor
    """k3 estimate of KL(pi_old || pi) per token (detached): ratio - 1 - log ratio."""


def ppo_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_ratio: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017), optionally dual-clipped (Ye et al. 2020).

    ratio = exp(logprobs - old_logprobs); loss = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high)).
    Dual clip: for A < 0 the loss is further capped at -A * dual_clip_ratio (a constant, no
    gradient), so a huge ratio on a bad action cannot blow the update up.
    """
    if logprobs_BT.shape != old_logprobs_BT.shape or logprobs_BT.shape != advantages_BT.shape:
        raise ValueError(
            f"logprobs_BT {tuple(logprobs_BT.shape)}, old_logprobs_BT {tuple(old_logprobs_BT.shape)} and "
            f"advantages_BT {tuple(advantages_BT.shape)} must have one shape"
        )
    if not 0 <= clip_ratio_low < 1 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low must lie in [0, 1) and clip_ratio_high be >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    if dual_clip_ratio is not None and dual_clip_ratio <= 1:
        raise ValueError(f"dual_clip_ratio must be > 1 (or None), got {dual_clip_ratio}")
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_loss_BT = -advantages_BT * torch.clamp(ratio_BT, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
    clipped_BT = clipped_loss_BT > unclipped_BT
    dual_clipped_BT = torch.zeros_like(clipped_BT)
    if dual_clip_ratio is not None:
        cap_BT = -advantages_BT * dual_clip_ratio
        dual_clipped_BT = (advantages_BT < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(dual_clipped_BT, cap_BT, loss_BT)
    approx_kl_BT = (ratio_BT - 1 - log_ratio_BT).detach()
    return PolicyLossOutput(
        loss_BT=loss_BT,
        ratio_BT=ratio_BT.detach(),
        clipped_BT=clipped_BT,
        dual_clipped_BT=dual_clipped_BT,
        approx_kl_BT=approx_kl_BT,
    )


def value_loss(
    values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, *, clip_range: float | None = 0.2
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO) -> (loss_BT, clipped_BT).

    loss = 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = old_V + clip(V - old_V, -c, c);
    `clip_range=None` gives the plain 0.5 * (V - R)^2. clipped_BT marks tokens where the clipped
    term was the larger one.
    """
    if not values_BT.shape == old_values_BT.shape == returns_BT.shape:
        raise ValueError(
            f"values_BT {tuple(values_BT.shape)}, old_values_BT {tuple(old_values_BT.shape)} and "
            f"returns_BT {tuple(returns_BT.shape)} must have one shape"
        )
    unclipped_BT = (values_BT - returns_BT).square()
    if clip_range is None:
        return 0.5 * unclipped_BT, torch.zeros_like(unclipped_BT, dtype=torch.bool)
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0 (or None to disable clipping), got {clip_range}")
    clipped_values_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -clip_range, clip_range)
    clipped_loss_BT = (clipped_values_BT - returns_BT).square()
    return 0.5 * torch.maximum(unclipped_BT, clipped_loss_BT), clipped_loss_BT > unclipped_BT


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of the softmax distribution over the last dimension -> entropy_BT (in nats)."""
    log_probs_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return -(log_probs_BTV.exp() * log_probs_BTV).sum(dim=-1)


def logprobs_from_logits(logits_BTV: Tensor, labels_BT: Tensor) -> Tensor:
    """log softmax(logits)[label] per position -> logprobs_BT (computed in float32)."""
    log_probs_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return log_probs_BTV.gather(-1, labels_BT.unsqueeze(-1)).squeeze(-1)
