"""What the driver must know about each advantage estimator (its traits), importable without torch.

``ESTIMATOR_TRAITS`` is the one table of these facts: config validation (``trainers/config/rl.py``), the
trainer (which roles and step components run) and auto-mapping (how many generation passes a step
makes) ask an estimator's traits instead of comparing its name. The functions themselves are
``hybridflow.trainers.advantage.ESTIMATORS`` (torch); each entry there carries its traits from here, and
tests/test_config_light.py keeps the two tables' keys equal. A new estimator is one row here and one
there (and its name in ``AlgorithmSection.advantage_estimator``'s Literal).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EstimatorTraits:
    """The facts about one advantage estimator that the rest of the RL step depends on."""

    needs_critic: bool = False
    """It reads the critic's values (the critic role runs only then; Safe-RLHF's cost side needs one too)."""
    group_based: bool = False
    """Its baseline comes from the other samples of the same prompt: it needs ``samples_per_prompt >= 2``,
    and DAPO's dynamic sampling (dropping groups whose scores tie) applies to it."""
    baseline_generation: bool = False
    """It needs a second, greedy generation per step whose score is the baseline (ReMax)."""
    normalized: bool = False
    """Its advantages are already normalized (``whiten_advantages`` is not applied again)."""
    kl_in_loss: bool = False
    """Where ``kl_mode: auto`` puts the KL to the reference: in the loss (GRPO's paper) or in the reward."""


ESTIMATOR_TRAITS: dict[str, EstimatorTraits] = {
    "gae": EstimatorTraits(needs_critic=True),
    "grpo": EstimatorTraits(group_based=True, normalized=True, kl_in_loss=True),
    # Dr. GRPO: no std normalization, and no whitening after it either (that would put the std back)
    "dr_grpo": EstimatorTraits(group_based=True, normalized=True, kl_in_loss=True),
    "remax": EstimatorTraits(baseline_generation=True),
    "rloo": EstimatorTraits(group_based=True),
    "reinforce_plus_plus": EstimatorTraits(normalized=True),
}
"""``algorithm.advantage_estimator`` -> its traits."""


def estimators_with(trait: str) -> tuple[str, ...]:
    """The names of the estimators that have ``trait`` (for error messages that list what is allowed)."""
    return tuple(name for name, traits in ESTIMATOR_TRAITS.items() if getattr(traits, trait))
