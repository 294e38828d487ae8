"""The RL driver: PPO (and the critic-free GRPO, RLOO, ReMax, REINFORCE++) as one single-controller program.

One step, as in the HybridFlow paper (Figure 1): the actor generates; the reference, critic and
reward model score the samples (concurrently when they sit on different pools); the driver shapes
the reward with the KL penalty and computes advantages; the critic and the actor update. The
estimators differ only in ``hybridflow.trainers.advantage`` (and in their traits: which roles exist).
What an algorithm adds to that step is a step component with a few hooks (``trainers/components.py``:
Safe-RLHF's cost, DAPO's overlong penalty and filter, ReMax's greedy baseline, PPO-ptx, the source of the
old log-probs); how a step draws its samples is a sampling strategy (``trainers/sampling.py``: DAPO's
dynamic sampling draws more prompts). docs/ppo.md walks through the step and how to add a component.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch

from hybridflow.algorithms import AdaptiveKLController, FixedKLController
from hybridflow.controller import DRIVER_ACTIVITY, LivenessMonitor, WorkerLostError, WorkerTimeoutError
from hybridflow.data import BatchLoader, PromptDataset, SFTDataset
from hybridflow.engine.rollout import sampling_options
from hybridflow.protocol import DataProto
from hybridflow.rewards import RuleReward
from hybridflow.trainers.advantage import AdvantageResult, compute_advantages, sequence_kl
from hybridflow.trainers.auto_mapping import resolve_auto_mapping
from hybridflow.trainers.build import build_worker_groups, role_specs
from hybridflow.trainers.checkpoint import RunCheckpointer, checkpoint_estimate, config_changes
from hybridflow.trainers.components import build_components
from hybridflow.trainers.config.rl import RLConfig
from hybridflow.trainers.config.loader import dump_yaml, to_plain
from hybridflow.trainers.diagnostics import SUMMARY_KEYS, LearningSignalMonitor
from hybridflow.trainers.export import export_roles
from hybridflow.trainers.loggers import episode_rows
from hybridflow.trainers.metrics import Heartbeat, MetricsLogger, StepReporter
from hybridflow.trainers.pipelined import PipelinedSampling
from hybridflow.trainers.preflight import check_sequence_length, max_positions, preflight
from hybridflow.trainers.run_dir import claim_run_directory, set_aside_later_metrics
from hybridflow.trainers.sampling import EpisodeLossMask, build_sampling
from hybridflow.trainers.scoring import RewardScorer
from hybridflow.trainers.streaming import StreamingSampling
from hybridflow.trainers.step import PhaseTimer, Experience, StepResults, first_rank, step_metrics
from hybridflow.workers.actor import BEHAVIOUR_KEY


UNSAVED_ROLES = ("reference", "rollout")
"""Roles a checkpoint leaves out: never trained (reference) or given the actor's weights at the next sync."""


class RLTrainer:
    """Builds the datasets, worker groups and controllers of an RLConfig and runs its steps."""

    def __init__(self, config: RLConfig, *, mode: str | None = None, tensorboard: bool = True) -> None:
        if not isinstance(config, RLConfig):
            raise ValueError(f"RLTrainer needs an RLConfig (load_rl_config(path, overrides) builds one), got a "
                             f"{type(config).__name__}")
        self.user_config = config
        self.stopped = False
        preflight(config)  # data files, model directories, reward function: before anything is built
        config, self.plan = resolve_auto_mapping(config)
        if self.plan is not None:
            print(f"auto-mapping chose:\n{self.plan.describe()}")
        self.config = config
        self.heartbeat = Heartbeat("rl", every_s=config.trainer.progress_every_s,
                                   progress_bar=config.trainer.progress_bar)
        DRIVER_ACTIVITY.set(self.heartbeat.describe)  # the worker watchdog names what the driver is doing
        self.derived = config.derived()
        self.specs = role_specs(config)
        self.tokenizer = self.specs.actor_tokenizer.load()
        with self.heartbeat.phase("reading and tokenizing the prompts"):
            self.train_data = self._dataset(config.data.train_path)
            self.val_data = self._dataset(config.data.val_path) if config.data.val_path else None
        check_sequence_length(config, max(len(example.input_ids) for data in (self.train_data, self.val_data)
                                          if data is not None for example in data.examples))
        ptx_loader = self._ptx_loader()  # read before any worker starts, like the prompts
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
        self.signal = LearningSignalMonitor(config.trainer.warn_no_signal_steps)
        self.output_dir = Path(config.trainer.output_dir)
        self.checkpointer = RunCheckpointer(self.output_dir / "checkpoints", keep_last=config.trainer.keep_last,
                                            first_estimate_bytes=checkpoint_estimate(config))
        # one writer per directory, and never two runs mixed in it: locked for the whole run, released by shutdown
        self.run_dir = claim_run_directory(
            config.trainer.output_dir, key="trainer.output_dir", overwrite_key="trainer.overwrite",
            resume_key="trainer.resume", resume=config.trainer.resume, overwrite=config.trainer.overwrite,
            has_checkpoint=lambda _: self.checkpointer.has_any())
        try:
            resume_from = self._check_resume() if self.run_dir.resumes else None  # before any worker starts
            with self.heartbeat.phase(f"starting the workers and loading the models "
                                      f"({', '.join(config.active_roles)})"):
                self.groups, self.pools = build_worker_groups(config, self.specs, mode=mode)
            self._build_step(ptx_loader)
            self.step = 0
            self.best: dict | None = None  # trainer.keep_best: {"metric", "value", "step"} of the best validation
            self.step = self._resume(resume_from) if resume_from is not None else 0
            (self.output_dir / "config.yaml").write_text(dump_yaml(self.user_config))
            set_aside_later_metrics(self.output_dir, self.step)
            trainer = config.trainer
            self.logger = MetricsLogger(self.output_dir, resume_step=self.step,
                                        tensorboard=tensorboard and trainer.tensorboard, loggers=tuple(trainer.loggers),
                                        wandb_project=trainer.wandb_project, run_config=to_plain(config),
                                        project=trainer.project, mlflow_tracking_uri=trainer.mlflow_tracking_uri)
        except BaseException:
            self.run_dir.release()
            raise
        self.episodes: list[tuple] = []  # the last step's sampled episodes, for the loggers' tables
        # a worker process lost (killed, frozen) while the driver waits on another one stops the run within seconds
        remote = [group for group in self.groups.values() if not group.is_local]
        self.monitor = LivenessMonitor(remote, timeout_s=config.trainer.worker_timeout_s) if remote else None

    def _build_step(self, ptx_loader: BatchLoader | None) -> None:
        """The step's parts over the worker groups: the roles' scoring calls (issued as futures), the critics to
        update, the step components and the sampling strategy this config turns on."""
        self.actor = self.groups["actor"]
        self.reference = self.groups.get("reference")
        self.critic = self.groups.get("critic")
        self.reward_model = self.groups.get("reward")
        self.scorers = {role: getattr(self.groups[role], method) for role, method in (
            ("reference", "compute_ref_log_prob"), ("critic", "compute_values"), ("reward", "compute_reward"))
            if role in self.groups}
        self.critics = [self.critic] if self.critic is not None else []
        # the actor's sampling settings with its tokenizer's ids (EOS, stop, pad)
        generation = self.specs.actor.generation.for_call(self.specs.actor.tokens)
        self.components = build_components(self.config, derived=self.derived, generation=generation,
                                           groups=self.groups, score_B=self.response_scores, ptx_loader=ptx_loader)
        self.episode_job = self._episode_job()
        if self.episode_job is not None:
            self.components.append(EpisodeLossMask())
        # one response per prompt, or multi-turn episodes on the rollout's requests (env)
        self.generate = self.actor.generate_sequences if self.episode_job is None else self.actor.generate_episodes
        self.sampling = build_sampling(self.config, loader=self.loader, score_B=self.sample_scores,
                                       pad_token_id=generation.pad_token_id, episode_job=self.episode_job,
                                       current_step=lambda: self.step)
        self.pipeline = None  # a rollout pool of its own: generation runs ahead there (docs/async.md)
        if "rollout" in self.groups:
            rollout = self.groups["rollout"]
            if self.config.asynchrony.streaming:
                self.sampling = self.pipeline = self._streaming(rollout, generation)
            else:
                # the frozen scorers on the rollout pool score each batch there ahead; the trainer the rest
                ahead = {role: scorer for role, scorer in self.scorers.items()
                         if role in self.config.placement.scoring_ahead}
                self.scorers = {role: scorer for role, scorer in self.scorers.items() if role not in ahead}
                self.sampling = self.pipeline = PipelinedSampling(
                    actor=self.actor, rollout=rollout, loader=self.loader, score=self.score,
                    max_staleness=self.config.asynchrony.max_staleness,
                    samples_per_prompt=self.config.batch.samples_per_prompt, run_seed=self.config.trainer.seed,
                    tis_cap=self.config.actor.loss.tis_cap, episodes=self.sampling if self.episode_job else None,
                    ahead=ahead)

    def _streaming(self, rollout, generation) -> StreamingSampling:
        """``async.mode: streaming``: requests in flight on the rollout pool, weights updated between decode steps."""
        config = self.config
        return StreamingSampling(
            actor=self.actor, rollout=rollout, loader=self.loader, score=self.score,
            options=sampling_options(generation), max_staleness=config.asynchrony.max_staleness,
            prompts_per_step=config.batch.prompts_per_step, samples_per_prompt=config.batch.samples_per_prompt,
            decode_tokens=config.asynchrony.stream_decode_tokens, run_seed=config.trainer.seed,
            tis_cap=config.actor.loss.tis_cap)

    def _episode_job(self):
        """What the actor needs to run the step's episodes (``env``), or None for single-turn RL."""
        env = self.config.env
        if env is None:
            return None
        from hybridflow.agents.runner import EpisodeJob, EpisodeLimits

        # unbounded by the config, an episode is still bounded by the actor's positions
        budget = env.max_episode_tokens or max_positions(self.config.actor.model)
        limits = EpisodeLimits(max_turns=env.max_turns, max_episode_tokens=budget,
                               decode_chunk_tokens=env.decode_chunk_tokens, env_threads=env.env_threads,
                               agent_timeout_s=env.agent_timeout_s)
        kwargs = dict(env.kwargs)
        return EpisodeJob(env_class=env.class_path, env_kwargs=kwargs, limits=limits,
                          tokenizer=self.specs.actor_tokenizer, tool_format=env.tool_format,
                          tool_timeout_s=env.tool_timeout_s, on_env_error=env.on_env_error)

    def _dataset(self, path: str) -> PromptDataset:
        return PromptDataset(path, self.tokenizer, max_prompt_tokens=self.config.data.max_prompt_tokens,
                             **self.config.data.prompt_format())

    def _ptx_loader(self) -> BatchLoader | None:
        """PPO-ptx's pretraining rows (``data.ptx_path``), when ``actor.loss.ptx_coef`` > 0."""
        config = self.config
        if config.actor.loss.ptx_coef <= 0:
            return None
        ptx_data = SFTDataset(config.data.ptx_path, self.tokenizer, max_prompt_tokens=config.data.max_prompt_tokens,
                              max_response_tokens=config.data.max_ptx_response_tokens, **config.data.prompt_format())
        return BatchLoader(ptx_data, batch_size=min(config.batch.mini_batch_size, len(ptx_data)),
                           seed=config.trainer.seed)

    # ------------------------------------------------------------------ the loop
    def fit(self, *, on_step=None) -> list[dict]:
        """Run from the current step to ``trainer.total_steps``, then export the trained models to
        ``output_dir/final/<role>``; returns the logged history. Under Ray the worker processes are watched
        meanwhile (``LivenessMonitor``): one lost stops the run within seconds, whatever the driver waits on."""
        if self.stopped:
            raise ValueError("this RLTrainer was shut down (shutdown() stopped its workers); build a new RLTrainer "
                             "from the same config to go on: it resumes from the last checkpoint")
        with self.monitor if self.monitor is not None else contextlib.nullcontext():
            return self._fit(on_step)

    def _fit(self, on_step) -> list[dict]:
        trainer = self.config.trainer
        validates = bool(trainer.val_every) and self.val_data is not None
        reporter = StepReporter("rl", total=trainer.total_steps, initial=self.step, progress_bar=trainer.progress_bar,
                                every=trainer.log_every, keys=SUMMARY_KEYS)
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
                reporter.warn(self.signal.warning)
                last = self.step == trainer.total_steps
                if validates and (self.step % trainer.val_every == 0 or last):
                    metrics.update(self._timed_validation())
                metrics["time/step_s"] = time.perf_counter() - started
                self.logger.log_episodes(self.step, self.episodes)
                self.logger.log(self.step, metrics)
                self._keep_best(self.step, metrics)
                if trainer.save_every and (self.step % trainer.save_every == 0 or last):
                    self.save_checkpoint()
                reporter.update(self.step, metrics)
                if on_step is not None:
                    on_step(self.step, metrics)
        except (WorkerLostError, WorkerTimeoutError) as error:  # a lost or frozen process: say where to resume from
            raise error.with_note(f"the run stopped {self.resume_note()}") from None
        finally:
            reporter.close()
        with self.heartbeat.phase(f"exporting the trained models to {self.output_dir / 'final'}"):
            self.export(self.output_dir / "final")
        return self.logger.history

    def resume_note(self) -> str:
        """Where the run resumes from, for the line a failure or a signal ends it with: ``at step N; last
        checkpoint: PATH; the same command resumes from it``."""
        latest = self.checkpointer.latest()
        if latest is None:
            return (f"at step {self.step}; no checkpoint was saved (trainer.save_every=0 or none reached), so nothing "
                    f"can be resumed")
        return f"at step {self.step}; last checkpoint: {latest}; the same command resumes from it"

    def _timed_validation(self) -> dict[str, float]:
        started = time.perf_counter()
        batches = -(-len(self.val_data) // self.config.batch.prompts_per_step)
        with self.heartbeat.phase(f"validation after step {self.step} ({len(self.val_data)} held-out prompts, "
                                  f"greedy), batches", total=batches):
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

    # ------------------------------------------------------------------ one step
    def train_step(self, prompts: DataProto) -> dict[str, float]:
        """One RL iteration on a batch of prompts (the paper's Figure 1); returns its metrics."""
        timer = PhaseTimer(report=lambda name: self.heartbeat.phase(
            f"step {self.step}/{self.config.trainer.total_steps}: {name}", announce=False))
        seed = self.config.trainer.seed * 1_000_003 + self.step
        # 1. generate, 2. score (one round; DAPO's dynamic sampling draws more)
        experience = self.sampling.sample(prompts, seed, partial(self.generate_and_score, timer=timer))
        return self.learn(experience, seed=seed, timer=timer)  # 3. advantages, 4. updates, 5. metrics

    def generate_and_score(self, prompts: DataProto, *, seed: int, first_uid: int, timer: PhaseTimer) -> DataProto:
        """``samples_per_prompt`` responses per prompt, scored; the samples of one prompt form a group (``uid``)."""
        prompts.meta_info.update(seed=seed, samples_per_prompt=self.config.batch.samples_per_prompt)
        prompts["uid"] = np.arange(len(prompts)) + first_uid
        with timer("generate"):
            batch = self.generate(prompts)  # 3D-HybridEngine: reshard, sample (or run episodes), reshard back
        with timer("score"):
            return self.score(batch)

    def score(self, batch: DataProto) -> DataProto:
        """Reference log-probs, critic values, reward-model scores and what the components add (old log-probs,
        Safe-RLHF's costs and cost values), all issued as futures: roles on different pools run at the same time."""
        futures = [future for component in self.components for future in component.score_futures(batch)]
        futures += [scorer.future(batch) for scorer in self.scorers.values()]
        for future in futures:
            batch = batch.union(future.get())
        return batch

    def learn(self, experience: Experience, *, seed: int, timer: PhaseTimer) -> dict[str, float]:
        """Advantages, the critic's and actor's updates and the step's metrics, from a generated and scored batch
        (the half of a step that an asynchronous trainer runs on a batch its rollout pool made)."""
        batch = experience.batch
        response_mask_BT = batch["response_mask"]  # the generated tokens; a component may drop some from the loss
        scores_B, dense_rewards_BT, reward_metrics = self.rewards(batch)
        advantages = self.advantages(experience, scores_B, dense_rewards_BT)  # 3. advantages
        for key, tensor_BT in {"advantages": advantages.advantages_BT, "returns": advantages.returns_BT,
                               **advantages.extra_BT}.items():
            batch[key] = tensor_BT
        for component in self.components:
            batch["response_mask"] = component.loss_mask(batch, batch["response_mask"])
        batch.meta_info.update(seed=seed, step=self.step)
        transition = first_rank(self.actor.transition_stats())
        with timer("update"):
            updates = self.update(batch)  # 4. update critic and actor
        # the controllers move once the updates are done: this step used the values from before
        kl = sequence_kl(advantages.kl_BT, response_mask_BT)
        self.kl_controller.update(kl, self.derived.samples_per_step)
        for component in self.components:
            component.after_step(batch)
        self.episodes = episode_rows(self.tokenizer, batch, scores_B, step=self.step,
                                     limit=self.config.trainer.episodes_per_log)
        metrics = step_metrics(StepResults(  # 5. the metrics, built in one place
            experience=experience, response_mask_BT=response_mask_BT, batch=batch, reward_metrics=reward_metrics,
            advantages=advantages, sequence_kl=kl, kl_coef=self.kl_controller.value, transition=transition,
            updates=updates, timing=timer.seconds,
            scores_B=scores_B if dense_rewards_BT is None else scores_B + dense_rewards_BT.sum(-1)), self.components)
        self.signal.observe(self.step, metrics)  # driver state like the KL controller's: counted once per step
        return metrics

    def rewards(self, batch: DataProto) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The reward split by where it is credited (``RewardScorer.token_rewards``: sequence_B on the last token,
        dense_BT per token), the components' adjustments applied to sequence_B; and the reward's metrics."""
        scores_B, dense_rewards_BT, metrics = self.scorer.token_rewards(batch)
        for component in self.components:
            scores_B = component.adjust_scores(batch, scores_B)
        return scores_B, dense_rewards_BT, metrics

    def advantages(self, experience: Experience, scores_B: torch.Tensor,
                   dense_rewards_BT: torch.Tensor | None) -> AdvantageResult:
        """KL-shaped rewards -> the estimator's advantages and returns (with the inputs components provide, such as
        ReMax's baseline), then the components' transforms (Safe-RLHF's cost advantages and lambda)."""
        batch = experience.batch
        inputs = {name: value for component in self.components
                  for name, value in component.estimator_inputs(experience).items()}
        # without the old-log-prob pass (skipped as redundant) the sampled log-probs stand in for the KL metric
        old_logprobs_BT = next((batch[key] for key in ("old_logprobs", BEHAVIOUR_KEY) if key in batch),
                               torch.zeros(batch["response_mask"].shape))
        result = compute_advantages(
            algorithm=self.config.algorithm, scores_B=scores_B, dense_rewards_BT=dense_rewards_BT,
            response_mask_BT=batch["response_mask"], old_logprobs_BT=old_logprobs_BT,
            ref_logprobs_BT=batch.get("ref_logprobs"), values_BT=batch.get("values"), group_ids=batch["uid"],
            kl_coef=self.kl_controller.value, **inputs)
        for component in self.components:
            result = component.adjust_advantages(batch, result)
        return result

    def update(self, batch: DataProto) -> list[dict[str, float]]:
        """The critic's update (and the components': Safe-RLHF's cost critic) issued as futures, so that a critic on
        its own pool trains while the actor does; the actor's; the components' after it (PPO-ptx); their metrics."""
        pending = [critic.update_critic.future(batch) for critic in self.critics]
        pending += [future for component in self.components for future in component.update_futures(batch)]
        updates = [first_rank(self.actor.update_actor(batch))]
        updates += [metrics for component in self.components for metrics in component.after_actor_update(batch)]
        return updates + [first_rank(future.get()) for future in pending]

    def response_scores(self, batch: DataProto) -> torch.Tensor:
        """scores_B of generated responses (reward model and/or function, weighted): greedy baselines, validation."""
        if self.reward_model is not None:
            batch = batch.union(self.reward_model.compute_reward(batch))
        return self.scorer.score(batch)[0]

    def sample_scores(self, batch: DataProto) -> torch.Tensor:
        """scores_B of a scored batch with the components' adjustments (what dynamic sampling's ties compare)."""
        scores_B = self.scorer.score(batch)[0]
        for component in self.components:
            scores_B = component.adjust_scores(batch, scores_B)
        return scores_B

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy responses to every held-out prompt, scored like training: ``val/*`` metrics (each a mean over
        the prompts; components add theirs, e.g. Safe-RLHF's ``val/cost_mean``)."""
        assert self.val_data is not None
        columns: dict[str, list[torch.Tensor]] = defaultdict(list)
        for prompts in self.val_data.batches_in_order(self.config.batch.prompts_per_step):
            prompts.meta_info.update(greedy=True, samples_per_prompt=1, episode_job=self.episode_job)
            batch = self.generate(prompts)
            columns["val/score_mean"].append(self.response_scores(batch))
            columns["val/response_length_mean"].append(batch["response_mask"].sum(-1).float())
            self.heartbeat.advance()
            if self.val_rule is not None:
                columns["val/function_mean"].append(self.scorer.rule_scores(batch, self.val_rule))
            for component in self.components:
                for name, values_B in component.validation_scores(batch).items():
                    columns[name].append(values_B)
        return {name: float(torch.cat(parts).mean()) for name, parts in columns.items()}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Driver state (step, data position, KL coefficient, the components' state under their ``state_key``:
        PPO-ptx's data position, Safe-RLHF's log lambda) + every role's engine, atomically."""
        def save_roles(directory: Path) -> None:
            for role, group in self.groups.items():
                if role not in UNSAVED_ROLES:
                    group.save_checkpoint(str(directory / role))
            if self.pipeline is not None:  # the batches generated but not trained yet
                self.pipeline.save(directory)

        state = {"config": to_plain(self.user_config), "best": self.best, "loader": self.loader.state_dict(),
                 "kl_controller": self.kl_controller.state_dict(), "signal": self.signal.state_dict(),
                 **{component.state_key: component.state_dict() for component in self.components
                    if component.state_key is not None}}
        return self.checkpointer.save(self.step, state, save_roles)

    def _check_resume(self) -> Path | None:
        """The checkpoint to resume from, announced with the config changes since it was written; a change beyond
        the loop and layout keys is refused unless ``trainer.allow_config_change``."""
        for name in self.checkpointer.remove_unfinished():  # this run holds the directory: no save is under way
            print(f"resume: removed {name}, a checkpoint the stopped run did not finish", flush=True)
        path = self.checkpointer.resume_point()
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
                "trainer.allow_config_change=true to resume anyway, or trainer.overwrite=true (deletes this run) or "
                "another trainer.output_dir to start a new run")
        total = self.config.trainer.total_steps
        done = "" if state["step"] < total else (f"; trainer.total_steps={total} is reached already, so no step runs "
                                                 f"(raise trainer.total_steps to train on)")
        print(f"resuming from {path} (step {state['step']} of {total}){done}", flush=True)
        if reported or refused:
            print("config changes since that checkpoint:\n  " + "\n  ".join(reported + refused), flush=True)
        return path

    def _resume(self, path: Path) -> int:
        state = self.checkpointer.driver_state(path)
        self.best = state.get("best")
        for role, group in self.groups.items():
            if role not in UNSAVED_ROLES:
                group.load_checkpoint(str(path / role))
        if self.pipeline is not None:
            self.pipeline.load(path)
        self.loader.load_state_dict(state["loader"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        if "signal" in state:  # checkpoints written before the learning-signal monitor have no count
            self.signal.load_state_dict(state["signal"])
        for component in self.components:  # the keys are those of the checkpoints written before the components
            if component.state_key is not None and state.get(component.state_key) is not None:
                component.load_state_dict(state[component.state_key])
        return int(state["step"])

    def shutdown(self) -> None:
        """Stop the workers and give their devices back; the trainer cannot ``fit`` again afterwards."""
        self.stopped = True
        try:
            self.logger.close()
            for group in self.groups.values():
                group.shutdown()  # colocated views share processes; stopping them twice is harmless
            for pool in self.pools:
                pool.release()
        finally:
            self.run_dir.release()


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
