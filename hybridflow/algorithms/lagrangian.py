"""Safe-RLHF's Lagrange multiplier: gradient ascent on lambda for the constraint E[cost] <= cost_limit."""

from __future__ import annotations

import math


def lagrange_multiplier_update(
    log_lambda: float, mean_cost: float, *, cost_limit: float, lr: float, max_lambda: float | None = None
) -> float:
    """One step of the Lagrangian dual update of Safe-RLHF (Dai et al. 2024) -> new log_lambda.

    lambda = exp(log_lambda) is kept positive through its log. The dual objective
    lambda * (J_C - d) is ascended in log_lambda:
        log_lambda += lr * (mean_cost - cost_limit) * lambda,
    so lambda grows while the measured cost J_C exceeds the limit d and shrinks once it is below.
    `max_lambda` caps lambda (the paper's lambda_max), bounding how far the cost term can dominate.
    """
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not math.isfinite(mean_cost):
        raise ValueError(f"mean_cost must be finite, got {mean_cost}")
    if max_lambda is not None and max_lambda <= 0:
        raise ValueError(f"max_lambda must be > 0 (or None), got {max_lambda}")
    new_log_lambda = log_lambda + lr * (mean_cost - cost_limit) * math.exp(log_lambda)
    if max_lambda is not None:
        new_log_lambda = min(new_log_lambda, math.log(max_lambda))
    return new_log_lambda
