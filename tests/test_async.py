"""Asynchronous RL (issue 34): the rollout role on its own pool, verified weight syncs, the pipelined schedule
with bounded staleness, and exactly-once data across a resume (docs/async.md)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.engine.weight_sync import (WeightMismatchError, pack_weights, tensor_checksum, unpack_weights,
                                           verify_weights)
from hybridflow.trainers.checkpoint import CheckpointSaveError
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.pipelined import IN_FLIGHT_FILE
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


def _train(config, *, stop_after: int | None = None,
           fail_save_at: int | None = None) -> tuple[list[dict], list[str]]:
    """The run's metrics per step and the prompts each step trained. ``stop_after``: the driver dies after that
    many steps (nothing after its last checkpoint survives); ``fail_save_at``: it dies while writing that step's
    checkpoint, after the in-flight batches were half written."""
    trainer = RLTrainer(config, mode="local", tensorboard=False)
    trained: list[str] = []
    learn = trainer.learn

    def recording_learn(experience, **kwargs):
        trained.extend(str(prompt) for prompt in experience.batch["raw_prompt"])
        return learn(experience, **kwargs)

    def dying_save(directory):
        (directory / IN_FLIGHT_FILE).write_bytes(b"half a file")
        raise OSError("killed while writing the in-flight batches")

    trainer.learn = recording_learn
    history: list[dict] = []
    try:
        if stop_after is None:
            trainer.fit()
            return trainer.logger.history, trained
        while trainer.step < stop_after:
            trainer.step += 1
            history.append(trainer.train_step(trainer.loader.next_batch()))
            if trainer.step == fail_save_at:
                trainer.pipeline.save = dying_save
                with pytest.raises(CheckpointSaveError):
                    trainer.save_checkpoint()
                break
            if trainer.step % config.trainer.save_every == 0:
                trainer.save_checkpoint()
        return history, trained
    finally:
        trainer.shutdown()


def _learning_metrics(history: list[dict]) -> list[dict]:
    """The metrics that depend on the data and the weights (not on the clock)."""
    clock = ("time/", "timing/", "perf/", "async/sync_", "async/wait_")
    return [{name: value for name, value in metrics.items() if not name.startswith(clock) and not name.endswith("_s")}
            for metrics in history]


def test_a_checksum_of_the_raw_bits_catches_one_changed_value_and_swapped_values():
    tensor = torch.randn(64, 33, dtype=torch.bfloat16)
    changed = tensor.clone()
    changed.view(-1).view(torch.int16)[100] += 1  # the smallest change: one unit in the last place
    swapped = tensor.clone()
    swapped.view(-1)[[3, 4]] = tensor.view(-1)[[4, 3]]
    assert tensor_checksum(tensor) == tensor_checksum(tensor.clone())
    assert tensor_checksum(changed) != tensor_checksum(tensor)
    assert not torch.equal(changed, tensor) and not torch.equal(swapped, tensor)
    assert tensor_checksum(swapped) != tensor_checksum(tensor)


def test_weights_survive_packing_into_buckets_bit_for_bit_in_the_generation_dtype():
    state = {"a.weight": torch.randn(5, 7), "b.bias": torch.randn(11), "c.weight": torch.randn(3, 3, 2)}
    payload = pack_weights(state, version=3, dtype=torch.bfloat16, bucket_bytes=100)
    assert len(payload.buckets) == 2 and payload.num_bytes == 2 * (35 + 11 + 18)
    weights = unpack_weights(payload, device=torch.device("cpu"))
    for name, tensor in state.items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name
    verify_weights(weights, payload.checksums, version=3, replica="rollout replica rank 0")


def test_a_corrupted_tensor_in_a_weight_sync_stops_the_run_naming_the_tensor_and_the_replica(data_dir, tmp_path):
    trainer = RLTrainer(_config(data_dir, tmp_path / "run", *SPLIT), mode="local", tensorboard=False)
    try:
        payload = trainer.actor.generation_weights(0)[0]
        trainer.groups["rollout"].sync_weights(payload)  # intact: accepted
        bucket = payload.buckets[-1]
        name = bucket.names[-1]
        bucket.flat[-1] += 1  # what a transfer that lost or changed bytes leaves
        with pytest.raises(Exception, match=rf"tensor '{name}' on rollout replica rank 0 has checksum"):
            trainer.groups["rollout"].sync_weights(payload)
    finally:
        trainer.shutdown()


def test_zero_staleness_on_a_rollout_pool_trains_exactly_like_the_colocated_synchronous_step(data_dir, tmp_path):
    colocated, colocated_prompts = _train(_config(data_dir, tmp_path / "colocated"))
    split, split_prompts = _train(_config(data_dir, tmp_path / "split", *SPLIT))
    assert split_prompts == colocated_prompts
    learned = _learning_metrics(split)
    for step, (expected, got) in enumerate(zip(_learning_metrics(colocated), learned), start=1):
        shared = sorted(set(expected) & set(got) - {name for name in expected if name.startswith("rollout/")})
        assert {"actor/pg_loss", "actor/grad_norm", "reward/score_mean"} <= set(shared)
        for name in shared:
            value = expected[name]
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, name)
        assert got["async/staleness_max"] == 0


ASYNC = (*SPLIT, "async.max_staleness=1", "actor.loss.tis_cap=2.0")


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """A k = 1 run of 4 steps without a stop: its metrics per step and the prompts each step trained."""
    return _train(_config(data_dir, tmp_path_factory.mktemp("whole"), *ASYNC, "trainer.save_every=2"))


def test_with_staleness_one_batch_i_is_generated_by_version_i_minus_two(uninterrupted):
    history, _ = uninterrupted
    assert [metrics["async/staleness_max"] for metrics in history] == [0, 1, 1, 1]
    assert [metrics["async/staleness_count_1"] for metrics in history[1:]] == [4.0] * 3
    assert [metrics["async/weight_version"] for metrics in history] == [0, 1, 2, 3]
    assert all(0 <= metrics["actor/tis_cap_fraction"] <= 1 for metrics in history)
    assert all(metrics["async/sync_bytes"] > 0 and metrics["async/sync_gb_per_s"] > 0 for metrics in history)


@pytest.mark.parametrize("save_every, stop_after, fail_save_at, resumes_at", [
    (2, 3, None, 2),  # step 3 trained and lost, batch 3 in flight in step 2's checkpoint
    (1, 2, None, 2),  # stopped right after a checkpoint: batch 3 in flight is reused
    (1, 3, 3, 2),     # killed while writing step 3's checkpoint: step 2's is the latest
    (2, 1, None, 0),  # killed before any checkpoint: a fresh start
], ids=["after-an-unsaved-step", "after-a-checkpoint", "mid-checkpoint", "before-any-checkpoint"])
def test_a_killed_pipelined_run_resumed_trains_every_prompt_exactly_once_with_the_same_metrics(
        data_dir, tmp_path, uninterrupted, save_every, stop_after, fail_save_at, resumes_at):
    history, prompts = uninterrupted
    config = _config(data_dir, tmp_path / "run", *ASYNC, f"trainer.save_every={save_every}")
    _, before_kill = _train(config, stop_after=stop_after, fail_save_at=fail_save_at)
    after, after_resume = _train(config)
    assert len(before_kill) == stop_after * 4 and len(after) == 4 - resumes_at
    kept = before_kill[:resumes_at * 4]  # what the checkpoint holds as trained
    assert sorted(kept + after_resume) == sorted(prompts)  # per-prompt training counts equal
    assert kept + after_resume == prompts  # and in the same steps
    for expected, got in zip(_learning_metrics(history)[resumes_at:], _learning_metrics(after)):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_staleness_needs_a_rollout_pool_of_its_own(data_dir, tmp_path):
    with pytest.raises(ValueError, match="async.max_staleness got 1"):
        _config(data_dir, tmp_path, "async.max_staleness=1")
    with pytest.raises(ValueError, match="placement.roles.rollout got 'trainer'"):
        _config(data_dir, tmp_path, "placement.pools={trainer: [1]}",
                "placement.roles={actor: trainer, rollout: trainer}")
    with pytest.raises(ValueError, match="placement.mapping got 'auto'"):
        _config(data_dir, tmp_path, *SPLIT, "placement.mapping=auto")
    with pytest.raises(ValueError, match="actor.lora got 'a section'; allowed: null with placement.roles.rollout"):
        _config(data_dir, tmp_path, *SPLIT, "actor.lora={rank: 4}")


def test_on_ray_the_rollout_process_generates_one_step_ahead_with_weights_sent_as_a_future(data_dir, tmp_path):
    """Two processes (actor, rollout replica): the weights go from the actor's output to the replica through the
    object store (the future path), every sync verified, the schedule the single-process runs follow."""
    config = _config(data_dir, tmp_path / "ray", *ASYNC, "placement.runtime=ray", "trainer.total_steps=3")
    trainer = RLTrainer(config, tensorboard=False)
    try:
        history = trainer.fit()
        assert trainer.groups["rollout"].weight_version() == [2]
    finally:
        trainer.shutdown()
    assert [metrics["async/staleness_max"] for metrics in history] == [0, 1, 1]
    assert [metrics["async/weight_version"] for metrics in history] == [0, 1, 2]
    assert all(metrics["async/sync_bytes"] > 0 and metrics["async/sync_verify_s"] > 0 for metrics in history)
