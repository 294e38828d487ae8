"""Asynchronous RL (issue 34): the rollout role on its own pool, verified weight syncs, the pipelined schedule
with bounded staleness, and exactly-once data across a resume (docs/async.md)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.engine.weight_sync import (WeightMismatchError, pack_weights, tensor_checksum, unpack_weights,
                                           verify_weights)
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer

TASK = ArithmeticTaskConfig(max_digits=1)
SPLIT = ("placement.pools={trainer: [1], gen: [1]}", "placement.roles={actor: trainer, rollout: gen}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("async_data")
    write_jsonl(directory / "train.jsonl", prompt_rows(12, split="train", seed=0, config=TASK))
    return directory


def _config(data_dir, output_dir, *overrides):
    return load_rl_config(None, [
        f"data.train_path={data_dir / 'train.jsonl'}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        "actor.generation.max_new_tokens=4", "actor.engine.optim.lr=1e-3", "actor.engine.dtype=float32",
        "algorithm.advantage_estimator=grpo", "batch.prompts_per_step=2", "batch.samples_per_prompt=2",
        "batch.mini_batch_size=2", "trainer.total_steps=4", "trainer.progress_bar=false",
        f"trainer.output_dir={output_dir}", *overrides])


def _train(config, *, stop_after: int | None = None) -> tuple[list[dict], list[str]]:
    """The run's metrics per step and the prompts each step trained (kill after ``stop_after`` steps)."""
    trainer = RLTrainer(config, mode="local", tensorboard=False)
    trained: list[str] = []
    learn = trainer.learn

    def recording_learn(experience, **kwargs):
        trained.extend(str(prompt) for prompt in experience.batch["raw_prompt"])
        return learn(experience, **kwargs)

    trainer.learn = recording_learn
    history: list[dict] = []
    try:
        if stop_after is None:
            trainer.fit()
        else:
            while trainer.step < stop_after:
                trainer.step += 1
                history.append(trainer.train_step(trainer.loader.next_batch()))
                if trainer.step % config.trainer.save_every == 0:
                    trainer.save_checkpoint()
            return history, trained
        return trainer.logger.history, trained
    finally:
        trainer.shutdown()
