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


class LagrangeController:
    """Safe-RLHF's multiplier lambda with the KL controllers' interface: ``value``, ``update``, state dicts.

    ``update(mean_cost, n_steps)`` takes one dual step (``lagrange_multiplier_update``) on the step's mean
    cost; ``value`` is lambda = exp(log_lambda), the weight of the cost advantages in the next step.
    """

    def __init__(self, *, init_lambda: float, cost_limit: float, lr: float, max_lambda: float | None = None) -> None:
        if not (math.isfinite(init_lambda) and init_lambda > 0):
            raise ValueError(f"init_lambda must be a finite float > 0, got {init_lambda}")
        if max_lambda is not None and init_lambda > max_lambda:
            raise ValueError(f"init_lambda {init_lambda} exceeds max_lambda {max_lambda}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.log_lambda = math.log(init_lambda)
        self.cost_limit, self.lr, self.max_lambda = float(cost_limit), float(lr), max_lambda

    @property
    def value(self) -> float:
        """The current multiplier lambda."""
        return math.exp(self.log_lambda)

    def update(self, mean_cost: float, n_steps: int = 1) -> None:
        """One dual-ascent step on the mean cost measured over the last ``n_steps`` samples."""
        self.log_lambda = lagrange_multiplier_update(self.log_lambda, mean_cost, cost_limit=self.cost_limit,
                                                     lr=self.lr, max_lambda=self.max_lambda)

    def state_dict(self) -> dict:
        return {"log_lambda": self.log_lambda}

    def load_state_dict(self, state: dict) -> None:
        self.log_lambda = float(state["log_lambda"])
