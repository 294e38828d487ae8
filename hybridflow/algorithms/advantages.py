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

from hybridflow.algorithms.masked import masked_whiten


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"expected tensors of one shape, got {shapes}")


def discounted_returns(rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = sum_{k >= t} gamma^(k - t) r_k over real tokens only -> returns_BT.

    Masked-out positions are skipped (they neither add reward nor count as a discount step).
    """
    _check_same_shape(rewards_BT=rewards_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.to(rewards_BT.dtype)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    returns_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        mask_B = mask_BT[:, t]
        updated_B = rewards_BT[:, t] + gamma * running_B
        running_B = mask_B * updated_B + (1 - mask_B) * running_B
        returns_BT[:, t] = running_B
    return returns_BT * mask_BT


def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) -> (advantages_BT, returns_BT).

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
    returns_t = A_t + V_t (the critic's regression target). The episode ends after the last real
    token (V after it is 0). Masked-out positions are skipped: the next real token's value and
    advantage carry across them, so a mask with holes (e.g. tool output inside a response) works.
    """
    _check_same_shape(rewards_BT=rewards_BT, values_BT=values_BT, mask_BT=mask_BT)
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    mask_BT = mask_BT.to(values_BT.dtype)
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_advantage_B = torch.zeros_like(values_BT[:, 0])
    advantages_BT = torch.zeros_like(values_BT)
    for t in reversed(range(values_BT.shape[1])):
        mask_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        next_advantage_B = mask_B * advantage_B + (1 - mask_B) * next_advantage_B
        next_value_B = mask_B * values_BT[:, t] + (1 - mask_B) * next_value_B
        advantages_BT[:, t] = advantage_B
    advantages_BT = advantages_BT * mask_BT
    returns_BT = (advantages_BT + values_BT) * mask_BT
    return advantages_BT, returns_BT


def remax_advantages(
    rewards_BT: Tensor, baseline_rewards_B: Tensor, mask_BT: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023) -> (advantages_BT, returns_BT).

    returns_t = sum_{k >= t} r_k (undiscounted reward-to-go of the sampled response) and
    A_t = returns_t - b, where b is the reward of the greedy response to the same prompt.
    With an outcome-only reward, returns_t is the score at every token and A = score - b.
    """
    _check_same_shape(rewards_BT=rewards_BT, mask_BT=mask_BT)
    if baseline_rewards_B.shape != rewards_BT.shape[:1]:
        raise ValueError(
            f"baseline_rewards_B must have shape {tuple(rewards_BT.shape[:1])}, got {tuple(baseline_rewards_B.shape)}"
        )
    returns_BT = discounted_returns(rewards_BT, mask_BT, gamma=1.0)
    advantages_BT = (returns_BT - baseline_rewards_B[:, None]) * mask_BT.to(returns_BT.dtype)
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


def _prepare_groups(scores_B: Tensor, group_ids: Tensor | Sequence, method: str) -> tuple[Tensor, Tensor, Tensor]:
    if scores_B.dim() != 1:
        raise ValueError(f"{method}: scores_B must be 1-D (one score per response), got shape {tuple(scores_B.shape)}")
    index_B = group_indices(group_ids).to(scores_B.device)
    if index_B.shape != scores_B.shape:
        raise ValueError(f"{method}: group_ids has {index_B.numel()} entries for {scores_B.numel()} scores")
    group_sum_B, group_size_B = _group_sums(scores_B, index_B)
    if bool((group_size_B < 2).any()):
        raise ValueError(
            f"{method} needs at least 2 samples per prompt (a group baseline from a single sample is "
            f"undefined); got group sizes {sorted(set(group_size_B.long().tolist()))}"
        )
    return index_B, group_sum_B, group_size_B


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
    standard deviation. `normalize_by_std=False` keeps only the mean baseline (Dr. GRPO).
    """
    index_B, group_sum_B, group_size_B = _prepare_groups(scores_B, group_ids, "grpo_advantages")
    mean_B = group_sum_B / group_size_B
    advantage_B = scores_B - mean_B
    if normalize_by_std:
        squared_sum_B, _ = _group_sums((scores_B - mean_B) ** 2, index_B)
        std_B = torch.sqrt(squared_sum_B / (group_size_B - 1))
        advantage_B = advantage_B / (std_B + eps)
    return advantage_B[:, None] * mask_BT.to(scores_B.dtype)


def rloo_advantages(scores_B: Tensor, group_ids: Tensor | Sequence, mask_BT: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024) -> advantages_BT: A_i = r_i - mean of the other responses' scores.

    With k responses in the group: A_i = r_i - (sum_group - r_i) / (k - 1).
    """
    _, group_sum_B, group_size_B = _prepare_groups(scores_B, group_ids, "rloo_advantages")
    advantage_B = scores_B - (group_sum_B - scores_B) / (group_size_B - 1)
    return advantage_B[:, None] * mask_BT.to(scores_B.dtype)


def reinforce_plus_plus_advantages(
    rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025) -> (advantages_BT, returns_BT).

    returns = discounted reward-to-go of the token rewards (score on the last token, KL penalty on
    every token); advantages = returns whitened over all real tokens of the batch (the global
    batch normalization that replaces a critic).
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
