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


def critic_values_are_redundant(*, ppo_epochs: int, mini_batches_per_epoch: int, colocated_with_actor: bool,
                                has_cost_critic: bool, masks_rows_after_advantages: bool) -> bool:
    """True when the critic's value forward can be the first half of its update instead of a pass of its own.

    With one epoch of one mini-batch the critic's only optimizer step comes after the update's forward, which
    runs on the weights that would have computed the old values: that forward's values, detached, are the old
    values, and GAE's returns can be computed from them in the update itself. The actor's advantages then wait
    for the critic's whole update rather than its forward, which costs nothing when the two share processes
    (their calls run one after the other anyway) and would serialise them when they sit on separate devices,
    so the pass is only folded for a critic colocated with the actor. Safe-RLHF's cost critic keeps the pass, and
    so does a run that masks rows out after the advantages (DAPO's overlong filter): GAE reads the full mask there
    and the critic's loss the filtered one, which one folded forward cannot tell apart.
    """
    return (ppo_epochs == 1 and mini_batches_per_epoch == 1 and colocated_with_actor and not has_cost_critic
            and not masks_rows_after_advantages)
