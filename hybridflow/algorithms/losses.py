"""Per-token losses for policy and value training: PPO (dual/higher clip), GSPO, CISPO, TIS, value loss, entropy.

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


# Log-ratios are clamped to +-LOG_RATIO_LIMIT before exp: exp(20) ~ 5e8 is finite in float32 (and so
# is its gradient); a token beyond it is clipped by every objective here anyway.
LOG_RATIO_LIMIT = 20.0


def _check_policy_inputs(logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor,
                         mask_BT: Tensor | None, clip_ratio_low: float, clip_ratio_high: float) -> None:
    if logprobs_BT.shape != old_logprobs_BT.shape or logprobs_BT.shape != advantages_BT.shape:
        raise ValueError(
            f"logprobs_BT {tuple(logprobs_BT.shape)}, old_logprobs_BT {tuple(old_logprobs_BT.shape)} and "
            f"advantages_BT {tuple(advantages_BT.shape)} must have one shape"
        )
    if mask_BT is not None and mask_BT.shape != logprobs_BT.shape:
        raise ValueError(
            f"mask_BT {tuple(mask_BT.shape)} must have the shape of logprobs_BT {tuple(logprobs_BT.shape)}"
        )
    if not 0 <= clip_ratio_low <= 1 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low must lie in [0, 1] (1: no lower bound) and clip_ratio_high be >= 0, "
            f"got {clip_ratio_low}, {clip_ratio_high}"
        )


def _log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor, mask_BT: Tensor | None) -> Tensor:
    """log pi - log pi_old, clamped; 0 on padding (selected, so padded NaN/-inf pass no NaN gradient)."""
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    if mask_BT is not None:
        log_ratio_BT = torch.where(mask_BT.bool(), log_ratio_BT, torch.zeros_like(log_ratio_BT))
    return log_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _clipped_surrogate(ratio_BT: Tensor, advantages_BT: Tensor, clip_ratio_low: float,
                       clip_ratio_high: float) -> tuple[Tensor, Tensor]:
    """max(-A * r, -A * clip(r, 1 - low, 1 + high)) -> (loss_BT, clipped_BT)."""
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_loss_BT = -advantages_BT * torch.clamp(ratio_BT, 1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(unclipped_BT, clipped_loss_BT), clipped_loss_BT > unclipped_BT


def ppo_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_ratio: float | None = None,
    mask_BT: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017), optionally dual-clipped (Ye et al. 2020).

    ratio = exp(logprobs - old_logprobs); loss = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high)).
    A `clip_ratio_high` above `clip_ratio_low` is DAPO's decoupled clip ("clip-higher").
    Dual clip: for A < 0 the loss is further capped at -A * dual_clip_ratio (a constant, no
    gradient), so a huge ratio on a bad action cannot blow the update up. The log-ratio is
    clamped to [-20, 20]; with `mask_BT`, padded tokens have ratio 1 and pass no gradient.
    """
    _check_policy_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, clip_ratio_low, clip_ratio_high)
    if dual_clip_ratio is not None and dual_clip_ratio <= 1:
        raise ValueError(f"dual_clip_ratio must be > 1 (or None), got {dual_clip_ratio}")
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    loss_BT, clipped_BT = _clipped_surrogate(ratio_BT, advantages_BT, clip_ratio_low, clip_ratio_high)
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


def gspo_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    mask_BT: Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): sequence-level, length-normalised ratio with sequence-level clipping.

    s_i = exp(mean over real tokens of (logprobs - old_logprobs)), the geometric mean of the token
    ratios, clipped to [1 - low, 1 + high] as PPO clips a token ratio. Per token the loss is
    written in GSPO-token form, s_i,t = sg(s_i) * pi(t) / sg(pi(t)): its value is s_i on every
    token and with "seq-mean-token-mean" aggregation the gradient is exactly GSPO's,
    A_i * grad s_i (clipped sequences get none). A fully masked row has s = 1.
    """
    _check_policy_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, clip_ratio_low, clip_ratio_high)
    real_BT = torch.ones_like(logprobs_BT, dtype=torch.bool) if mask_BT is None else mask_BT.bool()
    token_log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, real_BT)
    count_B = real_BT.sum(dim=-1).clamp(min=1)
    sequence_log_ratio_B = token_log_ratio_BT.sum(dim=-1) / count_B
    # value: log s_i on every token; gradient: that of log pi(t) alone
    log_ratio_BT = sequence_log_ratio_B.detach()[:, None] + logprobs_BT - logprobs_BT.detach()
    log_ratio_BT = torch.where(real_BT, log_ratio_BT, torch.zeros_like(log_ratio_BT))
    ratio_BT = torch.exp(log_ratio_BT)
    loss_BT, clipped_BT = _clipped_surrogate(ratio_BT, advantages_BT, clip_ratio_low, clip_ratio_high)
    token_ratio_BT = torch.exp(token_log_ratio_BT)
    return PolicyLossOutput(
        loss_BT=loss_BT,
        ratio_BT=ratio_BT.detach(),
        clipped_BT=clipped_BT,
        dual_clipped_BT=torch.zeros_like(clipped_BT),
        approx_kl_BT=(token_ratio_BT - 1 - token_log_ratio_BT).detach(),
    )


def cispo_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    *,
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 0.28,
    mask_BT: Tensor | None = None,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by a clipped, stop-gradient importance ratio.

    w = sg(clip(ratio, 1 - low, 1 + high)); gradient = -A * w * grad log pi on every token, so a
    clipped token still gets a (bounded) gradient, unlike PPO where it gets none. MiniMax-M1 sets
    no lower bound (the default `clip_ratio_low=1`: 1 - low = 0) and tunes only the upper one;
    the default `clip_ratio_high=0.28` is DAPO's clip-higher value, not one from the CISPO paper. The per-token
    loss is -A * w * (1 + logprobs - sg(logprobs)): its value is -A * w (comparable to PPO's
    loss), its gradient CISPO's. `clipped_BT` marks tokens whose ratio was clipped.
    """
    _check_policy_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, clip_ratio_low, clip_ratio_high)
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT).detach()
    weight_BT = torch.clamp(ratio_BT, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_BT = weight_BT != ratio_BT
    # the gradient path: logprobs - sg(logprobs) is 0 in value; padded tokens are cut off by selection
    score_BT = logprobs_BT - logprobs_BT.detach()
    if mask_BT is not None:
        score_BT = torch.where(mask_BT.bool(), score_BT, torch.zeros_like(score_BT))
    loss_BT = -advantages_BT * weight_BT * (1 + score_BT)
    return PolicyLossOutput(
        loss_BT=loss_BT,
        ratio_BT=ratio_BT,
        clipped_BT=clipped_BT,
        dual_clipped_BT=torch.zeros_like(clipped_BT),
        approx_kl_BT=(ratio_BT - 1 - log_ratio_BT).detach(),
    )


POLICY_LOSSES = {"ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}
"""Policy objectives by config name. Each is fn(logprobs_BT, old_logprobs_BT, advantages_BT, *,
clip_ratio_low, clip_ratio_high, mask_BT) -> PolicyLossOutput ("ppo" also takes dual_clip_ratio)."""


@dataclass(frozen=True)
class TruncatedImportanceWeights:
    """Truncated importance sampling weights against the behaviour (rollout) policy."""

    weights_BT: Tensor
    """min(pi_old / pi_behaviour, cap) per token, detached; 0 on padding."""
    cap_fraction: Tensor
    """Fraction of real tokens where the cap binds (a scalar; 0 for a batch without real tokens)."""


def truncated_importance_weights(
    old_logprobs_BT: Tensor, behaviour_logprobs_BT: Tensor, mask_BT: Tensor, *, cap: float = 2.0
) -> TruncatedImportanceWeights:
    """TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").

    The rollout engine samples from pi_behaviour, which differs from the trainer's pi_old (other
    kernels, precision); each token's policy loss is multiplied by w = min(exp(old - behaviour), cap)
    to correct for it. Multiply `PolicyLossOutput.loss_BT` by `weights_BT` before aggregating.
    """
    if old_logprobs_BT.shape != behaviour_logprobs_BT.shape or old_logprobs_BT.shape != mask_BT.shape:
        raise ValueError(
            f"old_logprobs_BT {tuple(old_logprobs_BT.shape)}, behaviour_logprobs_BT "
            f"{tuple(behaviour_logprobs_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must have one shape"
        )
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1 (a weight cap below 1 would down-weight on-policy tokens), got {cap}")
    real_BT = mask_BT.bool()
    log_ratio_BT = _log_ratio(old_logprobs_BT.detach(), behaviour_logprobs_BT.detach(), real_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    weights_BT = torch.where(real_BT, ratio_BT.clamp(max=cap), torch.zeros_like(ratio_BT))
    capped_count = (real_BT & (ratio_BT > cap)).sum().to(ratio_BT.dtype)
    cap_fraction = capped_count / real_BT.sum().clamp(min=1).to(ratio_BT.dtype)
    return TruncatedImportanceWeights(weights_BT=weights_BT, cap_fraction=cap_fraction)


@dataclass(frozen=True)
class LogprobMismatch:
    """How far the rollout engine's sampled log-probs are from the training engine's (scalars)."""

    mean_abs_diff: Tensor
    """Mean over real tokens of |log pi_old - log pi_rollout|."""
    max_abs_diff: Tensor
    """Largest |log pi_old - log pi_rollout| over real tokens."""
    sequence_kl: Tensor
    """Mean over sequences of sum_t k3(t), k3 = r - log r - 1 with r = pi_old / pi_rollout: an unbiased,
    non-negative estimate of KL(pi_rollout || pi_old) per sequence from the rollout's own samples."""


def rollout_logprob_mismatch(old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor) -> LogprobMismatch:
    """The mismatch between a rollout engine (vLLM, another precision) and the training engine on the sampled
    tokens; what truncated importance sampling (`truncated_importance_weights`) corrects for."""
    if old_logprobs_BT.shape != rollout_logprobs_BT.shape or old_logprobs_BT.shape != mask_BT.shape:
        raise ValueError(f"old_logprobs_BT {tuple(old_logprobs_BT.shape)}, rollout_logprobs_BT "
                         f"{tuple(rollout_logprobs_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must have one shape")
    real_BT = mask_BT.bool()
    log_ratio_BT = _log_ratio(old_logprobs_BT.detach().float(), rollout_logprobs_BT.detach().float(), real_BT)
    abs_BT = log_ratio_BT.abs()
    k3_BT = torch.where(real_BT, torch.exp(log_ratio_BT) - log_ratio_BT - 1, torch.zeros_like(log_ratio_BT))
    return LogprobMismatch(mean_abs_diff=abs_BT[real_BT].mean() if real_BT.any() else abs_BT.sum(),
                           max_abs_diff=abs_BT.max(), sequence_kl=k3_BT.sum(-1).mean())


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    *,
    clip_range: float | None = 0.2,
    mask_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO) -> (loss_BT, clipped_BT).

    loss = 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = old_V + clip(V - old_V, -c, c);
    `clip_range=None` gives the plain 0.5 * (V - R)^2. clipped_BT marks tokens where the clipped
    term was the larger one. With `mask_BT`, padded tokens have loss 0 and pass no gradient,
    whatever values or returns they hold.
    """
    if not values_BT.shape == old_values_BT.shape == returns_BT.shape:
        raise ValueError(
            f"values_BT {tuple(values_BT.shape)}, old_values_BT {tuple(old_values_BT.shape)} and "
            f"returns_BT {tuple(returns_BT.shape)} must have one shape"
        )
    if mask_BT is not None:
        real_BT = mask_BT.bool()
        # select before squaring: the square's gradient at a padded NaN would be 0 * NaN
        values_BT = torch.where(real_BT, values_BT, torch.zeros_like(values_BT))
        old_values_BT = torch.where(real_BT, old_values_BT, torch.zeros_like(old_values_BT))
        returns_BT = torch.where(real_BT, returns_BT, torch.zeros_like(returns_BT))
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
