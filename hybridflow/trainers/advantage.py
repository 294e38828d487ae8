"""The driver's advantage step: scores + log-probs (+ values) of one RL step -> advantages, returns and KL.

Shape legend: B = samples in the step, T = response tokens.
This is the only place the estimators differ, each one entry of ``ESTIMATORS``: PPO (``gae``) uses
the critic's values, GRPO/RLOO a group baseline over the samples of one prompt, ReMax the greedy
response's score, REINFORCE++ whitened returns. Everything else in the RL loop is shared. What the driver must
know about an estimator (needs a critic, group-based, ...) is its ``traits`` (``trainers/estimators.py``).
Safe-RLHF runs the same estimator on the cost (``trainers/components.py``) and mixes the two with lambda.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hybridflow.algorithms import (
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    kl_shaped_rewards,
    masked_mean,
    masked_whiten,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
    scores_on_last_token,
)
from hybridflow.trainers.config.algorithm import AlgorithmSection  # defined there (no torch), used here
from hybridflow.trainers.estimators import ESTIMATOR_TRAITS, EstimatorTraits


@dataclass(frozen=True)
class AdvantageResult:
    """What the advantage step hands to the actor and critic updates."""

    advantages_BT: Tensor
    """Per-token advantages (whitened if configured); 0 on padding."""
    returns_BT: Tensor
    """Critic regression targets (GAE) or reward-to-go; 0 on padding."""
    kl_BT: Tensor
    """Per-token KL(pi_old || pi_ref) estimate (0 when there is no reference)."""
    token_rewards_BT: Tensor
    """Token-level rewards after KL shaping."""
    extra_BT: dict[str, Tensor] = field(default_factory=dict)
    """Per-token tensors a step component adds (Safe-RLHF: ``cost_advantages``, ``cost_returns``); they join the
    training batch under these keys."""


@dataclass(frozen=True)
class EstimatorInputs:
    """What an estimator may read besides the (KL-shaped) token rewards and the mask."""

    values_BT: Tensor | None
    """The critic's values (``gae``)."""
    group_ids: Sequence | Tensor
    """The prompt of each sample (group estimators)."""
    baseline_scores_B: Tensor | None
    """The greedy responses' scores (``remax``)."""
    gamma: float
    lam: float


Estimate = Callable[[Tensor, Tensor, EstimatorInputs], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: its function and what the driver must know about it."""

    estimate: Estimate
    """(rewards_BT, mask_BT, inputs) -> (advantages_BT, returns_BT)."""
    traits: EstimatorTraits
    """Needs a critic, group-based, needs a baseline generation, normalized, KL in the loss."""


def _gae(rewards_BT: Tensor, mask_BT: Tensor, inputs: EstimatorInputs) -> tuple[Tensor, Tensor]:
    if inputs.values_BT is None:
        raise ValueError("advantage_estimator 'gae' needs critic values; the critic produced none")
    return gae_advantages(rewards_BT, inputs.values_BT.to(mask_BT.dtype), mask_BT, gamma=inputs.gamma, lam=inputs.lam)


def _remax(rewards_BT: Tensor, mask_BT: Tensor, inputs: EstimatorInputs) -> tuple[Tensor, Tensor]:
    if inputs.baseline_scores_B is None:
        raise ValueError("advantage_estimator 'remax' needs the greedy responses' scores (baseline_scores_B)")
    return remax_advantages(rewards_BT, inputs.baseline_scores_B.to(mask_BT.dtype), mask_BT)


def _reinforce_plus_plus(rewards_BT: Tensor, mask_BT: Tensor, inputs: EstimatorInputs) -> tuple[Tensor, Tensor]:
    return reinforce_plus_plus_advantages(rewards_BT, mask_BT, gamma=inputs.gamma)


def _outcome(group_advantages) -> Estimate:
    """An outcome estimator: one (KL-shaped) return per response, the baseline from its prompt's group."""

    def estimate(rewards_BT: Tensor, mask_BT: Tensor, inputs: EstimatorInputs) -> tuple[Tensor, Tensor]:
        sequence_returns_B = (rewards_BT * mask_BT).sum(dim=-1)
        return group_advantages(sequence_returns_B, inputs.group_ids, mask_BT), sequence_returns_B[:, None] * mask_BT

    return estimate


_ESTIMATES: dict[str, Estimate] = {
    "gae": _gae,
    "grpo": _outcome(grpo_advantages),
    "dr_grpo": _outcome(dr_grpo_advantages),
    "remax": _remax,
    "rloo": _outcome(rloo_advantages),
    "reinforce_plus_plus": _reinforce_plus_plus,
}
ESTIMATORS: dict[str, Estimator] = {name: Estimator(_ESTIMATES[name], traits)
                                     for name, traits in ESTIMATOR_TRAITS.items()}
"""``algorithm.advantage_estimator`` -> estimator. A new estimator is one entry here and its traits in
``ESTIMATOR_TRAITS`` (and its name in ``AlgorithmSection.advantage_estimator``'s Literal, which a test keeps
equal to these keys)."""


def shaped_rewards(
    *,
    algorithm: AlgorithmSection,
    scores_B: Tensor,
    response_mask_BT: Tensor,
    old_logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor | None,
    kl_coef: float,
    dense_rewards_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The per-token rewards the estimator reads -> (rewards_BT, kl_BT): ``scores_B`` on each response's last
    token, minus ``kl_coef`` x the per-token KL to the reference when ``algorithm.kl_in_reward``, plus
    ``dense_rewards_BT`` token by token; in the old log-probs' dtype."""
    mask_BT = response_mask_BT.to(old_logprobs_BT.dtype)
    scores_B = scores_B.to(old_logprobs_BT.dtype)
    if ref_logprobs_BT is not None:
        shaping_coef = kl_coef if algorithm.kl_in_reward else 0.0
        rewards_BT, kl_BT = kl_shaped_rewards(scores_B, old_logprobs_BT, ref_logprobs_BT, mask_BT, shaping_coef)
    else:
        rewards_BT, kl_BT = scores_on_last_token(scores_B, mask_BT), torch.zeros_like(mask_BT)
    if dense_rewards_BT is not None:
        if dense_rewards_BT.shape != mask_BT.shape:
            raise ValueError(f"dense_rewards_BT must have the response shape {tuple(mask_BT.shape)}, "
                             f"got {tuple(dense_rewards_BT.shape)}")
        rewards_BT = rewards_BT + dense_rewards_BT.to(mask_BT.dtype) * mask_BT
    return rewards_BT, kl_BT


def compute_advantages(
    *,
    algorithm: AlgorithmSection,
    scores_B: Tensor,
    response_mask_BT: Tensor,
    old_logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor | None,
    values_BT: Tensor | None,
    group_ids: Sequence | Tensor,
    kl_coef: float,
    baseline_scores_B: Tensor | None = None,
    dense_rewards_BT: Tensor | None = None,
) -> AdvantageResult:
    """Shape the rewards with the KL penalty (when ``algorithm.kl_in_reward``) and run the configured estimator
    (``ESTIMATORS[algorithm.advantage_estimator]``, then whitening: ``estimate_advantages``).

    ``scores_B`` is credited on each response's last token; ``dense_rewards_BT`` (optional, e.g. a
    likelihood reward model's per-token terms) is added token by token. ``baseline_scores_B`` is ReMax's.
    """
    mask_BT = response_mask_BT.to(old_logprobs_BT.dtype)
    rewards_BT, kl_BT = shaped_rewards(algorithm=algorithm, scores_B=scores_B, response_mask_BT=response_mask_BT,
                                       old_logprobs_BT=old_logprobs_BT, ref_logprobs_BT=ref_logprobs_BT,
                                       kl_coef=kl_coef, dense_rewards_BT=dense_rewards_BT)
    inputs = EstimatorInputs(values_BT=values_BT, group_ids=group_ids, baseline_scores_B=baseline_scores_B,
                             gamma=algorithm.gamma, lam=algorithm.lam)
    advantages_BT, returns_BT = estimate_advantages(algorithm, rewards_BT, mask_BT, inputs)
    return AdvantageResult(advantages_BT=advantages_BT, returns_BT=returns_BT, kl_BT=kl_BT, token_rewards_BT=rewards_BT)


def estimate_advantages(algorithm: AlgorithmSection, rewards_BT: Tensor, mask_BT: Tensor,
                        inputs: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """The configured estimator on per-token rewards -> (advantages_BT, returns_BT), the advantages whitened over
    the real tokens when ``algorithm.whiten_advantages`` and the estimator does not normalize them itself. The
    reward's advantages and Safe-RLHF's cost advantages both come from here."""
    estimator = ESTIMATORS[algorithm.advantage_estimator]
    advantages_BT, returns_BT = estimator.estimate(rewards_BT, mask_BT, inputs)
    if algorithm.whiten_advantages and not estimator.traits.normalized:
        advantages_BT = masked_whiten(advantages_BT, mask_BT)
    return advantages_BT, returns_BT


def sequence_kl(kl_BT: Tensor, mask_BT: Tensor) -> float:
    """Mean over samples of the summed per-token KL (what the adaptive controller steers)."""
    return float((kl_BT * mask_BT.to(kl_BT.dtype)).sum(dim=-1).mean())


def token_mean(values_BT: Tensor, mask_BT: Tensor) -> float:
    """Mean over real tokens (for logging)."""
    return float(masked_mean(values_BT, mask_BT.to(values_BT.dtype)))
