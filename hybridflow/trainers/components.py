"""The step components: what an RL algorithm adds to the paper's step, each through a few hooks (``step.py``).

- ``OldLogProbs``: where the PPO ratio's old log-probs come from (a forward, the rollout's, or none at all);
- ``GreedyBaseline``: ReMax's greedy generation per step, its score the baseline;
- ``OverlongPenalty`` / ``OverlongFilter``: DAPO's soft punishment of long responses / truncated ones out of the loss;
- ``Ptx``: InstructGPT's PPO-ptx, a next-token step on pretraining rows after each actor update;
- ``SafeRLHF``: a cost model and cost critic, cost advantages mixed in with the Lagrange multiplier lambda.
``build_components`` is the one place that reads the config to decide which run. DAPO's dynamic sampling changes
how a step draws its samples and lives with the sampling strategies (``sampling.py``).
Shape legend: B = samples in the step, T = response tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from hybridflow.algorithms import (overlong_filter_mask, overlong_reward_penalty, rollout_logprob_mismatch,
                                   safe_rlhf_advantages, scores_on_last_token)
from hybridflow.algorithms.lagrangian import LagrangeController
from hybridflow.protocol import DataProto
from hybridflow.trainers.advantage import AdvantageResult, EstimatorInputs, estimate_advantages, token_mean
from hybridflow.trainers.config.rl import DerivedSizes, RLConfig
from hybridflow.trainers.redundant_passes import skips_old_log_prob_pass
from hybridflow.trainers.step import Experience, StepComponent, StepResults, first_rank
from hybridflow.workers.actor import TRAINING_EXACT_LOGPROBS


class OldLogProbs(StepComponent):
    """The old log-probs of the PPO ratio (``actor.loss.old_log_probs``): a forward of the actor after generation
    (the paper's), the rollout's own sampled log-probs where they equal that forward's (``auto``: the native
    engine sampling in fp32) or when asked (``rollout``), or, with ``auto``, no pass at all where it cannot change
    the update (one epoch of one mini-batch with no KL penalty in the reward: ``redundant_passes.py``)."""

    def __init__(self, actor, *, source: str, tis_cap: float | None, skipped: bool) -> None:
        self.actor, self.source, self.tis_cap, self.skipped = actor, source, tis_cap, skipped

    def from_rollout(self, batch: DataProto) -> bool:
        """Whether this batch's old log-probs are the rollout's (a function of the config and the batch)."""
        if self.skipped or self.source == "recompute" or "logprobs" not in batch:
            return False
        return self.source == "rollout" or (self.tis_cap is None and bool(batch.meta_info.get(TRAINING_EXACT_LOGPROBS)))

    def score_futures(self, batch: DataProto) -> list:
        if self.skipped:
            return []
        if self.from_rollout(batch):
            batch["old_logprobs"] = batch["logprobs"]
            return []
        return [self.actor.compute_log_prob.future(batch)]

    def metrics(self, results: StepResults) -> dict[str, float]:
        """Which source served, and the rollout's log-prob mismatch with the training forward on the trained tokens
        (when both were computed)."""
        batch = results.batch
        from_rollout = self.from_rollout(batch)
        metrics = {"perf/old_log_prob_skipped": float(self.skipped),
                   "perf/old_log_prob_from_rollout": float(from_rollout)}
        if "old_logprobs" in batch and "logprobs" in batch and not from_rollout:
            mismatch = rollout_logprob_mismatch(batch["old_logprobs"], batch["logprobs"], batch["response_mask"])
            metrics.update({"rollout/logprob_abs_diff_mean": float(mismatch.mean_abs_diff),
                            "rollout/logprob_abs_diff_max": float(mismatch.max_abs_diff),
                            "rollout/sequence_kl": float(mismatch.sequence_kl)})
        return metrics


class GreedyBaseline(StepComponent):
    """ReMax: the score of the greedy response to each prompt is the baseline of its samples (for an estimator
    whose traits say ``baseline_generation``)."""

    def __init__(self, actor, *, score_B, samples_per_prompt: int) -> None:
        """``score_B(batch)``: the scores of generated responses, as the reward scores them (model and function)."""
        self.actor, self.score_B, self.samples_per_prompt = actor, score_B, samples_per_prompt

    def estimator_inputs(self, experience: Experience) -> dict[str, Tensor]:
        prompts = experience.prompts
        greedy = DataProto.from_dict(tensors=dict(prompts.batch.items()), non_tensors=dict(prompts.non_tensor_batch),
                                     meta_info={**prompts.meta_info, "greedy": True, "samples_per_prompt": 1})
        # with an environment (env) the baseline is the greedy episode's reward
        generate = (self.actor.generate_episodes if prompts.meta_info.get("episode_job") is not None
                    else self.actor.generate_sequences)
        baseline_B = self.score_B(generate(greedy))
        return {"baseline_scores_B": baseline_B.repeat_interleave(self.samples_per_prompt)}


class OverlongPenalty(StepComponent):
    """DAPO's soft overlong punishment: a response longer than ``max_response_length - buffer_length`` loses up to
    ``penalty_factor`` of its score, linearly to the limit (``algorithm.overlong_buffer_length``)."""

    def __init__(self, *, max_response_length: int, buffer_length: int, penalty_factor: float) -> None:
        self.max_response_length, self.buffer_length = max_response_length, buffer_length
        self.penalty_factor = penalty_factor

    def penalty(self, mask_BT: Tensor) -> Tensor:
        """penalty_B (<= 0) of responses with the given token masks."""
        return overlong_reward_penalty(mask_BT.sum(-1), max_response_length=self.max_response_length,
                                       buffer_length=self.buffer_length, penalty_factor=self.penalty_factor)

    def adjust_scores(self, batch: DataProto, scores_B: Tensor) -> Tensor:
        return scores_B + self.penalty(batch["response_mask"])

    def metrics(self, results: StepResults) -> dict[str, float]:
        return {"reward/overlong_penalty_mean": float(self.penalty(results.response_mask_BT).mean())}


class OverlongFilter(StepComponent):
    """DAPO's overlong filter: a response that reached ``max_new_tokens`` without an end token leaves the loss
    (actor's and critic's), after its advantages were computed with it in its group."""

    def __init__(self, *, max_response_length: int, end_token_ids: tuple[int, ...]) -> None:
        self.max_response_length, self.end_token_ids = max_response_length, tuple(sorted(set(end_token_ids)))

    @classmethod
    def of(cls, generation) -> OverlongFilter:
        """The filter for the actor's generation settings (its limit and its EOS and stop tokens)."""
        return cls(max_response_length=generation.max_new_tokens,
                   end_token_ids=tuple(generation.eos_token_ids) + tuple(generation.stop_token_ids))

    def kept(self, responses_BT: Tensor, mask_BT: Tensor) -> Tensor:
        """keep_B: False for responses that hit the limit without an end token."""
        lengths_B = mask_BT.sum(-1)
        last_token_B = responses_BT.gather(1, (lengths_B - 1).clamp(min=0)[:, None].long())[:, 0]
        return overlong_filter_mask(lengths_B, max_response_length=self.max_response_length,
                                    ended_B=torch.isin(last_token_B.cpu(), torch.tensor(self.end_token_ids)))

    def loss_mask(self, batch: DataProto, mask_BT: Tensor) -> Tensor:
        kept_B = self.kept(batch["responses"], batch["response_mask"])
        return mask_BT * kept_B[:, None].to(mask_BT.dtype)

    def metrics(self, results: StepResults) -> dict[str, float]:
        kept_B = self.kept(results.batch["responses"], results.response_mask_BT)
        return {"response/overlong_filtered_fraction": float(1 - kept_B.float().mean())}


class Ptx(StepComponent):
    """InstructGPT's PPO-ptx: after each actor update, one step on ``actor.loss.ptx_coef`` x the next-token loss of a
    mini-batch of pretraining rows (``data.ptx_path``)."""

    state_key = "ptx_loader"

    def __init__(self, actor, loader) -> None:
        self.actor, self.loader = actor, loader

    def after_actor_update(self, batch: DataProto) -> list[dict[str, float]]:
        return [first_rank(self.actor.update_actor_ptx(self.loader.next_batch()))]

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class SafeRLHF(StepComponent):
    """Safe-RLHF (Dai et al. 2024): a cost model and a cost critic score every step; the cost's advantages come from
    the same estimator as the reward's (GAE on the cost credited on the last token, with the cost critic's values;
    no KL term) and the actor trains on ``(A_r - lambda A_c) / (1 + lambda)``; the cost critic regresses the cost's
    returns; after the step lambda follows the mean cost against the limit (``LagrangeController``)."""

    state_key = "lagrange"

    def __init__(self, *, algorithm, lagrange: LagrangeController, cost_model, cost_critic,
                 samples_per_step: int) -> None:
        self.algorithm, self.lagrange = algorithm, lagrange
        self.cost_model, self.cost_critic, self.samples_per_step = cost_model, cost_critic, samples_per_step

    def score_futures(self, batch: DataProto) -> list:
        return [self.cost_model.compute_cost.future(batch), self.cost_critic.compute_values.future(batch)]

    def adjust_advantages(self, batch: DataProto, result: AdvantageResult) -> AdvantageResult:
        missing = [key for key in ("costs", "cost_values") if key not in batch]
        if missing:
            raise ValueError(f"Safe-RLHF's advantages need the batch's costs and cost_values (from the cost model and "
                             f"the cost critic); missing: {', '.join(missing)}")
        mask_BT = batch["response_mask"].to(result.token_rewards_BT.dtype)
        costs_BT = scores_on_last_token(batch["costs"].to(mask_BT.dtype), mask_BT)
        inputs = EstimatorInputs(values_BT=batch["cost_values"], group_ids=batch["uid"], baseline_scores_B=None,
                                 gamma=self.algorithm.gamma, lam=self.algorithm.lam)
        cost_advantages_BT, cost_returns_BT = estimate_advantages(self.algorithm, costs_BT, mask_BT, inputs)
        return replace(result, advantages_BT=safe_rlhf_advantages(result.advantages_BT, cost_advantages_BT,
                                                                  self.lagrange.value),
                       extra_BT={**result.extra_BT, "cost_advantages": cost_advantages_BT,
                                 "cost_returns": cost_returns_BT})

    def update_futures(self, batch: DataProto) -> list:
        return [self.cost_critic.update_critic.future(batch)]

    def after_step(self, batch: DataProto) -> None:
        self.lagrange.update(float(batch["costs"].float().mean()), self.samples_per_step)

    def metrics(self, results: StepResults) -> dict[str, float]:
        batch, mask_BT = results.batch, results.response_mask_BT
        costs_B = batch["costs"].float()
        return {"cost/mean": float(costs_B.mean()), "cost/max": float(costs_B.max()), "cost/min": float(costs_B.min()),
                "lagrange/lambda": self.lagrange.value,
                "cost_advantage/mean": token_mean(results.advantages.extra_BT["cost_advantages"], mask_BT),
                "cost_return/mean": token_mean(results.advantages.extra_BT["cost_returns"], mask_BT),
                "cost_critic/values_before_mean": token_mean(batch["cost_values"], mask_BT)}

    def validation_scores(self, batch: DataProto) -> dict[str, Tensor]:
        return {"val/cost_mean": self.cost_model.compute_cost(batch)["costs"].float()}

    def state_dict(self) -> dict:
        return self.lagrange.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.lagrange.load_state_dict(state)


def build_components(config: RLConfig, *, derived: DerivedSizes, generation, groups: dict, score_B,
                     ptx_loader) -> list[StepComponent]:
    """The components an ``RLConfig`` turns on, in the order the step calls their hooks. ``generation``: the actor's
    generation settings (with its token ids); ``score_B(batch)``: scores of generated responses."""
    algorithm, actor = config.algorithm, groups["actor"]
    skipped = skips_old_log_prob_pass(config)
    components: list[StepComponent] = [OldLogProbs(actor, source=config.actor.loss.old_log_probs,
                                                   tis_cap=config.actor.loss.tis_cap, skipped=skipped)]
    if algorithm.estimator.baseline_generation:
        components.append(GreedyBaseline(actor, score_B=score_B, samples_per_prompt=config.batch.samples_per_prompt))
    if algorithm.overlong_buffer_length:
        components.append(OverlongPenalty(max_response_length=generation.max_new_tokens,
                                          buffer_length=algorithm.overlong_buffer_length,
                                          penalty_factor=algorithm.overlong_penalty_factor))
    if algorithm.overlong_filter:
        components.append(OverlongFilter.of(generation))
    if ptx_loader is not None:
        components.append(Ptx(actor, ptx_loader))
    if config.cost is not None:
        cost = config.cost
        lagrange = LagrangeController(init_lambda=cost.lambda_init, cost_limit=cost.limit, lr=cost.lambda_lr,
                                      max_lambda=cost.lambda_max)
        components.append(SafeRLHF(algorithm=algorithm, lagrange=lagrange, cost_model=groups["cost"],
                                   cost_critic=groups["cost_critic"], samples_per_step=derived.samples_per_step))
    return components
