"""The vocabulary of one RL step: what its halves hand each other, the hooks of a step component, and its metrics.

A step (``RLTrainer.train_step``) is the paper's: generate; score (reference, critic, reward, as futures);
advantages; update critic and actor. Everything an algorithm adds to that (Safe-RLHF's cost, DAPO's overlong
handling, ReMax's greedy baseline, PPO-ptx, where the old log-probs come from) is a ``StepComponent``
(``trainers/components.py``): an object whose hooks the step calls at fixed points, each defaulting to
nothing. The step's metrics are built in one place, ``step_metrics``, from a ``StepResults``.
Shape legend: B = samples in the step, T = response tokens.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor

from hybridflow.protocol import DataProto
from hybridflow.trainers.advantage import AdvantageResult, token_mean
from hybridflow.trainers.diagnostics import group_signal_metrics, sampled_entropy


@dataclass
class Experience:
    """A generated and scored batch: what the learning half of a step consumes (``RLTrainer.learn``)."""

    prompts: DataProto
    """The step's prompts, with the ``uid`` and generation options they were sampled with."""
    batch: DataProto
    """The samples with everything the scoring added (old and reference log-probs, values, reward-model scores,
    the components' scores such as Safe-RLHF's costs)."""
    sampling_metrics: dict[str, float] = field(default_factory=dict)
    """What the sampling strategy reports (DAPO's dynamic sampling: rounds, prompts drawn, ...)."""


@dataclass(frozen=True)
class StepResults:
    """Everything one step produced, from which ``step_metrics`` builds its metrics."""

    experience: Experience
    response_mask_BT: Tensor
    """The generated tokens (before a component masked some out of the loss)."""
    batch: DataProto
    """The training batch: the rollout's samples with advantages, returns and the loss mask as ``response_mask``."""
    reward_metrics: dict[str, float]
    advantages: AdvantageResult
    sequence_kl: float
    """Mean summed KL to the reference per sample (what the adaptive KL controller steers)."""
    kl_coef: float
    """The KL coefficient after this step's controller update (the value the next step uses)."""
    transition: dict[str, float]
    """The rollout engine's weight transition on actor rank 0 (bytes, parameter memory, seconds)."""
    updates: list[dict[str, float]]
    """The metrics of each update of the step (actor, critic, the components')."""
    timing: dict[str, float]
    """Seconds per phase (generate, score, update)."""
    scores_B: Tensor | None = None
    """Each sample's total reward as the estimator saw it (the components' adjustments applied): the
    learning-signal diagnostics compare them within each group."""


class StepComponent:
    """A piece of an RL algorithm joining the step through hooks; every hook's default does nothing.

    The hooks, in the order the step calls them:
    ``score_futures`` while scoring; ``adjust_scores`` on each response's score; ``estimator_inputs`` and
    ``adjust_advantages`` around the estimator; ``loss_mask`` on the training batch; ``update_futures`` alongside
    the critic's update and ``after_actor_update`` after the actor's; ``after_step`` once the updates are done
    (controllers); ``metrics`` when the step's metrics are assembled; ``validation_scores`` per validation batch;
    ``state_dict``/``load_state_dict`` under ``state_key`` in the checkpoint's driver state.
    """

    state_key: str | None = None
    """The key of this component's state in ``driver.json`` (None: it keeps none)."""

    def score_futures(self, batch: DataProto) -> list:
        """Futures whose outputs join the batch while the roles score it (concurrent across pools); may also add
        tensors to ``batch`` directly (the rollout's own log-probs as old log-probs)."""
        return []

    def adjust_scores(self, batch: DataProto, scores_B: Tensor) -> Tensor:
        """Each response's score before the advantages (and before dynamic sampling's tie check)."""
        return scores_B

    def estimator_inputs(self, experience: Experience) -> dict[str, Tensor]:
        """Keyword inputs of ``compute_advantages`` this component provides (ReMax: ``baseline_scores_B``)."""
        return {}

    def adjust_advantages(self, batch: DataProto, result: AdvantageResult) -> AdvantageResult:
        """The estimator's result, transformed (Safe-RLHF mixes in the cost advantages)."""
        return result

    def loss_mask(self, batch: DataProto, mask_BT: Tensor) -> Tensor:
        """The tokens the updates train on, given the batch (its ``response_mask`` still the generated tokens)."""
        return mask_BT

    def update_futures(self, batch: DataProto) -> list:
        """Updates issued with the critic's, before the actor's (Safe-RLHF's cost critic); futures of metrics."""
        return []

    def after_actor_update(self, batch: DataProto) -> list[dict[str, float]]:
        """Updates that run after the actor's (PPO-ptx); their metrics."""
        return []

    def after_step(self, batch: DataProto) -> None:
        """Controller updates once the step's updates are done (Safe-RLHF's lambda)."""

    def metrics(self, results: StepResults) -> dict[str, float]:
        """This component's metrics of the step."""
        return {}

    def validation_scores(self, batch: DataProto) -> dict[str, Tensor]:
        """Per-sample values of a validation batch (greedy responses), averaged into ``val/*`` metrics by name."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def step_metrics(results: StepResults, components: list[StepComponent]) -> dict[str, float]:
    """The step's metrics, all built here from its results: the rollout's transition, every update's metrics,
    reward, KL, lengths, advantages, phase times, then each component's."""
    mask_BT, batch = results.response_mask_BT, results.batch
    lengths_B = mask_BT.sum(-1).float()
    # seconds go under time/ with the other timings (they are the only values that vary run to run)
    metrics = {(f"time/rollout_{name}" if name.endswith("_s") else f"rollout/{name}"): float(value)
               for name, value in results.transition.items()}
    for update in results.updates:
        metrics.update(update)
    metrics.update(results.reward_metrics)
    metrics.update(results.experience.sampling_metrics)
    metrics.update({
        "kl/sequence_kl": results.sequence_kl, "kl/coef": results.kl_coef,
        "response/length_mean": float(lengths_B.mean()), "response/length_max": float(lengths_B.max()),
        "response/length_min": float(lengths_B.min()),
        "advantage/mean": token_mean(results.advantages.advantages_BT, mask_BT),
        "return/mean": token_mean(results.advantages.returns_BT, mask_BT),
        **{f"time/{name}_s": seconds for name, seconds in results.timing.items()},
    })
    if "values" in batch:
        metrics["critic/values_before_mean"] = token_mean(batch["values"], mask_BT)
    metrics.update(signal_metrics(results))
    for component in components:
        metrics.update(component.metrics(results))
    return metrics


def signal_metrics(results: StepResults) -> dict[str, float]:
    """The learning-signal diagnostics (``trainers/diagnostics.py``): tied groups and the sampled entropy."""
    batch, metrics = results.batch, {}
    if results.scores_B is not None and "uid" in batch:
        metrics.update(group_signal_metrics(results.scores_B, batch["uid"]))
    sampled = "logprobs" if "logprobs" in batch else "old_logprobs"
    if sampled in batch:
        metrics["signal/entropy"] = sampled_entropy(batch[sampled], results.response_mask_BT)
    return metrics


class PhaseTimer:
    """Seconds per named phase of a step, summed over repeats (dynamic sampling generates several times);
    ``report(name)``, when given, is a context manager entered around each phase (the trainer's progress)."""

    def __init__(self, report=None) -> None:
        self.seconds: dict[str, float] = {}
        self.report = report

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            if self.report is None:
                yield
            else:
                with self.report(name):
                    yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def first_rank(per_rank: list[dict]) -> dict:
    """Update metrics come back once per data-parallel rank, already averaged over ranks: take one."""
    return per_rank[0]
