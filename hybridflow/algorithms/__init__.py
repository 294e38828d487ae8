"""RLHF algorithms as pure tensor functions: advantages, losses, KL penalties and controllers, Safe-RLHF multiplier."""

from hybridflow.algorithms.advantages import (
    discounted_returns,
    gae_advantages,
    group_indices,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
    safe_rlhf_advantages,
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
    PolicyLossOutput,
    entropy_from_logits,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)
from hybridflow.algorithms.masked import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "PolicyLossOutput",
    "aggregate_loss",
    "discounted_returns",
    "entropy_from_logits",
    "gae_advantages",
    "group_indices",
    "grpo_advantages",
    "kl_estimate",
    "kl_shaped_rewards",
    "lagrange_multiplier_update",
    "last_token_index",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "reinforce_plus_plus_advantages",
    "remax_advantages",
    "rloo_advantages",
    "safe_rlhf_advantages",
    "scores_on_last_token",
    "value_loss",
]
