"""KL divergence to the reference policy: per-token estimators, KL-shaped rewards and the KL coefficient controllers.

Shape legend: B = batch (sequences), T = response tokens.
The estimators approximate KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
divergence", 2020); each returns a per-token tensor that the caller either subtracts from the
reward (`kl_shaped_rewards`) or aggregates into a loss (`masked.aggregate_loss`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hybridflow.algorithms.masked import masked_fill_padding

# k3 = exp(-x) + x - 1 grows exponentially in the log-ratio; a few tokens where the policy has
# moved far from the reference would otherwise dominate (or overflow) the loss.
LOW_VAR_KL_MAX = 10.0
# k3's log-ratio is clamped to +-LOG_RATIO_LIMIT before the exponential: exp(20) is finite in
# float32 and every |x| > 11.1 already gives k3 >= LOW_VAR_KL_MAX, so no finite value changes, but
# x = -inf (a -inf log-prob) or x < -88 no longer gives inf (NaN gradient through the final clamp).
LOG_RATIO_LIMIT = 20.0


def _k1(log_ratio_BT: Tensor) -> Tensor:
    return log_ratio_BT


def _abs(log_ratio_BT: Tensor) -> Tensor:
    return log_ratio_BT.abs()


def _k2(log_ratio_BT: Tensor) -> Tensor:
    return 0.5 * log_ratio_BT.square()


def _k3(log_ratio_BT: Tensor) -> Tensor:
    x_BT = log_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.expm1(-x_BT) + x_BT).clamp(max=LOW_VAR_KL_MAX)


KL_ESTIMATORS = {"k1": _k1, "abs": _abs, "k2": _k2, "mse": _k2, "k3": _k3, "low_var_kl": _k3}
"""Per-token KL estimators by config name; each maps the log-ratio x_BT to kl_BT."""


def kl_estimate(
    logprobs_BT: Tensor, ref_logprobs_BT: Tensor, *, estimator: str = "k1", mask_BT: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from x = log pi(a) - log pi_ref(a) -> kl_BT.

    estimator (a key of `KL_ESTIMATORS`):
      - "k1": x (unbiased, high variance, can be negative);
      - "abs": |x|;
      - "k2" / "mse": x^2 / 2 (biased, low variance);
      - "k3" / "low_var_kl": exp(-x) + x - 1 (unbiased, non-negative), clamped to <= 10, with x
        clamped to [-20, 20] first (finite for -inf log-probs, finite gradients everywhere).
    With `mask_BT`, padded positions are 0 and pass no gradient, whatever they hold (NaN, -inf).
    """
    if logprobs_BT.shape != ref_logprobs_BT.shape:
        raise ValueError(
            f"logprobs_BT {tuple(logprobs_BT.shape)} and ref_logprobs_BT {tuple(ref_logprobs_BT.shape)} differ in shape"
        )
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {tuple(KL_ESTIMATORS)}, got {estimator!r}")
    log_ratio_BT = logprobs_BT - ref_logprobs_BT
    if mask_BT is not None:
        # select before the estimator: its gradient at a padded NaN would be 0 * NaN otherwise
        log_ratio_BT = masked_fill_padding(log_ratio_BT, mask_BT)
    kl_BT = KL_ESTIMATORS[estimator](log_ratio_BT)
    return kl_BT if mask_BT is None else masked_fill_padding(kl_BT, mask_BT)


def last_token_index(mask_BT: Tensor) -> Tensor:
    """Index of the last real token of each row -> index_B; ValueError if a row has no real token."""
    has_token_B = mask_BT.bool().any(dim=-1)
    if not bool(has_token_B.all()):
        empty = torch.nonzero(~has_token_B).flatten().tolist()
        raise ValueError(f"mask_BT rows {empty} have no real token; every response needs at least one (its EOS)")
    positions_T = torch.arange(mask_BT.shape[-1], device=mask_BT.device)
    return (mask_BT.bool() * positions_T).argmax(dim=-1)


def scores_on_last_token(scores_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Token-level rewards with each sequence score on its last real token and 0 elsewhere -> rewards_BT."""
    if scores_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"scores_B must have shape {tuple(mask_BT.shape[:1])}, got {tuple(scores_B.shape)}")
    rewards_BT = torch.zeros(mask_BT.shape, dtype=scores_B.dtype, device=scores_B.device)
    rewards_BT[torch.arange(mask_BT.shape[0], device=mask_BT.device), last_token_index(mask_BT)] = scores_B
    return rewards_BT


def kl_shaped_rewards(
    scores_B: Tensor,
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    kl_coef: float,
    *,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """PPO-RLHF rewards (Ziegler et al. 2019) -> (rewards_BT, kl_BT).

    r_t = -kl_coef * KL_t on every real token, plus the sequence score on the last real token.
    kl_BT (masked, before scaling) is returned for logging and for the adaptive controller.
    """
    kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT, estimator=estimator, mask_BT=mask_BT)
    rewards_BT = scores_on_last_token(scores_B.to(logprobs_BT.dtype), mask_BT) - kl_coef * kl_BT
    return rewards_BT, kl_BT


class FixedKLController:
    """A KL coefficient that never changes; `update` is a no-op kept for a common interface."""

    def __init__(self, *, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Ignore the measurement: the coefficient is fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steer the measured KL towards `target_kl`.

    After each step: error = clip(current_kl / target_kl - 1, -0.2, 0.2) and
    value *= 1 + error * n_steps / horizon, so the coefficient grows when the policy drifts past
    the target and shrinks when it stays closer.
    """

    def __init__(self, *, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef <= 0:
            raise ValueError(f"init_kl_coef must be > 0 for an adaptive controller, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 (samples over which the coefficient adapts), got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient to the KL measured over the last `n_steps` samples."""
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
