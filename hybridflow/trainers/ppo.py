"""The RL driver: PPO (and the critic-free GRPO, RLOO, ReMax, REINFORCE++) as one single-controller program.

One step, as in the HybridFlow paper (Figure 1): the actor generates; the reference, critic and
reward model score the samples (concurrently when they sit on different pools); the driver shapes
the reward with the KL penalty and computes advantages; the critic and the actor update. The
estimators differ only in ``hybridflow.trainers.advantage`` and in which roles exist.
Safe-RLHF (a ``cost`` section) adds a cost model and a cost critic to the scoring, mixes reward and
cost advantages with the Lagrange multiplier, and updates the multiplier after each step.
DAPO's sample-level pieces change only the generate-and-score step (dynamic sampling draws more
prompts), the scores (overlong penalty) and the update's loss mask (overlong filter).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from hybridflow.algorithms import (AdaptiveKLController, FixedKLController, dynamic_sampling_keep_mask,
                                   first_kept_groups, overlong_filter_mask, overlong_reward_penalty,
                                   rollout_logprob_mismatch)
from hybridflow.algorithms.lagrangian import LagrangeController
from hybridflow.data import BatchLoader, PromptDataset, SFTDataset
from hybridflow.protocol import DataProto
from hybridflow.rewards import RuleReward
from hybridflow.trainers.advantage import compute_advantages, sequence_kl, shaped_rewards, token_mean
from hybridflow.trainers.auto_mapping import resolve_auto_mapping
from hybridflow.trainers.build import build_worker_groups, role_specs
from hybridflow.trainers.checkpoint import RunCheckpointer, config_changes
from hybridflow.trainers.config import RLConfig
from hybridflow.trainers.config_loader import dump_yaml, to_plain
from hybridflow.trainers.export import export_roles
from hybridflow.trainers.metrics import MetricsLogger, StepReporter
from hybridflow.trainers.preflight import check_sequence_length, preflight
from hybridflow.trainers.redundant_passes import critic_values_are_redundant, old_log_prob_is_redundant
from hybridflow.trainers.scoring import RewardScorer
from hybridflow.workers.actor import TRAINING_EXACT_LOGPROBS
from hybridflow.workers.base import SEQUENCE_KEYS
from hybridflow.workers.critic import TOKEN_REWARDS


class RLTrainer:
    """Builds the datasets, worker groups and controllers of an RLConfig and runs its steps."""

    def __init__(self, config: RLConfig, *, mode: str | None = None, tensorboard: bool = True) -> None:
        self.user_config = config
        preflight(config)  # data files, model directories, reward function: before anything is built
        config, self.plan = resolve_auto_mapping(config)
        if self.plan is not None:
            print(f"auto-mapping chose:\n{self.plan.describe()}")
        self.config = config
        self.derived = config.derived()
        self.specs = role_specs(config)
        self.tokenizer = self.specs.actor_tokenizer.load()
        self.train_data = self._dataset(config.data.train_path)
        self.val_data = self._dataset(config.data.val_path) if config.data.val_path else None
        check_sequence_length(config, max(len(example.input_ids) for data in (self.train_data, self.val_data)
                                          if data is not None for example in data.examples))
        self.ptx_loader = None
        if config.actor.loss.ptx_coef > 0:
            ptx_data = SFTDataset(config.data.ptx_path, self.tokenizer, max_prompt_tokens=config.data.max_prompt_tokens,
                                  max_response_tokens=config.data.max_ptx_response_tokens,
                                  **config.data.prompt_format())
            self.ptx_loader = BatchLoader(ptx_data, batch_size=min(config.batch.mini_batch_size, len(ptx_data)),
                                          seed=config.trainer.seed)
        self.loader = BatchLoader(self.train_data, batch_size=config.batch.prompts_per_step, seed=config.trainer.seed,
                                  shuffle=config.data.shuffle)
        self.scorer = RewardScorer(tokenizer=self.tokenizer, function=config.reward.function,
                                   function_weight=config.reward.function_weight,
                                   model_weight=config.reward.model_weight, uses_model=config.reward.model is not None,
                                   timeout_s=config.reward.function_timeout_s)
        algorithm = config.algorithm
        val_function = config.trainer.val_function or config.reward.function
        self.val_rule = (RuleReward(val_function, timeout_s=config.reward.function_timeout_s)
                         if val_function is not None else None)
        self.kl_controller = (AdaptiveKLController(init_kl_coef=algorithm.kl_coef, target_kl=algorithm.kl_target,
                                                   horizon=algorithm.kl_horizon)
                              if algorithm.kl_controller == "adaptive" else FixedKLController(kl_coef=algorithm.kl_coef))
        self.output_dir = Path(config.trainer.output_dir)
        self.checkpointer = RunCheckpointer(self.output_dir / "checkpoints", keep_last=config.trainer.keep_last)
        resume_from = self._check_resume() if config.trainer.resume else None  # before any worker starts
        self.groups, self.pools = build_worker_groups(config, self.specs, mode=mode)
        self.actor = self.groups["actor"]
        self.reference = self.groups.get("reference")
        self.critic = self.groups.get("critic")
        self.reward_model = self.groups.get("reward")
        self.cost_model = self.groups.get("cost")
        self.cost_critic = self.groups.get("cost_critic")
        # Safe-RLHF's Lagrange multiplier lambda, a controller like the KL coefficient's.
        self.lagrange = (LagrangeController(init_lambda=config.cost.lambda_init, cost_limit=config.cost.limit,
                                            lr=config.cost.lambda_lr, max_lambda=config.cost.lambda_max)
                         if config.cost is not None else None)
        self.skips_old_log_prob = old_log_prob_is_redundant(
            ppo_epochs=config.actor.loss.ppo_epochs, mini_batches_per_epoch=self.derived.mini_batches_per_epoch,
            has_reference=self.reference is not None)
        self.folds_critic_values = self.critic is not None and critic_values_are_redundant(
            ppo_epochs=config.critic.loss.ppo_epochs, mini_batches_per_epoch=self.derived.mini_batches_per_epoch,
            colocated_with_actor=config.placement.pool_of("critic") == config.placement.pool_of("actor"),
            has_cost_critic=self.cost_critic is not None, masks_rows_after_advantages=config.algorithm.overlong_filter)
        self.old_log_probs_from_rollout = False  # this step's choice, made in ``_score``
        self.step = 0
        self.best: dict | None = None  # trainer.keep_best: {"metric", "value", "step"} of the best validation
        self.step = self._resume(resume_from) if resume_from is not None else 0
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(dump_yaml(self.user_config))
        self.logger = MetricsLogger(self.output_dir, resume_step=self.step,
                                    tensorboard=tensorboard and config.trainer.tensorboard,
                                    wandb_project=config.trainer.wandb_project, run_config=to_plain(config))

    def _dataset(self, path: str) -> PromptDataset:
        return PromptDataset(path, self.tokenizer, max_prompt_tokens=self.config.data.max_prompt_tokens,
                             **self.config.data.prompt_format())

    # ------------------------------------------------------------------ the loop
    def fit(self, *, on_step=None) -> list[dict]:
        """Run from the current step to ``trainer.total_steps``, then export the trained models to
        ``output_dir/final/<role>``; returns the logged history."""
        trainer = self.config.trainer
        validates = bool(trainer.val_every) and self.val_data is not None
        reporter = StepReporter("rl", total=trainer.total_steps, initial=self.step, progress_bar=trainer.progress_bar,
                                every=trainer.log_every, keys=("reward/score_mean",))
        try:
            if validates and trainer.val_before_train and self.step == 0:  # the starting score, as step 0
                metrics = self._timed_validation()
                self.logger.log(0, metrics)
                self._keep_best(0, metrics)
                reporter.update(0, metrics, advance=False)
            while self.step < trainer.total_steps:
                started = time.perf_counter()
                self.step += 1
                metrics = self.train_step(self.loader.next_batch())
                last = self.step == trainer.total_steps
                if validates and (self.step % trainer.val_every == 0 or last):
                    metrics.update(self._timed_validation())
                metrics["time/step_s"] = time.perf_counter() - started
                self.logger.log(self.step, metrics)
                self._keep_best(self.step, metrics)
                if trainer.save_every and (self.step % trainer.save_every == 0 or last):
                    self.save_checkpoint()
                reporter.update(self.step, metrics)
                if on_step is not None:
                    on_step(self.step, metrics)
        finally:
            reporter.close()
        self.export(self.output_dir / "final")
        return self.logger.history

    def _timed_validation(self) -> dict[str, float]:
        started = time.perf_counter()
        metrics = self.validate()
        metrics["time/validate_s"] = time.perf_counter() - started
        return metrics

    def export(self, directory: str | Path) -> dict[str, Path]:
        """The trained roles (actor; critic / cost critic where trained) as Hugging Face directories with their
        tokenizer files: ``directory/<role>``."""
        return export_roles(self.groups, self.config, directory)

    def _keep_best(self, step: int, metrics: dict[str, float]) -> None:
        """``trainer.keep_best``: export to ``output_dir/best`` when the metric reaches a new best."""
        name, mode = self.config.trainer.keep_best, self.config.trainer.keep_best_mode
        if name is None or not any(key.startswith("val/") for key in metrics):
            return
        if name not in metrics:
            raise ValueError(f"config key trainer.keep_best got {name!r}; allowed: a metric validation logs: "
                             f"{', '.join(sorted(key for key in metrics if key.startswith('val/')))}")
        value = float(metrics[name])
        if self.best is not None and not (value > self.best["value"] if mode == "max" else value < self.best["value"]):
            return
        self.best = {"metric": name, "value": value, "step": step}
        best_dir = self.output_dir / "best"
        self.export(best_dir)
        (best_dir / "best.json").write_text(json.dumps(self.best))

    def train_step(self, prompts: DataProto) -> dict[str, float]:
        """One RL iteration on a batch of prompts; returns its metrics."""
        timing: dict[str, float] = {}
        seed = self.config.trainer.seed * 1_000_003 + self.step
        batch, sampling_metrics = self._generate_and_score(prompts, seed, timing)
        sequence_scores_B, dense_rewards_BT, reward_metrics = self.scorer.token_rewards(batch)
        overlong_penalty_B = self._overlong_penalty(batch)  # DAPO's soft overlong punishment (0 when off)
        sequence_scores_B = sequence_scores_B + overlong_penalty_B
        baseline_B = self._greedy_baseline(prompts) if self.config.algorithm.advantage_estimator == "remax" else None
        critic_metrics = {}
        if self.folds_critic_values:  # the critic's update computes the values GAE needs: run it first
            with _timer(timing, "update"):
                critic_metrics = self._update_critic_from_own_values(batch, sequence_scores_B, dense_rewards_BT)
        result = compute_advantages(
            algorithm=self.config.algorithm, scores_B=sequence_scores_B, response_mask_BT=batch["response_mask"],
            old_logprobs_BT=batch.get("old_logprobs", torch.zeros(batch["response_mask"].shape)),
            ref_logprobs_BT=batch.get("ref_logprobs"),
            values_BT=batch.get("values"), group_ids=batch["uid"], baseline_scores_B=baseline_B,
            kl_coef=self.kl_controller.value, dense_rewards_BT=dense_rewards_BT, costs_B=batch.get("costs"),
            cost_values_BT=batch.get("cost_values"),
            lagrange_multiplier=self.lagrange.value if self.lagrange is not None else None)
        batch["advantages"], batch["returns"] = result.advantages_BT, result.returns_BT
        if result.cost_returns_BT is not None:
            batch["cost_returns"] = result.cost_returns_BT
        mask_BT = batch["response_mask"]
        if self.config.algorithm.overlong_filter:  # DAPO: truncated responses leave the loss
            not_truncated_B = self._not_truncated(batch)
            batch["response_mask"] = mask_BT * not_truncated_B[:, None].to(mask_BT.dtype)
        batch.meta_info.update(seed=seed, step=self.step)
        metrics = self._rollout_metrics(batch)
        with _timer(timing, "update"):
            critic_updates = [critic.update_critic.future(batch) for critic in (self.critic, self.cost_critic)
                              if critic is not None and not (critic is self.critic and self.folds_critic_values)]
            metrics.update(critic_metrics)
            metrics.update(_first(self.actor.update_actor(batch)))
            if self.ptx_loader is not None:  # InstructGPT's PPO-ptx: a next-token step on pretraining rows
                metrics.update(_first(self.actor.update_actor_ptx(self.ptx_loader.next_batch())))
            for critic_update in critic_updates:
                metrics.update(_first(critic_update.get()))
        current_kl = sequence_kl(result.kl_BT, mask_BT)
        self.kl_controller.update(current_kl, self.derived.samples_per_step)
        lengths_B = mask_BT.sum(-1).float()
        metrics.update(reward_metrics)
        metrics.update(sampling_metrics)
        if self.config.algorithm.overlong_buffer_length:
            metrics["reward/overlong_penalty_mean"] = float(overlong_penalty_B.mean())
        if self.config.algorithm.overlong_filter:
            metrics["response/overlong_filtered_fraction"] = float(1 - not_truncated_B.float().mean())
        metrics.update({
            "kl/sequence_kl": current_kl, "kl/coef": self.kl_controller.value,
            "response/length_mean": float(lengths_B.mean()), "response/length_max": float(lengths_B.max()),
            "response/length_min": float(lengths_B.min()),
            "advantage/mean": token_mean(result.advantages_BT, mask_BT),
            "return/mean": token_mean(result.returns_BT, mask_BT),
            **{f"time/{name}_s": seconds for name, seconds in timing.items()},
            "perf/old_log_prob_skipped": float(self.skips_old_log_prob),
            "perf/old_log_prob_from_rollout": float(self.old_log_probs_from_rollout),
        })
        if self.critic is not None:
            metrics["perf/critic_values_folded"] = float(self.folds_critic_values)
        if "values" in batch:
            metrics["critic/values_before_mean"] = token_mean(batch["values"], mask_BT)
        if self.lagrange is not None:
            costs_B = batch["costs"].float()
            self.lagrange.update(float(costs_B.mean()), self.derived.samples_per_step)
            metrics.update({"cost/mean": float(costs_B.mean()), "cost/max": float(costs_B.max()),
                            "cost/min": float(costs_B.min()), "lagrange/lambda": self.lagrange.value})
            metrics.update({"cost_advantage/mean": token_mean(result.cost_advantages_BT, mask_BT),
                            "cost_return/mean": token_mean(result.cost_returns_BT, mask_BT),
                            "cost_critic/values_before_mean": token_mean(batch["cost_values"], mask_BT)})
        return metrics

    def _generate_and_score(self, prompts: DataProto, seed: int, timing: dict) -> tuple[DataProto, dict[str, float]]:
        """Generate and score the step's samples. With DAPO's dynamic sampling, draw more prompts (up to
        ``max_sampling_rounds`` rounds) until ``prompts_per_step`` groups have scores that are not all equal."""
        algorithm, need = self.config.algorithm, self.config.batch.prompts_per_step
        rounds, round_scores = [], []
        for round_index in range(algorithm.max_sampling_rounds if algorithm.dynamic_sampling else 1):
            if round_index > 0:
                prompts = self.loader.next_batch()
            prompts.meta_info.update(seed=seed + 7919 * round_index,
                                     samples_per_prompt=self.config.batch.samples_per_prompt)
            # samples of one prompt form a group (GRPO, RLOO); ids stay unique across rounds
            prompts["uid"] = np.arange(len(prompts)) + round_index * need
            with _timer(timing, "generate"):
                batch = self.actor.generate_sequences(prompts)
            with _timer(timing, "score"):
                batch = self._score(batch)
            if not algorithm.dynamic_sampling:
                return batch, {}
            rounds.append(batch)
            round_scores.append(self.scorer.score(batch)[0] + self._overlong_penalty(batch))
            ids = np.concatenate([part["uid"] for part in rounds]).tolist()
            keep_B = dynamic_sampling_keep_mask(torch.cat(round_scores), ids)
            rows_R, groups_kept = first_kept_groups(keep_B, ids, num_groups=need)
            if groups_kept >= need:
                break
        batch = _concat_rounds(rounds, pad_token_id=self.specs.actor.tokens.pad_token_id)
        rows = rows_R.tolist()
        if groups_kept < need:  # round limit reached: fill up with tied groups (zero advantage) to a full batch
            tied_ids = list(dict.fromkeys(ids[row] for row in np.flatnonzero(~keep_B.numpy())))[:need - groups_kept]
            rows = sorted(rows + [row for row, uid in enumerate(ids) if uid in set(tied_ids)])
        metrics = {"sampling/rounds": float(len(rounds)), "sampling/prompts_drawn": float(len(rounds) * need),
                   "sampling/kept_group_fraction": groups_kept / (len(rounds) * need),
                   "sampling/filled_groups": float(max(need - groups_kept, 0))}
        return batch[np.asarray(rows)], metrics

    def _rollout_metrics(self, batch: DataProto) -> dict[str, float]:
        """The rollout engine's weight transition on actor rank 0 (bytes, parameter memory, seconds) and its
        log-prob mismatch with the training engine on the sampled tokens (when old log-probs were computed)."""
        stats = _first(self.actor.transition_stats())
        # seconds go under time/ with the other timings (they are the only values that vary run to run)
        metrics = {(f"time/rollout_{name}" if name.endswith("_s") else f"rollout/{name}"): float(value)
                   for name, value in stats.items()}
        if "old_logprobs" in batch and "logprobs" in batch and not self.old_log_probs_from_rollout:
            mismatch = rollout_logprob_mismatch(batch["old_logprobs"], batch["logprobs"], batch["response_mask"])
            metrics.update({"rollout/logprob_abs_diff_mean": float(mismatch.mean_abs_diff),
                            "rollout/logprob_abs_diff_max": float(mismatch.max_abs_diff),
                            "rollout/sequence_kl": float(mismatch.sequence_kl)})
        return metrics

    def _overlong_penalty(self, batch: DataProto) -> torch.Tensor:
        """DAPO's soft overlong punishment of each response -> penalty_B (<= 0; zeros when off)."""
        algorithm = self.config.algorithm
        lengths_B = batch["response_mask"].sum(-1)
        if not algorithm.overlong_buffer_length:
            return torch.zeros(len(lengths_B))
        return overlong_reward_penalty(lengths_B, max_response_length=self.specs.actor.generation.max_new_tokens,
                                       buffer_length=algorithm.overlong_buffer_length,
                                       penalty_factor=algorithm.overlong_penalty_factor)

    def _not_truncated(self, batch: DataProto) -> torch.Tensor:
        """keep_B: False for responses that hit max_new_tokens without an end token (DAPO's overlong filter)."""
        generation = self.specs.actor.generation
        lengths_B = batch["response_mask"].sum(-1)
        last_token_B = batch["responses"].gather(1, (lengths_B - 1).clamp(min=0)[:, None].long())[:, 0]
        end_ids = torch.tensor(sorted(set(self.specs.actor.tokens.eos_token_ids) | set(generation.stop_token_ids)))
        return overlong_filter_mask(lengths_B, max_response_length=generation.max_new_tokens,
                                    ended_B=torch.isin(last_token_B.cpu(), end_ids))

    def _score(self, batch: DataProto) -> DataProto:
        """Old log-probs, reference log-probs, values and reward-model scores (and Safe-RLHF's costs and cost
        values); concurrent across pools."""
        self.old_log_probs_from_rollout = from_rollout = self._old_log_probs_from_rollout(batch)
        futures = [] if self.skips_old_log_prob or from_rollout else [self.actor.compute_log_prob.future(batch)]
        if from_rollout:
            batch["old_logprobs"] = batch["logprobs"]
        if self.reference is not None:
            futures.append(self.reference.compute_ref_log_prob.future(batch))
        if self.critic is not None and not self.folds_critic_values:
            futures.append(self.critic.compute_values.future(batch))
        if self.reward_model is not None:
            futures.append(self.reward_model.compute_reward.future(batch))
        if self.cost_model is not None:
            futures.append(self.cost_model.compute_cost.future(batch))
            futures.append(self.cost_critic.compute_values.future(batch))
        for future in futures:
            batch = batch.union(future.get())
        return batch

    def _update_critic_from_own_values(self, batch: DataProto, scores_B: torch.Tensor,
                                       dense_rewards_BT: torch.Tensor | None) -> dict[str, float]:
        """The critic's one step per batch with its value pass folded in (``perf/critic_values_folded``): it
        gets the per-token rewards, computes its values and GAE's returns in the update's own forward and
        hands the values back into ``batch`` for the actor's advantages; returns the critic's metrics."""
        algorithm = self.config.algorithm
        rewards_BT, _ = shaped_rewards(
            algorithm=algorithm, scores_B=scores_B, response_mask_BT=batch["response_mask"],
            old_logprobs_BT=batch.get("old_logprobs", torch.zeros(batch["response_mask"].shape)),
            ref_logprobs_BT=batch.get("ref_logprobs"), kl_coef=self.kl_controller.value,
            dense_rewards_BT=dense_rewards_BT)
        request = DataProto.from_dict(
            tensors={**{key: batch[key] for key in SEQUENCE_KEYS}, TOKEN_REWARDS: rewards_BT},
            meta_info={**batch.meta_info, "gamma": algorithm.gamma, "lam": algorithm.lam})
        output = self.critic.update_critic_from_own_values(request)
        batch["values"] = output["values"]
        return dict(output.meta_info["metrics"])

    def _old_log_probs_from_rollout(self, batch: DataProto) -> bool:
        """Whether this step's old log-probs are the rollout's sampled ones (``actor.loss.old_log_probs``)."""
        source = self.config.actor.loss.old_log_probs
        if self.skips_old_log_prob or source == "recompute" or "logprobs" not in batch:
            return False
        return source == "rollout" or (
            self.config.actor.loss.tis_cap is None and bool(batch.meta_info.get(TRAINING_EXACT_LOGPROBS)))

    def _greedy_baseline(self, prompts: DataProto) -> torch.Tensor:
        """ReMax: the score of the greedy response to each prompt, repeated over its samples -> baseline_B."""
        greedy = DataProto.from_dict(tensors=dict(prompts.batch.items()), non_tensors=dict(prompts.non_tensor_batch),
                                     meta_info={**prompts.meta_info, "greedy": True, "samples_per_prompt": 1})
        batch = self.actor.generate_sequences(greedy)
        if self.reward_model is not None:
            batch = batch.union(self.reward_model.compute_reward(batch))
        baseline_B, _ = self.scorer.score(batch)
        return baseline_B.repeat_interleave(self.config.batch.samples_per_prompt)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy responses to every held-out prompt, scored like training: ``val/*`` metrics."""
        assert self.val_data is not None
        scores, rule_scores, lengths, costs = [], [], [], []
        for prompts in self.val_data.batches_in_order(self.config.batch.prompts_per_step):
            prompts.meta_info.update(greedy=True, samples_per_prompt=1)
            batch = self.actor.generate_sequences(prompts)
            if self.reward_model is not None:
                batch = batch.union(self.reward_model.compute_reward(batch))
            scores.append(self.scorer.score(batch)[0])
            if self.cost_model is not None:
                costs.append(self.cost_model.compute_cost(batch)["costs"].float())
            if self.val_rule is not None:
                rule_scores.append(self.scorer.rule_scores(batch, self.val_rule))
            lengths.append(batch["response_mask"].sum(-1).float())
        metrics = {"val/score_mean": float(torch.cat(scores).mean()),
                   "val/response_length_mean": float(torch.cat(lengths).mean())}
        if rule_scores:
            metrics["val/function_mean"] = float(torch.cat(rule_scores).mean())
        if costs:
            metrics["val/cost_mean"] = float(torch.cat(costs).mean())
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Driver state (step, data position, KL coefficient, Safe-RLHF's log lambda) + every role's engine,
        atomically."""
        def save_roles(directory: Path) -> None:
            for role, group in self.groups.items():
                if role != "reference":  # never trained: rebuilt from its model on resume
                    group.save_checkpoint(str(directory / role))

        state = {"config": to_plain(self.user_config), "best": self.best,
                 "loader": self.loader.state_dict(), "kl_controller": self.kl_controller.state_dict(),
                 "ptx_loader": self.ptx_loader.state_dict() if self.ptx_loader is not None else None,
                 "lagrange": self.lagrange.state_dict() if self.lagrange is not None else None}
        return self.checkpointer.save(self.step, state, save_roles)

    def _check_resume(self) -> Path | None:
        """The checkpoint to resume from, announced with the config changes since it was written; a change beyond
        the loop and layout keys is refused unless ``trainer.allow_config_change``."""
        path = self.checkpointer.latest()
        if path is None:
            return None
        state = self.checkpointer.driver_state(path)
        reported, refused = config_changes(state.get("config", {}), to_plain(self.user_config))
        if "config" not in state:
            refused = ["(the checkpoint records no config: it cannot be compared)"]
        if refused and not self.config.trainer.allow_config_change:
            raise ValueError(
                f"trainer.output_dir {str(self.output_dir)!r} holds checkpoint {path.name} (step {state['step']}) of a "
                f"run with a different config:\n  " + "\n  ".join(refused) + "\nallowed: the same config, "
                "trainer.allow_config_change=true to resume anyway, or trainer.resume=false or another "
                "trainer.output_dir to start a new run")
        print(f"resuming from {path} (step {state['step']} of {self.config.trainer.total_steps})", flush=True)
        if reported or refused:
            print("config changes since that checkpoint:\n  " + "\n  ".join(reported + refused), flush=True)
        return path

    def _resume(self, path: Path) -> int:
        state = self.checkpointer.driver_state(path)
        self.best = state.get("best")
        for role, group in self.groups.items():
            if role != "reference":
                group.load_checkpoint(str(path / role))
        self.loader.load_state_dict(state["loader"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.ptx_loader is not None and state.get("ptx_loader") is not None:
            self.ptx_loader.load_state_dict(state["ptx_loader"])
        if self.lagrange is not None and state.get("lagrange") is not None:
            self.lagrange.load_state_dict(state["lagrange"])
        return int(state["step"])

    def shutdown(self) -> None:
        """Stop the workers and give their devices back."""
        self.logger.close()
        for group in self.groups.values():
            group.shutdown()  # colocated views share processes; stopping them twice is harmless
        for pool in self.pools:
            pool.release()


def run_rl(config: RLConfig, *, mode: str | None = None, tensorboard: bool = True) -> list[dict]:
    """Build an ``RLTrainer`` for ``config``, run it to ``trainer.total_steps`` and stop its workers, also when
    the run fails; returns the logged history (one metrics dict per step, as ``RLTrainer.fit``).

    ``mode="local"`` runs every role inside this process (no Ray; as ``local_mode()`` or HYBRIDFLOW_LOCAL=1 do),
    ``"ray"`` one process per device slot, ``None`` whichever the environment says. Keep an ``RLTrainer`` instead
    when you need its worker groups or validation between the steps.
    """
    trainer = RLTrainer(config, mode=mode, tensorboard=tensorboard)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def _first(per_rank: list[dict]) -> dict:
    """Update metrics come back once per data-parallel rank, already averaged over ranks: take one."""
    return per_rank[0]


class _timer:
    def __init__(self, timing: dict, name: str) -> None:
        self.timing, self.name = timing, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.timing[self.name] = self.timing.get(self.name, 0.0) + time.perf_counter() - self.start


def _concat_rounds(rounds: list[DataProto], *, pad_token_id: int) -> DataProto:
    """The rows of several generation rounds as one batch: prompts left-padded to the widest round's."""
    widths = [len(batch["input_ids"][0]) - len(batch["responses"][0]) for batch in rounds]
    padded = []
    for batch, width in zip(rounds, widths):
        extra = max(widths) - width
        if extra:
            batch = batch[np.arange(len(batch))]  # a copy: the round's own tensors stay as they were
            fills = {"input_ids": pad_token_id, "prompts": pad_token_id, "attention_mask": 0, "position_ids": 0}
            for key, fill in fills.items():
                if key in batch:
                    batch[key] = torch.nn.functional.pad(batch[key], (extra, 0), value=fill)
        padded.append(batch)
    return DataProto.concat(padded)
