"""DAPO's sample-level pieces (Yu et al. 2025): dynamic-sampling filter, overlong reward shaping and filtering.

Shape legend: B = batch (responses), T = response tokens.
DAPO's other two pieces live elsewhere: the decoupled clip range is `ppo_policy_loss`'s
`clip_ratio_low`/`clip_ratio_high`, the token-level loss is `aggregate_loss(aggregation="token-mean")`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybridflow.algorithms.advantages import group_indices, group_is_tied


def dynamic_sampling_keep_mask(scores_B: Tensor, group_ids: Tensor | Sequence) -> Tensor:
    """True for each response whose group's scores are not all equal -> keep_B (bool).

    A group whose responses all score the same (all right or all wrong) has zero advantage under
    any group baseline, so it adds no gradient, only noise to the batch size; DAPO drops such
    groups and samples more prompts until the batch is full.
    """
    if scores_B.dim() != 1:
        raise ValueError(f"scores_B must be 1-D (one score per response), got shape {tuple(scores_B.shape)}")
    index_B = group_indices(group_ids).to(scores_B.device)
    if index_B.shape != scores_B.shape:
        raise ValueError(f"group_ids has {index_B.numel()} entries for {scores_B.numel()} scores")
    return ~group_is_tied(scores_B, index_B)


def first_kept_groups(keep_B: Tensor, group_ids: Tensor | Sequence, *, num_groups: int) -> tuple[Tensor, int]:
    """Rows of the first `num_groups` kept groups, in order of first appearance -> (rows_R, groups_kept).

    The driver's dynamic-sampling loop: concatenate the responses of each sampling round, compute
    `keep_B = dynamic_sampling_keep_mask(...)`, and stop drawing when `groups_kept >= num_groups`
    (or at its round limit); `rows_R` then selects a full batch. `groups_kept` counts every kept
    group seen, so it may exceed `num_groups`; `rows_R` never holds more than `num_groups` groups.
    """
    if num_groups <= 0:
        raise ValueError(f"num_groups must be > 0, got {num_groups}")
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else group_ids
    index_B = group_indices(ids).to(keep_B.device)  # a list's ids are numbered in order of first appearance
    if index_B.shape != keep_B.shape:
        raise ValueError(f"group_ids has {index_B.numel()} entries for {keep_B.numel()} keep flags")
    kept_groups = torch.unique(index_B[keep_B.bool()])  # sorted = order of first appearance
    chosen_B = torch.isin(index_B, kept_groups[:num_groups]) & keep_B.bool()
    return torch.nonzero(chosen_B).flatten(), int(kept_groups.numel())


def _check_lengths(response_lengths_B: Tensor, max_response_length: int) -> None:
    if response_lengths_B.dim() != 1:
        raise ValueError(f"response_lengths_B must be 1-D, got shape {tuple(response_lengths_B.shape)}")
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0, got {max_response_length}")


def overlong_reward_penalty(
    response_lengths_B: Tensor, *, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment -> penalty_B (<= 0), to be added to the scores.

    With L = length, L_max = max_response_length and L_buf = buffer_length:
    0 for L <= L_max - L_buf; -penalty_factor * (L - (L_max - L_buf)) / L_buf inside the buffer
    (a linear ramp from 0 to -penalty_factor); -penalty_factor for L > L_max.
    """
    _check_lengths(response_lengths_B, max_response_length)
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must lie in (0, max_response_length={max_response_length}], got {buffer_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    excess_B = response_lengths_B.double() - (max_response_length - buffer_length)
    penalty_B = -penalty_factor * (excess_B / buffer_length).clamp(min=0.0, max=1.0)
    return penalty_B.to(torch.get_default_dtype())


def overlong_filter_mask(
    response_lengths_B: Tensor, *, max_response_length: int, ended_B: Tensor | None = None
) -> Tensor:
    """DAPO's overlong filtering -> keep_B (bool): False for truncated responses, whose loss is masked out.

    A response is truncated when it reached `max_response_length` without ending; pass `ended_B`
    (True where the response ended with EOS) to keep a response that ended exactly at the limit.
    Use as `mask_BT & keep_B[:, None]` so a truncated response neither gains nor loses probability.
    """
    _check_lengths(response_lengths_B, max_response_length)
    keep_B = response_lengths_B < max_response_length
    if ended_B is not None:
        if ended_B.shape != response_lengths_B.shape:
            raise ValueError(f"ended_B must have shape {tuple(response_lengths_B.shape)}, got {tuple(ended_B.shape)}")
        keep_B = keep_B | ended_B.bool()
    return keep_B
