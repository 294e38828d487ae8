"""RLHF algorithms as pure tensor functions: advantages, losses, KL penalties and controllers, DAPO filters, guards.

Registries (config name -> function) for the driver: `OUTCOME_ADVANTAGES`, `POLICY_LOSSES`,
`LOSS_AGGREGATIONS`, `KL_ESTIMATORS`; see docs/algorithms.md.
"""

from typing import TYPE_CHECKING

from hybridflow._lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools (type checkers, IDEs, tests/test_layering.py)
    from hybridflow.algorithms.advantages import (
        OUTCOME_ADVANTAGES, discounted_returns, dr_grpo_advantages, gae_advantages, group_indices, group_is_tied,
        grpo_advantages, reinforce_plus_plus_advantages, remax_advantages, rloo_advantages, safe_rlhf_advantages,
    )
    from hybridflow.algorithms.dapo import (
        dynamic_sampling_keep_mask, first_kept_groups, overlong_filter_mask, overlong_reward_penalty,
    )
    from hybridflow.algorithms.finite import (
        NON_FINITE_ACTIONS, NonFiniteError, check_non_finite_action, first_non_finite,
    )
    from hybridflow.algorithms.kl import (
        KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimate, kl_shaped_rewards, last_token_index,
        scores_on_last_token,
    )
    from hybridflow.algorithms.lagrangian import lagrange_multiplier_update
    from hybridflow.algorithms.losses import (
        POLICY_LOSSES, PolicyLossOutput, LogprobMismatch, rollout_logprob_mismatch, TruncatedImportanceWeights,
        cispo_policy_loss, entropy_from_logits, gspo_policy_loss, logprobs_from_logits, ppo_policy_loss,
        truncated_importance_weights, value_loss,
    )
    from hybridflow.algorithms.masked import (
        LOSS_AGGREGATIONS, aggregate_loss, masked_fill_padding, masked_mean, masked_sum, masked_var, masked_whiten,
    )

# submodules are imported on first use: the light config modules of this package then load without
# torch, transformers or Ray (see hybridflow/_lazy.py)
_EXPORTS = {
    "OUTCOME_ADVANTAGES": "hybridflow.algorithms.advantages",
    "discounted_returns": "hybridflow.algorithms.advantages",
    "dr_grpo_advantages": "hybridflow.algorithms.advantages",
    "gae_advantages": "hybridflow.algorithms.advantages",
    "group_indices": "hybridflow.algorithms.advantages",
    "group_is_tied": "hybridflow.algorithms.advantages",
    "grpo_advantages": "hybridflow.algorithms.advantages",
    "reinforce_plus_plus_advantages": "hybridflow.algorithms.advantages",
    "remax_advantages": "hybridflow.algorithms.advantages",
    "rloo_advantages": "hybridflow.algorithms.advantages",
    "safe_rlhf_advantages": "hybridflow.algorithms.advantages",
    "dynamic_sampling_keep_mask": "hybridflow.algorithms.dapo",
    "first_kept_groups": "hybridflow.algorithms.dapo",
    "overlong_filter_mask": "hybridflow.algorithms.dapo",
    "overlong_reward_penalty": "hybridflow.algorithms.dapo",
    "NON_FINITE_ACTIONS": "hybridflow.algorithms.finite",
    "NonFiniteError": "hybridflow.algorithms.finite",
    "check_non_finite_action": "hybridflow.algorithms.finite",
    "first_non_finite": "hybridflow.algorithms.finite",
    "KL_ESTIMATORS": "hybridflow.algorithms.kl",
    "AdaptiveKLController": "hybridflow.algorithms.kl",
    "FixedKLController": "hybridflow.algorithms.kl",
    "kl_estimate": "hybridflow.algorithms.kl",
    "kl_shaped_rewards": "hybridflow.algorithms.kl",
    "last_token_index": "hybridflow.algorithms.kl",
    "scores_on_last_token": "hybridflow.algorithms.kl",
    "lagrange_multiplier_update": "hybridflow.algorithms.lagrangian",
    "POLICY_LOSSES": "hybridflow.algorithms.losses",
    "PolicyLossOutput": "hybridflow.algorithms.losses",
    "LogprobMismatch": "hybridflow.algorithms.losses",
    "rollout_logprob_mismatch": "hybridflow.algorithms.losses",
    "TruncatedImportanceWeights": "hybridflow.algorithms.losses",
    "cispo_policy_loss": "hybridflow.algorithms.losses",
    "entropy_from_logits": "hybridflow.algorithms.losses",
    "gspo_policy_loss": "hybridflow.algorithms.losses",
    "logprobs_from_logits": "hybridflow.algorithms.losses",
    "ppo_policy_loss": "hybridflow.algorithms.losses",
    "truncated_importance_weights": "hybridflow.algorithms.losses",
    "value_loss": "hybridflow.algorithms.losses",
    "LOSS_AGGREGATIONS": "hybridflow.algorithms.masked",
    "aggregate_loss": "hybridflow.algorithms.masked",
    "masked_fill_padding": "hybridflow.algorithms.masked",
    "masked_mean": "hybridflow.algorithms.masked",
    "masked_sum": "hybridflow.algorithms.masked",
    "masked_var": "hybridflow.algorithms.masked",
    "masked_whiten": "hybridflow.algorithms.masked",
}
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
    "LogprobMismatch",
    "rollout_logprob_mismatch",
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
