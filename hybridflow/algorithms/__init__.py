"""RLHF algorithms as pure tensor functions: advantages, losses, KL penalties and controllers, DAPO filters, guards.

Registries (config name -> function) for the driver: `OUTCOME_ADVANTAGES`, `POLICY_LOSSES`,
`LOSS_AGGREGATIONS`, `KL_ESTIMATORS`; see docs/algorithms.md.
"""

from hybridflow.algorithms.advantages import (
    OUTCOME_ADVANTAGES,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    group_indices,
    group_is_tied,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
    safe_rlhf_advantages,
)
from hybridflow.algorithms.dapo import (
    dynamic_sampling_keep_mask,
    first_kept_groups,
    overlong_filter_mask,
    overlong_reward_penalty,
)
from hybridflow.algorithms.finite import (
    NON_FINITE_ACTIONS,
    NonFiniteError,
    check_non_finite_action,
    first_non_finite,
)
from hybridflow.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_shaped_rewards,
    last_token_index,
    scores_on_last_token,
)
from hybridflow.algorithms.lagrangian import lagrange_multiplier_update
from hybridflow.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossOutput,
    TruncatedImportanceWeights,
    cispo_policy_loss,
    entropy_from_logits,
    gspo_policy_loss,
    logprobs_from_logits,
    ppo_policy_loss,
    truncated_importance_weights,
    value_loss,
)
from hybridflow.algorithms.masked import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    masked_fill_padding,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "NON_FINITE_ACTIONS",
    "OUTCOME_ADVANTAGES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "NonFiniteError",
    "PolicyLossOutput",
    "TruncatedImportanceWeights",
    "aggregate_loss",
    "check_non_finite_action",
    "cispo_policy_loss",
    "discounted_returns",
    "dr_grpo_advantages",
    "dynamic_sampling_keep_mask",
    "entropy_from_logits",
    "first_kept_groups",
    "first_non_finite",
    "gae_advantages",
    "group_indices",
    "group_is_tied",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_estimate",
    "kl_shaped_rewards",
    "lagrange_multiplier_update",
    "last_token_index",
    "logprobs_from_logits",
    "masked_fill_padding",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_filter_mask",
    "overlong_reward_penalty",
    "ppo_policy_loss",
    "reinforce_plus_plus_advantages",
    "remax_advantages",
    "rloo_advantages",
    "safe_rlhf_advantages",
    "scores_on_last_token",
    "truncated_importance_weights",
    "value_loss",
]
