"""How a step draws its samples: one round of generate-and-score, DAPO's dynamic sampling (more rounds until
the step holds ``prompts_per_step`` groups whose scores are not all equal), or multi-turn episodes (``env``).

A strategy's ``sample(prompts, seed, generate_and_score)`` returns the step's ``Experience``; it calls
``generate_and_score(prompts, seed=, first_uid=)`` (``RLTrainer.generate_and_score``) once per round.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hybridflow.algorithms import dynamic_sampling_keep_mask, first_kept_groups
from hybridflow.models.moe import ROUTED_EXPERTS, ROUTING_PAD
from hybridflow.protocol import DataProto
from hybridflow.trainers.config.rl import RLConfig
from hybridflow.trainers.step import Experience, StepComponent


class OneRound:
    """The paper's step: the step's prompts, generated and scored once."""

    def sample(self, prompts: DataProto, seed: int, generate_and_score) -> Experience:
        return Experience(prompts=prompts, batch=generate_and_score(prompts, seed=seed, first_uid=0))


class DynamicSampling:
    """DAPO's dynamic sampling: drop the groups whose scores (with the components' adjustments, e.g. the overlong
    penalty) all tie, and draw another batch of prompts from the loader while fewer than ``prompts_per_step``
    groups are kept, up to ``max_rounds`` rounds; short of a full batch, the earliest dropped groups fill it up
    (their advantages are 0, so they only count in the loss's normaliser)."""

    ROUND_SEED_STRIDE = 7919
    """Round r generates with seed + r * this (a prime, so rounds of nearby steps do not share seeds)."""

    def __init__(self, *, loader, score_B, prompts_per_step: int, max_rounds: int, pad_token_id: int) -> None:
        """``score_B(batch)``: the score of each sample that decides ties."""
        self.loader, self.score_B, self.need = loader, score_B, prompts_per_step
        self.max_rounds, self.pad_token_id = max_rounds, pad_token_id

    def sample(self, prompts: DataProto, seed: int, generate_and_score) -> Experience:
        first_prompts, need = prompts, self.need
        rounds, round_scores = [], []
        for round_index in range(self.max_rounds):
            if round_index > 0:
                prompts = self.loader.next_batch()
            batch = generate_and_score(prompts, seed=seed + self.ROUND_SEED_STRIDE * round_index,
                                       first_uid=round_index * need)  # group ids stay unique across rounds
            rounds.append(batch)
            round_scores.append(self.score_B(batch))
            ids = np.concatenate([part["uid"] for part in rounds]).tolist()
            keep_B = dynamic_sampling_keep_mask(torch.cat(round_scores), ids)
            rows_R, groups_kept = first_kept_groups(keep_B, ids, num_groups=need)
            if groups_kept >= need:
                break
        batch = concat_rounds(rounds, pad_token_id=self.pad_token_id)
        rows = rows_R.tolist()
        if groups_kept < need:  # round limit reached: fill up with tied groups (zero advantage) to a full batch
            tied_ids = list(dict.fromkeys(ids[row] for row in np.flatnonzero(~keep_B.numpy())))[:need - groups_kept]
            rows = sorted(rows + [row for row, uid in enumerate(ids) if uid in set(tied_ids)])
        metrics = {"sampling/rounds": float(len(rounds)), "sampling/prompts_drawn": float(len(rounds) * need),
                   "sampling/kept_group_fraction": groups_kept / (len(rounds) * need),
                   "sampling/filled_groups": float(max(need - groups_kept, 0))}
        return Experience(prompts=first_prompts, batch=batch[np.asarray(rows)], sampling_metrics=metrics)


class EpisodeSampling:
    """Multi-turn episodes (``env``): the step's prompts, ``samples_per_prompt`` episodes each (a group per prompt),
    run by the actor's ``generate_episodes`` and scored like responses. An episode whose environment failed trains
    nothing under ``env.on_env_error: drop`` (``EpisodeLossMask``); under ``zero_reward`` it trains with reward 0.
    The ``agent/*`` metrics come from the episodes' records; every ``env.record_every`` steps a few episodes go to
    ``output_dir/episodes.jsonl``."""

    def __init__(self, *, job, env, output_dir: Path, current_step) -> None:
        """``job``: the ``EpisodeJob`` the actor runs; ``current_step()``: the step being sampled."""
        self.job, self.env, self.path, self.current_step = job, env, Path(output_dir) / "episodes.jsonl", current_step

    def sample(self, prompts: DataProto, seed: int, generate_and_score) -> Experience:
        batch = generate_and_score(self.prepare(prompts), seed=seed, first_uid=0)
        return Experience(prompts=prompts, batch=batch, sampling_metrics=self.observe(batch))

    rollout_method = "generate_episodes"
    """The rollout replicas' method that generates what ``prepare`` describes (``PipelinedSampling``)."""

    def prepare(self, prompts: DataProto) -> DataProto:
        """``prompts`` with the job a ``generate_episodes`` call runs (the actor's, or a rollout replica's)."""
        prompts.meta_info["episode_job"] = self.job
        return prompts

    def observe(self, batch: DataProto) -> dict[str, float]:
        """The ``agent/*`` metrics of a generated batch of episodes; a few of them recorded (``record``)."""
        from hybridflow.agents.episode_batch import episode_metrics

        records = list(batch["episode"])
        self.record(records)
        return episode_metrics(records, generation_seconds=float(batch.meta_info.get("episode_generation_s", 0.0)))

    def record(self, records: list[dict]) -> None:
        """Append the first ``env.record_episodes`` episodes to ``episodes.jsonl`` on every ``record_every``-th step."""
        step = self.current_step()
        if not self.env.record_every or step % self.env.record_every:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            for record in records[:self.env.record_episodes]:
                file.write(json.dumps({"step": step, **record}, default=str) + "\n")


class EpisodeLossMask(StepComponent):
    """Takes the episodes that must not train (``episode_trainable`` false: failed under ``env.on_env_error: drop``,
    or nothing sampled) out of the loss once the advantages are computed: their rows keep the batch's size
    (mini-batches stay whole) and count as sequences in the loss's normaliser, with no token in it; their score is
    their group's mean, so they leave a group estimator's mean baseline as it is."""

    def adjust_scores(self, batch: DataProto, scores_B: torch.Tensor) -> torch.Tensor:
        """An untrained episode scores its group's mean (over the trained members; 0 if none), so that it leaves
        the group's mean baseline as the trained episodes make it."""
        trainable_B = batch["episode_trainable"]
        if bool(trainable_B.all()):
            return scores_B
        totals_B = scores_B + batch["episode_turn_rewards"].to(scores_B.dtype).sum(dim=-1)
        groups = np.asarray(batch["uid"])
        scores_B = scores_B.clone()
        for row in np.flatnonzero(~trainable_B.numpy()):
            members_B = torch.from_numpy(groups == groups[row]) & trainable_B
            scores_B[row] = totals_B[members_B].mean() if bool(members_B.any()) else 0.0
        return scores_B

    def loss_mask(self, batch: DataProto, mask_BT: torch.Tensor) -> torch.Tensor:
        return mask_BT * batch["episode_trainable"].to(mask_BT.dtype)[:, None]

    def metrics(self, results) -> dict[str, float]:
        return {"agent/untrained_episodes": float((~results.batch["episode_trainable"]).sum())}


def build_sampling(config: RLConfig, *, loader, score_B, pad_token_id: int, episode_job=None,
                   current_step=None) -> OneRound | DynamicSampling | EpisodeSampling:
    """The sampling strategy of an ``RLConfig`` (``env``, ``algorithm.dynamic_sampling``)."""
    if config.env is not None:
        return EpisodeSampling(job=episode_job, env=config.env, output_dir=Path(config.trainer.output_dir),
                               current_step=current_step)
    algorithm = config.algorithm
    if not algorithm.dynamic_sampling:
        return OneRound()
    return DynamicSampling(loader=loader, score_B=score_B, prompts_per_step=config.batch.prompts_per_step,
                           max_rounds=algorithm.max_sampling_rounds, pad_token_id=pad_token_id)


def concat_rounds(rounds: list[DataProto], *, pad_token_id: int) -> DataProto:
    """The rows of several generation rounds as one batch: prompts left-padded to the widest round's."""
    widths = [len(batch["input_ids"][0]) - len(batch["responses"][0]) for batch in rounds]
    padded = []
    for batch, width in zip(rounds, widths):
        extra = max(widths) - width
        if extra:
            batch = batch[np.arange(len(batch))]  # a copy: the round's own tensors stay as they were
            fills = {"input_ids": pad_token_id, "prompts": pad_token_id, "attention_mask": 0, "position_ids": 0,
                     ROUTED_EXPERTS: ROUTING_PAD}
            for key, fill in fills.items():
                if key in batch:  # columns are dim 1 ([B, S], routing replay's [B, S, L, K])
                    trailing = (0, 0) * (batch[key].dim() - 2)
                    batch[key] = torch.nn.functional.pad(batch[key], (*trailing, extra, 0), value=fill)
        padded.append(batch)
    return DataProto.concat(padded)
