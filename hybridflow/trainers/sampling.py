"""How a step draws its samples: one round of generate-and-score, or DAPO's dynamic sampling (more rounds until
the step holds ``prompts_per_step`` groups whose scores are not all equal).

A strategy's ``sample(prompts, seed, generate_and_score)`` returns the step's ``Experience``; it calls
``generate_and_score(prompts, seed=, first_uid=)`` (``RLTrainer.generate_and_score``) once per round.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms import dynamic_sampling_keep_mask, first_kept_groups
from hybridflow.protocol import DataProto
from hybridflow.trainers.config.rl import RLConfig
from hybridflow.trainers.step import Experience


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


def build_sampling(config: RLConfig, *, loader, score_B, pad_token_id: int) -> OneRound | DynamicSampling:
    """The sampling strategy of an ``RLConfig`` (``algorithm.dynamic_sampling``)."""
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
            fills = {"input_ids": pad_token_id, "prompts": pad_token_id, "attention_mask": 0, "position_ids": 0}
            for key, fill in fills.items():
                if key in batch:
                    batch[key] = torch.nn.functional.pad(batch[key], (extra, 0), value=fill)
        padded.append(batch)
    return DataProto.concat(padded)
