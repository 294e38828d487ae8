"""Passes of an RL step whose result is known without running them (skipped, and reported in the metrics)."""

from __future__ import annotations


def old_log_prob_is_redundant(*, ppo_epochs: int, mini_batches_per_epoch: int, has_reference: bool) -> bool:
    """True when the old-log-prob forward cannot change the update, so the update uses its own log-probs.

    With one epoch of one mini-batch the only optimizer step comes after the update's forward, which
    runs on the weights that generated the samples: the old log-probs equal the current ones and the
    PPO ratio is exactly 1 (the gradient of ratio * A is then that of log p * A). A reference model
    reads the old log-probs for its KL term, so with one the pass is kept.
    """
    return ppo_epochs == 1 and mini_batches_per_epoch == 1 and not has_reference

