"""The driver's advantage step: scores + log-probs (+ values) of one RL step -> advantages, returns and KL.

Shape legend: B = samples in the step, T = response tokens.
This is the only place the estimators differ, each one entry of ``ESTIMATORS``: PPO (``gae``) uses
the critic's values, GRPO/RLOO a group baseline over the samples of one prompt, ReMax the greedy
response's score, REINFORCE++ whitened returns. Everything else in the RL loop is shared. Safe-RLHF adds a second GAE on the
cost (``cost_advantages``) and mixes the two with the Lagrange multiplier (``safe_rlhf_advantages``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    safe_rlhf_advantages,
    scores_on_last_token,
)
from hybridflow.trainers.algorithm_config import AlgorithmSection  # defined there (no torch), used here


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
    cost_advantages_BT: Tensor | None = None
    """Safe-RLHF: the cost's GAE advantages (whitened if configured); None without a cost."""
    cost_returns_BT: Tensor | None = None
    """Safe-RLHF: the cost critic's regression targets; None without a cost."""


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
    needs_critic: bool = False
    """Whether it reads critic values (the critic role runs only then)."""
    normalized: bool = False
    """Whether its advantages are already normalized (then ``whiten_advantages`` is not applied again)."""
    kl_in_loss: bool = False
    """Where ``kl_mode: auto`` puts the KL to the reference: in the loss (GRPO's paper) or in the reward."""


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


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(_gae, needs_critic=True),
    "grpo": Estimator(_outcome(grpo_advantages), normalized=True, kl_in_loss=True),
    # Dr. GRPO: no std normalization, and no whitening after it either (that would put the std back)
    "dr_grpo": Estimator(_outcome(dr_grpo_advantages), normalized=True, kl_in_loss=True),
    "remax": Estimator(_remax),
    "rloo": Estimator(_outcome(rloo_advantages)),
    "reinforce_plus_plus": Estimator(_reinforce_plus_plus, normalized=True),
}
"""``algorithm.advantage_estimator`` -> estimator. A new estimator is one entry here (and its name in
``AlgorithmSection.advantage_estimator``'s Literal, which a test keeps equal to these keys)."""


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
    baseline_scores_B: Tensor | None,
    kl_coef: float,
    dense_rewards_BT: Tensor | None = None,
    costs_B: Tensor | None = None,
    cost_values_BT: Tensor | None = None,
    lagrange_multiplier: float | None = None,
) -> AdvantageResult:
    """Shape the rewards with the KL penalty (when ``algorithm.kl_in_reward``) and run the configured estimator
    (``ESTIMATORS[algorithm.advantage_estimator]``).

    ``scores_B`` is credited on each response's last token; ``dense_rewards_BT`` (optional, e.g. a
    likelihood reward model's per-token terms) is added token by token. Safe-RLHF: given ``costs_B``,
    the cost critic's ``cost_values_BT`` and the ``lagrange_multiplier`` lambda, the returned advantages
    are ``safe_rlhf_advantages(reward advantages, cost_advantages(...), lambda)`` and the cost
    advantages and returns come back too.
    """
    mask_BT = response_mask_BT.to(old_logprobs_BT.dtype)
    rewards_BT, kl_BT = shaped_rewards(algorithm=algorithm, scores_B=scores_B, response_mask_BT=response_mask_BT,
                                       old_logprobs_BT=old_logprobs_BT, ref_logprobs_BT=ref_logprobs_BT,
                                       kl_coef=kl_coef, dense_rewards_BT=dense_rewards_BT)
    estimator = ESTIMATORS[algorithm.advantage_estimator]
    inputs = EstimatorInputs(values_BT=values_BT, group_ids=group_ids, baseline_scores_B=baseline_scores_B,
                             gamma=algorithm.gamma, lam=algorithm.lam)
    advantages_BT, returns_BT = estimator.estimate(rewards_BT, mask_BT, inputs)
    if algorithm.whiten_advantages and not estimator.normalized:
        advantages_BT = masked_whiten(advantages_BT, mask_BT)
    cost_advantages_BT = cost_returns_BT = None
    if costs_B is not None:
        if cost_values_BT is None or lagrange_multiplier is None:
            raise ValueError("Safe-RLHF advantages need costs_B, cost_values_BT and lagrange_multiplier together; got "
                             f"cost_values_BT={'a tensor' if cost_values_BT is not None else None}, "
                             f"lagrange_multiplier={lagrange_multiplier}")
        cost_advantages_BT, cost_returns_BT = cost_advantages(algorithm=algorithm, costs_B=costs_B,
                                                              cost_values_BT=cost_values_BT.to(mask_BT.dtype),
                                                              response_mask_BT=mask_BT)
        advantages_BT = safe_rlhf_advantages(advantages_BT, cost_advantages_BT, lagrange_multiplier)
    return AdvantageResult(advantages_BT=advantages_BT, returns_BT=returns_BT, kl_BT=kl_BT,
                           token_rewards_BT=rewards_BT, cost_advantages_BT=cost_advantages_BT,
                           cost_returns_BT=cost_returns_BT)


def cost_advantages(
    *,
    algorithm: AlgorithmSection,
    costs_B: Tensor,
    cost_values_BT: Tensor,
    response_mask_BT: Tensor,
) -> tuple[Tensor, Tensor]:
    """Safe-RLHF's cost side -> (cost_advantages_BT, cost_returns_BT): GAE on each response's cost, credited on
    its last token (no KL term: the KL penalty shapes the reward only), with the cost critic's values and
    the reward's ``gamma``/``lam``; whitened like the reward advantages when ``whiten_advantages``."""
    if algorithm.advantage_estimator != "gae":
        raise ValueError(f"cost advantages need advantage_estimator 'gae' (a cost critic), "
                         f"got {algorithm.advantage_estimator!r}")
    mask_BT = response_mask_BT.to(cost_values_BT.dtype)
    costs_BT = scores_on_last_token(costs_B.to(mask_BT.dtype), mask_BT)
    advantages_BT, returns_BT = gae_advantages(costs_BT, cost_values_BT, mask_BT, gamma=algorithm.gamma,
                                               lam=algorithm.lam)
    if algorithm.whiten_advantages:
        advantages_BT = masked_whiten(advantages_BT, mask_BT)
    return advantages_BT, returns_BT


def sequence_kl(kl_BT: Tensor, mask_BT: Tensor) -> float:
    """Mean over samples of the summed per-token KL (what the adaptive controller steers)."""
    return float((kl_BT * mask_BT.to(kl_BT.dtype)).sum(dim=-1).mean())


def token_mean(values_BT: Tensor, mask_BT: Tensor) -> float:
    """Mean over real tokens (for logging)."""
    return float(masked_mean(values_BT, mask_BT.to(values_BT.dtype)))
