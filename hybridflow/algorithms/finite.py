"""Guarding training steps against non-finite numbers: find the first NaN/inf among named quantities."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from hybridflow.algorithms.names import NON_FINITE_ACTIONS


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or inf; raised before the optimizer could write it into the weights."""

    def __init__(self, message: str, *, quantity: str) -> None:
        super().__init__(message)
        self.quantity = quantity
        """Name of the first non-finite quantity (e.g. "loss", "kl_loss", "grad_norm")."""


def first_non_finite(named: Mapping[str, Tensor | float]) -> str | None:
    """Name of the first quantity (in the mapping's order) holding a NaN or inf, or None if all are finite."""
    for name, value in named.items():
        if isinstance(value, Tensor):
            if not bool(torch.isfinite(value).all()):
                return name
        elif not math.isfinite(float(value)):
            return name
    return None


def check_non_finite_action(on_non_finite: str) -> str:
    """Validate an `on_non_finite` setting ("raise" or "skip") and return it."""
    if on_non_finite not in NON_FINITE_ACTIONS:
        raise ValueError(f"on_non_finite must be one of {NON_FINITE_ACTIONS}, got {on_non_finite!r}")
    return on_non_finite
