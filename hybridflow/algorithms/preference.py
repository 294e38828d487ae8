"""Preference losses: Bradley-Terry on pair scores, and the likelihood score of a sequence (pure tensor functions).

Shape legend: B = pairs (or sequences for ``likelihood_scores``), T = response tokens.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(chosen_scores_B: Tensor, rejected_scores_B: Tensor, *,
                       num_pairs_global: Tensor | float) -> tuple[Tensor, Tensor]:
    """(loss, margin_B): -log sigmoid(chosen - rejected) summed over these pairs and divided by the pairs of
    the whole mini-batch (so micro-batches and data-parallel ranks add up to the mean), and the margins."""
    margin_B = chosen_scores_B - rejected_scores_B
    return -F.logsigmoid(margin_B).sum() / num_pairs_global, margin_B


def likelihood_scores(logprobs_BT: Tensor, mask_BT: Tensor, beta: float) -> Tensor:
    """A likelihood reward model's score of each sequence: beta * sum of its response tokens' log-probs -> [B]."""
    return beta * (logprobs_BT * mask_BT.to(logprobs_BT.dtype)).sum(dim=-1)
