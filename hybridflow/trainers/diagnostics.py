"""Learning-signal diagnostics of an RL step: which groups of samples could teach the policy anything, how random
the policy still is, and a warning naming the likely causes when no group carried a signal for several steps.

A group estimator (GRPO, RLOO, Dr. GRPO) learns from the differences between the rewards of one prompt's samples:
a group whose samples all scored the same has advantage 0 everywhere and moves nothing but the KL term.
docs/diagnostics.md explains every metric and what to do about each warning.
Shape legend: B = samples in the step, T = response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algorithms.advantages import group_indices

SUMMARY_KEYS = ("reward/score_mean", "signal/tied_groups", "actor/clip_fraction", "signal/entropy",
                "actor/pg_grad_share")
"""What the one-line log (and the progress bar) shows of every step."""


def group_signal_metrics(scores_B: Tensor, group_ids_B) -> dict[str, float]:
    """The fraction of groups (samples sharing a group id) whose samples all got the same reward (within 1e-6 relative: rounding is no signal)
    (``signal/tied_groups``, the ties DAPO's dynamic sampling drops); for 0/1 rewards also the fractions all correct
    and all wrong. Empty when no group holds two samples (nothing to compare)."""
    index_B = group_indices(group_ids_B)
    num_groups = int(index_B.max()) + 1 if len(index_B) else 0
    if num_groups == 0 or num_groups == len(index_B):
        return {}
    scores_B = scores_B.detach().double().reshape(-1)

    def fraction_of_groups(flag_B: Tensor) -> float:  # flag_B is the same for every sample of a group
        return float(torch.zeros(num_groups, dtype=torch.float64).scatter_(0, index_B, flag_B.double()).mean())

    tied_B = _nearly_tied(scores_B, index_B, num_groups)
    metrics = {"signal/tied_groups": fraction_of_groups(tied_B)}
    if bool(((scores_B == 0) | (scores_B == 1)).all()):
        metrics["signal/all_correct_groups"] = fraction_of_groups(tied_B & (scores_B == 1))
        metrics["signal/all_wrong_groups"] = fraction_of_groups(tied_B & (scores_B == 0))
    return metrics


def _nearly_tied(scores_B: Tensor, index_B: Tensor, num_groups: int, tolerance: float = 1e-6) -> Tensor:
    """Per sample: its group's rewards agree within ``tolerance`` (relative to their size, at least 1). Rewards of
    equal responses scored by a model differ by rounding across batch layouts; they carry no learning signal."""
    high_G = torch.full((num_groups,), -torch.inf, dtype=scores_B.dtype).scatter_reduce(0, index_B, scores_B, "amax")
    low_G = torch.full((num_groups,), torch.inf, dtype=scores_B.dtype).scatter_reduce(0, index_B, scores_B, "amin")
    scale_G = torch.maximum(high_G.abs(), low_G.abs()).clamp(min=1.0)
    return ((high_G - low_G) <= tolerance * scale_G)[index_B]


def sampled_entropy(logprobs_BT: Tensor, mask_BT: Tensor) -> float:
    """The sampled tokens' mean negative log-prob: an unbiased estimate of the policy's per-token entropy at the
    rollout's temperature, free from the log-probs the rollout returns anyway (``actor/entropy``, exact, is logged
    only when the entropy bonus makes the update compute it)."""
    mask_BT = mask_BT.to(logprobs_BT.dtype)
    return float(-(logprobs_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))


class LearningSignalMonitor:
    """Counts consecutive steps in which every group tied; from ``patience`` of them on, ``observe`` returns a
    warning naming the likely causes (each step until a group differs again)."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.steps_without_signal = 0
        self.warning: str | None = None
        """The last observed step's warning, or None."""

    def state_dict(self) -> dict[str, int]:
        """The count, for the driver's checkpoint (a resumed run warns at the same step as an uninterrupted one)."""
        return {"steps_without_signal": self.steps_without_signal}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps_without_signal = int(state["steps_without_signal"])

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """Update the count from a step's metrics (adds ``signal/steps_without_signal``); the warning or None."""
        self.warning = None
        tied = metrics.get("signal/tied_groups")
        if tied is None:
            return None
        self.steps_without_signal = self.steps_without_signal + 1 if tied >= 1.0 else 0
        metrics["signal/steps_without_signal"] = float(self.steps_without_signal)
        if self.patience > 0 and self.steps_without_signal >= self.patience:
            self.warning = self.message(step, metrics)
        return self.warning

    def message(self, step: int, metrics: dict[str, float]) -> str:
        correct, wrong = metrics.get("signal/all_correct_groups"), metrics.get("signal/all_wrong_groups")
        if wrong is not None and wrong >= 1.0:
            what = ("every sample scored 0: check that the answer format the model writes is the one the reward "
                    "parses (print a few responses; data.response_prefix can pre-start the answer), that the task "
                    "is not too hard for the model, and that actor.generation.max_new_tokens leaves room for the "
                    "answer")
        elif correct is not None and correct >= 1.0:
            what = "every sample scored 1: the task is too easy for the model (use harder prompts)"
        else:
            what = ("the samples of each prompt got the same reward: check that the reward varies with the "
                    "response (a constant or prompt-only reward teaches nothing)")
        return (f"no learning signal for {self.steps_without_signal} steps (step {step}): every group's samples got "
                f"the same reward, so the group advantages are 0 and only the KL term moves the weights. Likely "
                f"causes: {what}; sampling too close to greedy (raise actor.generation.temperature or "
                f"batch.samples_per_prompt); a learning rate so high that the policy broke (if earlier steps had "
                f"signal: lower actor.engine.optim.lr). docs/diagnostics.md")
