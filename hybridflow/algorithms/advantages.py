"""Advantage estimators: GAE (PPO), ReMax, GRPO, RLOO and REINFORCE++.

Shape legend: B = batch (sequences, i.e. responses), T = response tokens.
Token-level rewards `rewards_BT` are what `kl.kl_shaped_rewards` (or `scores_on_last_token`)
produce: the sequence score on the last real token plus any per-token KL penalty. Outcome
methods (GRPO, RLOO) take one score per response, `scores_B`. Masked-out positions of every
returned tensor are 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybridflow.algorithms.masked import masked_fill_padding, masked_whiten


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"expected tensors of one shape, got {shapes}")


def discounted_returns(rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = sum_{k >= t} gamma^(k - t) r_k over real tokens only -> returns_BT.

    Masked-out positions are skipped (they neither add reward nor count as a discount step); their
    values are never read, so NaN or inf there cannot leak into real tokens.
    """
    _check_same_shape(rewards_BT=rewards_BT, mask_BT=mask_BT)
    real_BT = mask_BT.bool()
    running_B = torch.zeros_like(rewards_BT[:, 0])
    returns_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        running_B = torch.where(real_BT[:, t], rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B
    return masked_fill_padding(returns_BT, real_BT)


def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) -> (advantages_BT, returns_BT).

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
    returns_t = A_t + V_t (the critic's regression target). The episode ends after the last real
    token (V after it is 0). Masked-out positions are skipped: the next real token's value and
    advantage carry across them, so a mask with holes (e.g. tool output inside a response) works.
    Padding is dropped by selection, so NaN/inf rewards or values there do not reach real tokens.
    """
    _check_same_shape(rewards_BT=rewards_BT, values_BT=values_BT, mask_BT=mask_BT)
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    real_BT = mask_BT.bool()
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_advantage_B = torch.zeros_like(values_BT[:, 0])
    advantages_BT = torch.zeros_like(values_BT)
    for t in reversed(range(values_BT.shape[1])):
        real_B = real_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        next_advantage_B = torch.where(real_B, advantage_B, next_advantage_B)
        next_value_B = torch.where(real_B, values_BT[:, t], next_value_B)
        advantages_BT[:, t] = advantage_B
    returns_BT = masked_fill_padding(advantages_BT + values_BT, real_BT)
    return masked_fill_padding(advantages_BT, real_BT), returns_BT


def remax_advantages(
    rewards_BT: Tensor, baseline_rewards_B: Tensor, mask_BT: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023) -> a tuple ``(advantages_BT, returns_BT)`` of two [B, T] tensors.

    returns_t = sum_{k >= t} r_k (undiscounted reward-to-go of the sampled response) and
    A_t = returns_t - b, where b is the reward of the greedy response to the same prompt.
    With an outcome-only reward, returns_t is the score at every token and A = score - b.
    Both are 0 on masked-out positions. The policy loss uses only ``advantages_BT``; ``returns_BT``
    (what a critic would regress on; ReMax has none) is returned for logging (the trainer's
    ``return/mean``), like GAE's and REINFORCE++'s, so every token-level estimator has one signature.
    """
    _check_same_shape(rewards_BT=rewards_BT, mask_BT=mask_BT)
    if baseline_rewards_B.shape != rewards_BT.shape[:1]:
        raise ValueError(
            f"baseline_rewards_B must have shape {tuple(rewards_BT.shape[:1])}, got {tuple(baseline_rewards_B.shape)}"
        )
    returns_BT = discounted_returns(rewards_BT, mask_BT, gamma=1.0)
    advantages_BT = masked_fill_padding(returns_BT - baseline_rewards_B[:, None], mask_BT)
    return advantages_BT, returns_BT


def group_indices(group_ids: Tensor | Sequence) -> Tensor:
    """Map arbitrary group ids (a tensor, or strings such as prompt uids) to 0..num_groups-1 -> index_B."""
    if isinstance(group_ids, Tensor):
        return torch.unique(group_ids, return_inverse=True)[1]
    first_seen: dict = {}
    return torch.tensor([first_seen.setdefault(group_id, len(first_seen)) for group_id in group_ids])


def _group_sums(scores_B: Tensor, index_B: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample sum of its group's scores and its group's size -> (group_sum_B, group_size_B)."""
    num_groups = int(index_B.max().item()) + 1
    sums_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device).index_add_(0, index_B, scores_B)
    sizes_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device).index_add_(
        0, index_B, torch.ones_like(scores_B)
    )
    return sums_G[index_B], sizes_G[index_B]


def group_is_tied(scores_B: Tensor, index_B: Tensor) -> Tensor:
    """True for each sample whose group's scores are all exactly equal -> tied_B (bool)."""
    num_groups = int(index_B.max().item()) + 1
    empty_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device)
    max_G = empty_G.scatter_reduce(0, index_B, scores_B, reduce="amax", include_self=False)
    min_G = empty_G.scatter_reduce(0, index_B, scores_B, reduce="amin", include_self=False)
    return (max_G == min_G)[index_B]


def _prepare_groups(scores_B: Tensor, group_ids: Tensor | Sequence, method: str) -> tuple[Tensor, Tensor, Tensor]:
    """Group index, group sum and group size per sample, in float64 -> (index_B, group_sum_B, group_size_B).

    float64 because the training loop's float32 leaves a rounding residue in mean(group) - r_i that
    std normalization then blows up (a tied group of 8 scores of 0.7 got advantages of +0.056).
    """
    if scores_B.dim() != 1:
        raise ValueError(f"{method}: scores_B must be 1-D (one score per response), got shape {tuple(scores_B.shape)}")
    index_B = group_indices(group_ids).to(scores_B.device)
    if index_B.shape != scores_B.shape:
        raise ValueError(f"{method}: group_ids has {index_B.numel()} entries for {scores_B.numel()} scores")
    group_sum_B, group_size_B = _group_sums(scores_B.double(), index_B)
    if bool((group_size_B < 2).any()):
        raise ValueError(
            f"{method} needs at least 2 samples per prompt (a group baseline from a single sample is "
            f"undefined); got group sizes {sorted(set(group_size_B.long().tolist()))}"
        )
    return index_B, group_sum_B, group_size_B


def _outcome_to_tokens(advantage_B: Tensor, scores_B: Tensor, index_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Broadcast a float64 per-response advantage to its real tokens, in the scores' dtype -> advantages_BT.

    A group whose scores are all equal gets exactly 0.
    """
    advantage_B = torch.where(group_is_tied(scores_B, index_B), torch.zeros_like(advantage_B), advantage_B)
    return masked_fill_padding(advantage_B.to(scores_B.dtype)[:, None].expand(mask_BT.shape), mask_BT)


def grpo_advantages(
    scores_B: Tensor,
    group_ids: Tensor | Sequence,
    mask_BT: Tensor,
    *,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024) -> advantages_BT.

    A_i = (r_i - mean(group)) / (std(group) + eps) on every real token of response i, where the
    group is the responses sharing i's group id (the same prompt) and std is the unbiased sample
    standard deviation. `normalize_by_std=False` keeps only the mean baseline (Dr. GRPO). Group
    statistics are computed in float64 and a group whose scores are all equal gets exactly 0.
    """
    index_B, group_sum_B, group_size_B = _prepare_groups(scores_B, group_ids, "grpo_advantages")
    scores64_B = scores_B.double()
    mean_B = group_sum_B / group_size_B
    advantage_B = scores64_B - mean_B
    if normalize_by_std:
        squared_sum_B, _ = _group_sums(advantage_B.square(), index_B)
        std_B = torch.sqrt(squared_sum_B / (group_size_B - 1))
        advantage_B = advantage_B / (std_B + eps)
    return _outcome_to_tokens(advantage_B, scores_B, index_B, mask_BT)


def dr_grpo_advantages(scores_B: Tensor, group_ids: Tensor | Sequence, mask_BT: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025) -> advantages_BT: A_i = r_i - mean(group), no std normalization.

    Pair it with the "seq-mean-token-sum-norm" loss aggregation (no length normalization either).
    """
    return grpo_advantages(scores_B, group_ids, mask_BT, normalize_by_std=False)


def rloo_advantages(scores_B: Tensor, group_ids: Tensor | Sequence, mask_BT: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024) -> advantages_BT: A_i = r_i - mean of the other responses' scores.

    With k responses in the group: A_i = r_i - (sum_group - r_i) / (k - 1), in float64; a group
    whose scores are all equal gets exactly 0.
    """
    index_B, group_sum_B, group_size_B = _prepare_groups(scores_B, group_ids, "rloo_advantages")
    scores64_B = scores_B.double()
    advantage_B = scores64_B - (group_sum_B - scores64_B) / (group_size_B - 1)
    return _outcome_to_tokens(advantage_B, scores_B, index_B, mask_BT)


OUTCOME_ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
"""Outcome (group-baseline) estimators by config name; each is fn(scores_B, group_ids, mask_BT) -> advantages_BT."""


def reinforce_plus_plus_advantages(
    rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025) -> a tuple ``(advantages_BT, returns_BT)`` of two [B, T] tensors.

    returns = discounted reward-to-go of the token rewards (score on the last token, KL penalty on
    every token); advantages = returns whitened over all real tokens of the batch (the global
    batch normalization that replaces a critic). Both are 0 on masked-out positions. The policy
    loss uses only ``advantages_BT``; ``returns_BT`` (the un-whitened reward-to-go) is returned for
    logging (the trainer's ``return/mean``), as GAE and ReMax return theirs.
    """
    returns_BT = discounted_returns(rewards_BT, mask_BT, gamma=gamma)
    advantages_BT = masked_whiten(returns_BT, mask_BT)
    return advantages_BT, returns_BT


def safe_rlhf_advantages(
    reward_advantages_BT: Tensor, cost_advantages_BT: Tensor, lagrange_multiplier: float
) -> Tensor:
    """Safe-RLHF (Dai et al. 2024) combined advantage -> advantages_BT: (A_r - lambda * A_c) / (1 + lambda)."""
    _check_same_shape(reward_advantages_BT=reward_advantages_BT, cost_advantages_BT=cost_advantages_BT)
    if lagrange_multiplier < 0:
        raise ValueError(f"lagrange_multiplier must be >= 0, got {lagrange_multiplier}")
    return (reward_advantages_BT - lagrange_multiplier * cost_advantages_BT) / (1.0 + lagrange_multiplier)
