"""AlgorithmSection: the advantage estimator and KL regularization of an RL run (no torch: configs load fast).

The estimators themselves are ``hybridflow.trainers.advantage.ESTIMATORS``; their names and traits are
``hybridflow.trainers.estimators.ESTIMATOR_TRAITS`` (light; a test keeps the two tables' keys equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridflow.trainers.estimators import ESTIMATOR_TRAITS, EstimatorTraits


def _require(condition: bool, key: str, value, allowed: str) -> None:
    if not condition:
        raise ValueError(f"config key {key} got {value!r}; allowed: {allowed}")


@dataclass(frozen=True, kw_only=True)
class AlgorithmSection:
    """Advantage estimator and KL regularization."""

    advantage_estimator: Literal["gae", "grpo", "dr_grpo", "remax", "rloo", "reinforce_plus_plus"] = "gae"
    """``gae`` (PPO, needs a critic) or a critic-free group/baseline estimator (``dr_grpo``: GRPO without the std
    normalization, never whitened)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Normalize advantages over the step's response tokens (not applied to grpo, dr_grpo, reinforce_plus_plus)."""
    kl_mode: Literal["auto", "reward", "loss", "none"] = "auto"
    """Where the KL to the reference goes: shaped into the reward, added to the actor loss (estimator
    ``actor.loss.kl_loss_estimator``, default k3), or nowhere. ``auto``: the loss for grpo and dr_grpo (as in
    the GRPO paper), the reward for the others."""
    kl_coef: float = 0.05
    """Initial KL coefficient (beta)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """Keep beta fixed, or adapt it toward ``kl_target`` (Ziegler et al.)."""
    kl_target: float = 6.0
    """Target KL per sequence for the adaptive controller."""
    kl_horizon: int = 10000
    """Adaptive controller horizon in samples."""
    dynamic_sampling: bool = False
    """DAPO: drop prompts whose samples all score the same (zero advantage) and draw more prompts until the
    step holds ``batch.prompts_per_step`` prompts with varied scores (needs samples_per_prompt >= 2)."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: at most this many generation rounds per step; if the batch is still short, the
    missing prompts are filled with dropped ones (logged as ``sampling/filled_groups``)."""
    overlong_buffer_length: int = 0
    """DAPO's overlong reward shaping: responses longer than max_new_tokens - this get a linear penalty up to
    ``overlong_penalty_factor`` at the limit; 0: off."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at the length limit."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: truncated responses (hit max_new_tokens without an end token) are masked out
    of the loss."""

    def __post_init__(self) -> None:
        _require(self.advantage_estimator in ESTIMATOR_TRAITS, "advantage_estimator",
                 self.advantage_estimator, ", ".join(ESTIMATOR_TRAITS))
        _require(0 <= self.gamma <= 1, "gamma", self.gamma, "a float in [0, 1]")
        _require(0 <= self.lam <= 1, "lam", self.lam, "a float in [0, 1]")
        _require(self.kl_coef >= 0, "kl_coef", self.kl_coef, "a float >= 0")
        _require(self.kl_target > 0, "kl_target", self.kl_target, "a float > 0")
        _require(self.kl_horizon >= 1, "kl_horizon", self.kl_horizon, "an integer >= 1")
        _require(self.kl_mode in ("auto", "reward", "loss", "none"), "kl_mode", self.kl_mode,
                 "auto, reward, loss, none")
        _require(isinstance(self.max_sampling_rounds, int) and self.max_sampling_rounds >= 1, "max_sampling_rounds",
                 self.max_sampling_rounds, "an integer >= 1")
        _require(isinstance(self.overlong_buffer_length, int) and self.overlong_buffer_length >= 0,
                 "overlong_buffer_length", self.overlong_buffer_length, "an integer >= 0 (0: off)")
        _require(self.overlong_penalty_factor >= 0, "overlong_penalty_factor", self.overlong_penalty_factor,
                 "a float >= 0")

    @property
    def estimator(self) -> EstimatorTraits:
        """The traits of ``advantage_estimator`` (whether it needs a critic, is group-based, ...)."""
        return ESTIMATOR_TRAITS[self.advantage_estimator]

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL penalty shapes the reward (``kl_mode`` reward, or auto for a non-GRPO estimator)."""
        return self.kl_mode == "reward" or (self.kl_mode == "auto" and not self.kl_in_loss)

    @property
    def kl_in_loss(self) -> bool:
        """Whether the KL to the reference is a term of the actor loss (``kl_mode`` loss, or auto for GRPO)."""
        return self.kl_mode == "loss" or (self.kl_mode == "auto" and self.estimator.kl_in_loss)

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs value estimates (only GAE does)."""
        return self.estimator.needs_critic
