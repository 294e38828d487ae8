"""Masked reductions over token tensors: sum, mean, variance, whitening and loss aggregation.

Shape legend: B = batch (sequences), T = response tokens. A mask is 1 (or True) for real tokens
and 0 for padding; every function ignores masked-out positions entirely.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is set (over `dim`, or over everything when `dim` is None)."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is set; an all-masked slice has mean 0 (not NaN)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of the masked-in entries of `values` (a scalar).

    Raises ValueError when fewer than 2 entries are masked in (1 when `unbiased` is False): the
    variance of so few values is undefined and would silently become 0 or NaN downstream.
    """
    count = int(mask.sum().item())
    minimum = 2 if unbiased else 1
    if count < minimum:
        raise ValueError(f"masked_var needs at least {minimum} masked-in values, got mask with {count}")
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize the masked-in entries to zero mean and unit variance; padding becomes 0.

    With `shift_mean=False` the mean is added back (only the scale changes), as PPO
    implementations do for rewards.
    """
    mean = masked_mean(values, mask)
    variance = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    *,
    aggregation: str = "token-mean",
    num_tokens_global: float | None = None,
    num_sequences_global: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    aggregation:
      - "token-mean": sum over all real tokens / number of real tokens;
      - "seq-mean-token-sum": per sequence, sum over its tokens; then mean over sequences;
      - "seq-mean-token-mean": per sequence, mean over its tokens; then mean over sequences.
    The denominators default to this batch's counts. When a batch is split into micro-batches
    whose gradients are accumulated, pass the whole batch's counts (`num_tokens_global` for
    "token-mean", `num_sequences_global` for the seq-mean modes): the micro-batch losses then add
    up exactly to the whole-batch loss, whatever the split.
    """
    mask = mask_BT.to(loss_BT.dtype)
    if aggregation == "token-mean":
        denominator = mask.sum() if num_tokens_global is None else num_tokens_global
        return (loss_BT * mask).sum() / denominator
    if aggregation == "seq-mean-token-sum":
        per_sequence_B = (loss_BT * mask).sum(dim=-1)
    elif aggregation == "seq-mean-token-mean":
        per_sequence_B = (loss_BT * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    else:
        raise ValueError(f"aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")
    denominator = loss_BT.shape[0] if num_sequences_global is None else num_sequences_global
    return per_sequence_B.sum() / denominator
