"""Passes of an RL step whose result is known without running them (skipped, and reported in the metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.trainers.config.rl import RLConfig


def old_log_prob_is_redundant(*, ppo_epochs: int, mini_batches_per_epoch: int, kl_in_reward: bool) -> bool:
    """True when the old-log-prob forward cannot change the update, so the update uses its own log-probs.

    With one epoch of one mini-batch the only optimizer step comes after the update's forward, which
    runs on the weights the step starts from: the old log-probs equal the current ones and the PPO ratio
    is exactly 1 (the gradient of ratio * A is then that of log p * A). That holds for a stale batch too
    (``async.max_staleness`` >= 1): the old policy of the ratio is the trainer's current one, and the
    truncated importance weight against the behaviour policy reads the same detached log-probs.
    ``kl_in_reward``: a KL penalty to the reference shapes the rewards before the update, from the old
    log-probs, so the pass is kept. A KL term in the loss reads the update's own log-probs and does not
    need it.
    """
    return ppo_epochs == 1 and mini_batches_per_epoch == 1 and not kl_in_reward



def skips_old_log_prob_pass(config: "RLConfig") -> bool:
    """Whether a run of ``config`` skips the old-log-prob forward: ``actor.loss.old_log_probs: auto`` and the pass
    redundant (``old_log_prob_is_redundant``). The trainer's components and the planner's workload both ask this."""
    loss, batch = config.actor.loss, config.batch
    return loss.old_log_probs == "auto" and old_log_prob_is_redundant(
        ppo_epochs=loss.ppo_epochs,
        mini_batches_per_epoch=batch.prompts_per_step * batch.samples_per_prompt // batch.mini_batch_size,
        kl_in_reward="reference" in config.active_roles and config.algorithm.kl_in_reward)
