"""Masked reductions over token tensors: sum, mean, variance, whitening and loss aggregation.

Shape legend: B = batch (sequences), T = response tokens. A mask is 1 (or True) for real tokens
and 0 for padding; every function ignores masked-out positions entirely: padding is removed by
selection (`torch.where`), never by multiplying with the mask, so a NaN or inf in padding
(0 * inf = NaN) cannot reach a real token's result or gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def masked_fill_padding(values: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """`values` on real tokens, `fill` on padding (by selection: NaN/inf in padding disappear)."""
    return torch.where(mask.bool(), values, torch.full_like(values, fill))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is set (over `dim`, or over everything when `dim` is None)."""
    selected = masked_fill_padding(values, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is set; an all-masked slice has mean 0 (not NaN)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of the masked-in entries of `values` (a scalar).

    Raises ValueError when fewer than 2 entries are masked in (1 when `unbiased` is False): the
    variance of so few values is undefined and would silently become 0 or NaN downstream.
    """
    count = int(mask.bool().sum().item())
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
    return masked_fill_padding(whitened, mask)


# ------------------------------------------------------------------ loss aggregation
# Each mode: (loss_BT, mask_BT, num_tokens, num_sequences, constant_normalizer) -> scalar. The counts
# are the whole mini-batch's (see `aggregate_loss`), so micro-batch losses add up to the batch loss.
def _token_mean(loss_BT: Tensor, mask_BT: Tensor, num_tokens, num_sequences, constant_normalizer) -> Tensor:
    return masked_sum(loss_BT, mask_BT) / num_tokens


def _seq_mean_token_sum(loss_BT: Tensor, mask_BT: Tensor, num_tokens, num_sequences, constant_normalizer) -> Tensor:
    return masked_sum(loss_BT, mask_BT, dim=-1).sum() / num_sequences


def _seq_mean_token_mean(loss_BT: Tensor, mask_BT: Tensor, num_tokens, num_sequences, constant_normalizer) -> Tensor:
    return masked_mean(loss_BT, mask_BT, dim=-1).sum() / num_sequences


def _seq_mean_token_sum_norm(loss_BT: Tensor, mask_BT: Tensor, num_tokens, num_sequences,
                             constant_normalizer) -> Tensor:
    # Dr. GRPO: every token weighs the same in every batch; the divisor never depends on lengths.
    return masked_sum(loss_BT, mask_BT) / (num_sequences * constant_normalizer)


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
"""Loss aggregation modes by config name (see `aggregate_loss`)."""


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    *,
    aggregation: str = "token-mean",
    num_tokens_global: float | Tensor | None = None,
    num_sequences_global: float | Tensor | None = None,
    constant_normalizer: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    aggregation (a key of `LOSS_AGGREGATIONS`):
      - "token-mean": sum over all real tokens / number of real tokens (DAPO's token-level loss);
      - "seq-mean-token-sum": per sequence, sum over its tokens; then mean over sequences;
      - "seq-mean-token-mean": per sequence, mean over its tokens; then mean over sequences
        (DeepSeekMath's GRPO, GSPO);
      - "seq-mean-token-sum-norm": sum over all real tokens / (sequences * constant_normalizer)
        (Dr. GRPO: a constant, usually the maximum response length; default T = loss_BT.shape[-1]).
    The denominators default to this batch's counts. When a batch is split into micro-batches
    whose gradients are accumulated, pass the whole batch's counts (`num_tokens_global` for
    "token-mean", `num_sequences_global` for the seq-mean modes): the micro-batch losses then add
    up exactly to the whole-batch loss, whatever the split.
    """
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {tuple(LOSS_AGGREGATIONS)}, got {aggregation!r}")
    if constant_normalizer is not None and constant_normalizer <= 0:
        raise ValueError(
            f"constant_normalizer must be > 0 (e.g. the maximum response length), got {constant_normalizer}"
        )
    # a batch without real tokens has loss 0 (not 0/0 = NaN)
    num_tokens = mask_BT.to(loss_BT.dtype).sum().clamp(min=1) if num_tokens_global is None else num_tokens_global
    num_sequences = loss_BT.shape[0] if num_sequences_global is None else num_sequences_global
    normalizer = loss_BT.shape[-1] if constant_normalizer is None else constant_normalizer
    return LOSS_AGGREGATIONS[aggregation](loss_BT, mask_BT, num_tokens, num_sequences, normalizer)
