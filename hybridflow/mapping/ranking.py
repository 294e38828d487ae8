"""Rank correlation: how well predicted iteration times order configurations like measured ones."""

from __future__ import annotations

import math
from typing import Sequence


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span (so [5, 1, 5] -> [2.5, 1, 2.5])."""
    order = sorted(range(len(values)), key=lambda index: values[index])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman_correlation(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman's rho: the Pearson correlation of the two rank vectors (ties averaged), in [-1, 1]."""
    if len(predicted) != len(measured):
        raise ValueError(f"predicted has {len(predicted)} values and measured {len(measured)}; need equal lengths")
    if len(predicted) < 2:
        raise ValueError(f"rank correlation needs at least 2 configurations, got {len(predicted)}")
    predicted_ranks, measured_ranks = ranks(predicted), ranks(measured)
    mean = (len(predicted) + 1) / 2
    covariance = sum((a - mean) * (b - mean) for a, b in zip(predicted_ranks, measured_ranks))
    spread = math.sqrt(sum((a - mean) ** 2 for a in predicted_ranks) * sum((b - mean) ** 2 for b in measured_ranks))
    if spread == 0:
        raise ValueError("rank correlation is undefined when all predicted or all measured values are equal")
    return covariance / spread
