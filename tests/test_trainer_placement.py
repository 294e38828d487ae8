"""Placement on Ray: every role colocated on one pool vs actor+reference | critic+reward on two pools."""

from __future__ import annotations

import pytest

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer
from test_trainer import reproducible


def _run(tmp_path, name: str, *placement: str) -> list[dict]:
    task = ArithmeticTaskConfig(max_digits=1)
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(16, split="train", seed=0, config=task))
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
        "reward.model.builtin=arithmetic", "reward.function=arithmetic", "actor.generation.max_new_tokens=4",
        "actor.engine.optim.lr=1e-3", "critic.engine.optim.lr=1e-3", "batch.prompts_per_step=4", "batch.samples_per_prompt=2",
        "batch.mini_batch_size=4", "trainer.total_steps=2", "trainer.progress_bar=false",
        f"trainer.output_dir={tmp_path / name}", *placement])
    trainer = RLTrainer(config, mode="ray", tensorboard=False)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def test_colocated_and_split_placements_give_equal_metrics_for_one_seed(ray_session, tmp_path):
    colocated = _run(tmp_path, "colocated", "placement.pools={all: [1]}")
    split = _run(tmp_path, "split", "placement.pools={policy: [1], scoring: [1]}",
                 "placement.roles={actor: policy, reference: policy, critic: scoring, reward: scoring}")
    assert len(colocated) == len(split) == 2
    for step_colocated, step_split in zip(colocated, split):
        for name, value in step_colocated.items():
            if reproducible(name):
                assert step_split[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
