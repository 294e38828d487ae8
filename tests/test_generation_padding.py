"""Prompts that the actor's generation replicas do not divide: padded for generation, exact for training.

``RLConfig.derived`` no longer requires the generation replicas (actor pool devices / (pg tg)) to
divide ``batch.prompts_per_step``: the generation dispatch (``3D_ALL_MICRO_DP``) pads the prompts to
a multiple of the replicas by repeating rows, and its collect drops the samples of those rows (k per
padded prompt, k = samples per prompt, which the worker repeats after dispatch, prompt-major). These
tests check the config accepts such a layout while keeping the data-parallel rules, and that one GRPO
step on Ray (3 prompts x 2 samples on 2 replicas: replica 0 generates prompts 0 and 1, replica 1
prompt 2 and a repeat of prompt 0) trains on exactly the 6 samples of the 3 prompts, in order, each
prompt's two samples side by side under its own group id.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config

PROMPTS, SAMPLES, MAX_NEW_TOKENS = 3, 2, 4


def character_reward(prompt: str, response: str, **extra_fields) -> float:
    """A rule reward that varies with the response, so the GRPO groups have non-zero advantages."""
    return sum(ord(char) for char in response) % 7 / 7.0


def _overrides(train_path, *extra: str) -> list[str]:
    return [f"data.train_path={train_path}", "actor.model.builtin=arithmetic",
            f"reward.function={__file__}:character_reward", "algorithm.advantage_estimator=grpo",
            "algorithm.kl_mode=none", f"actor.generation.max_new_tokens={MAX_NEW_TOKENS}",
            "placement.pools={all: [2]}", f"batch.prompts_per_step={PROMPTS}",
            f"batch.samples_per_prompt={SAMPLES}", f"batch.mini_batch_size={PROMPTS * SAMPLES}", *extra]


def test_a_config_whose_generation_replicas_do_not_divide_the_prompts_builds():
    config = load_rl_config(None, _overrides("train.jsonl"))
    derived = config.derived()
    assert derived.generation_replicas == 2
    assert derived.dp_sizes == {"actor": 2}
    assert derived.samples_per_step == 6


def test_data_parallel_sizes_must_still_divide_the_samples_per_step_and_the_mini_batch():
    with pytest.raises(ValueError, match=r"samples per step \(3\) divisible by actor's data-parallel size 2"):
        load_rl_config(None, _overrides("train.jsonl", "algorithm.advantage_estimator=gae",
                                        "algorithm.kl_mode=auto", "batch.samples_per_prompt=1",
                                        "batch.mini_batch_size=3"))
    with pytest.raises(ValueError, match="batch.mini_batch_size.*a multiple of actor's data-parallel size 2"):
        load_rl_config(None, _overrides("train.jsonl", "batch.mini_batch_size=3"))


class _Recorder:
    """The actor's worker group, recording the prompts sent to generation and the batch sent to training."""

    def __init__(self, group) -> None:
        self._group, self.prompts, self.generated, self.trained = group, [], [], []

    def __getattr__(self, name):
        return getattr(self._group, name)

    def generate_sequences(self, prompts):
        self.prompts.append(prompts)
        self.generated.append(self._group.generate_sequences(prompts))
        return self.generated[-1]

    def update_actor(self, batch):
        self.trained.append(batch)
        return self._group.update_actor(batch)


@pytest.mark.slow
def test_a_grpo_step_with_prompts_padded_over_two_replicas_trains_on_each_prompts_samples_in_order(
        ray_session, tmp_path):
    from hybridflow.trainers.rl import RLTrainer

    train_path = tmp_path / "train.jsonl"
    write_jsonl(train_path, prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1)))
    config = load_rl_config(None, _overrides(train_path, "trainer.total_steps=1", "trainer.progress_bar=false",
                                             "trainer.resume=false", f"trainer.output_dir={tmp_path / 'run'}"))
    trainer = RLTrainer(config, mode="ray", tensorboard=False)
    try:
        assert trainer.groups["actor"].mesh.generation.num_replicas == 2
        recorder = trainer.actor = _Recorder(trainer.actor)
        trainer.generate = recorder.generate_sequences  # the step calls the generation bound when it was built
        history = trainer.fit()
    finally:
        trainer.shutdown()
    [prompts], [generated], [trained] = recorder.prompts, recorder.generated, recorder.trained
    assert len(prompts) == PROMPTS
    assert len(generated) == len(trained) == PROMPTS * SAMPLES  # the repeated prompt's 2 samples are dropped
    # prompt-major: rows 2i and 2i+1 are prompt i's samples, under group id i
    prompt_of_row = np.repeat(np.arange(PROMPTS), SAMPLES)
    assert trained["uid"].tolist() == prompt_of_row.tolist()
    assert torch.equal(trained["prompts"], prompts["input_ids"][torch.from_numpy(prompt_of_row)])
    assert torch.equal(trained["responses"], generated["responses"])
    # GRPO's advantages are centred within each group of two samples: a pair's sum is zero
    first_token_advantages_G2 = trained["advantages"][:, 0].reshape(PROMPTS, SAMPLES)
    torch.testing.assert_close(first_token_advantages_G2.sum(-1), torch.zeros(PROMPTS), rtol=0, atol=1e-5)
    assert [record["step"] for record in history] == [1]
    assert history[0]["actor/grad_norm"] > 0  # the actor trained on them
