"""Streaming asynchronous RL (issue 34, ``async.mode: streaming``): requests in flight on the rollout pool across
weight syncs, admission of whole groups at most k versions stale, the stale rule, and exactly-once data across a
resume (docs/async.md "Modes")."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.engine.rollout import RolloutRequest, sampling_options
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer
from hybridflow.trainers.streaming import DRAW_INDEX
from hybridflow.workers.rollout import StreamWork

TASK = ArithmeticTaskConfig(max_digits=1)
DATASET_ROWS = 8
STREAMING = ("placement.pools={trainer: [1], gen: [1]}", "placement.roles={actor: trainer, rollout: gen}",
             "async.mode=streaming", "async.max_staleness=1", "actor.loss.tis_cap=2.0")


def digit_share_reward(prompt: str, response: str, **extra_fields) -> float:
    """The share of digits in the response: two samples of a prompt rarely tie, so GRPO's groups carry signal."""
    return sum(character.isdigit() for character in response) / max(len(response), 1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("streaming_data")
    write_jsonl(directory / "train.jsonl", prompt_rows(DATASET_ROWS, split="train", seed=0, config=TASK))
    return directory


def _config(data_dir, output_dir, *overrides):
    """GRPO on the arithmetic model; responses of exactly 6 tokens decoded 2 per poll, so a response takes three
    polls and the weights change under some of them."""
    return load_rl_config(None, [
        f"data.train_path={data_dir / 'train.jsonl'}", "actor.model.builtin=arithmetic",
        f"reward.function={__file__}:digit_share_reward", "actor.generation.max_new_tokens=6",
        "actor.generation.min_new_tokens=6", "actor.engine.optim.lr=1e-3",
        "actor.engine.dtype=float32", "algorithm.advantage_estimator=grpo", "batch.prompts_per_step=2",
        "batch.samples_per_prompt=2", "batch.mini_batch_size=2", "trainer.total_steps=6",
        "trainer.progress_bar=false", f"trainer.output_dir={output_dir}", "async.stream_decode_tokens=2",
        *STREAMING, *overrides])


def _train(config, *, stop_after: int | None = None) -> tuple[list[dict], list[tuple[int, int]]]:
    """The run's metrics per step and, per trained sample, (its prompt's draw index, its dataset row).
    ``stop_after``: the driver dies after that many steps (nothing after its last checkpoint survives)."""
    trainer = RLTrainer(config, mode="local", tensorboard=False)
    trained: list[tuple[int, int]] = []
    learn = trainer.learn

    def recording_learn(experience, **kwargs):
        batch = experience.batch
        trained.extend(zip(map(int, batch[DRAW_INDEX]), map(int, batch["row_index"])))
        return learn(experience, **kwargs)

    trainer.learn = recording_learn
    try:
        if stop_after is None:
            return trainer.fit(), trained
        history = []
        while trainer.step < stop_after:
            trainer.step += 1
            history.append(trainer.train_step(trainer.loader.next_batch()))
            if trainer.step % config.trainer.save_every == 0:
                trainer.save_checkpoint()
        return history, trained
    finally:
        trainer.shutdown()


def _groups(trained: list[tuple[int, int]]) -> dict[int, int]:
    """Draw index -> how many samples of it were trained."""
    return dict(Counter(draw for draw, _ in trained))


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    return _train(_config(data_dir, tmp_path_factory.mktemp("streaming_whole")))


def test_a_replica_keeps_its_requests_across_weight_syncs_and_stamps_every_token_with_its_version(data_dir, tmp_path):
    trainer = RLTrainer(_config(data_dir, tmp_path / "run"), mode="local", tensorboard=False)
    try:
        rollout, actor = trainer.groups["rollout"], trainer.actor
        options = sampling_options(trainer.specs.actor.generation.for_call(trainer.specs.actor.tokens), seed=3)
        requests = tuple(RolloutRequest(f"r{index}", (5, 6, 7, index + 1), options) for index in range(3))
        finished = []
        for version, work in enumerate([StreamWork(submit=requests, decode_tokens=2),
                                        StreamWork(abort=("r2",), decode_tokens=3), StreamWork(decode_tokens=2)]):
            rollout.sync_weights(actor.generation_weights(version)[0])  # between two polls of the same requests
            (report,) = rollout.stream([work])
            assert report.version == version
            finished += report.finished
        assert report.pending == 0
        assert sorted(output.request_id for output in finished) == ["r0", "r1"]  # r2 was aborted
        for output in finished:
            assert output.versions == (0, 0, 1, 1, 1, 2) and len(output.token_ids) == 6
            assert all(math.isfinite(value) and value <= 0 for value in output.logprobs)
    finally:
        trainer.shutdown()


def test_admitted_samples_are_never_more_than_k_versions_stale_and_some_span_several_versions(uninterrupted):
    history, trained = uninterrupted
    for metrics in history:
        assert metrics["async/staleness_max"] <= 1
        counts = {name: value for name, value in metrics.items() if name.startswith("async/staleness_count_")}
        assert set(counts) <= {"async/staleness_count_0", "async/staleness_count_1"}
        assert sum(counts.values()) == 4  # a step's 2 groups x 2 samples
        assert 0 <= metrics["actor/tis_cap_fraction"] <= 1
    assert history[0]["async/staleness_max"] == 0  # version 0 trains what version 0 made
    assert any(metrics["async/staleness_max"] == 1 for metrics in history[1:])
    assert any(metrics["async/multi_version_fraction"] > 0 for metrics in history)  # weights changed mid-response
    assert all(count == 2 for count in _groups(trained).values())  # a group is trained whole or not at all


def test_a_group_that_went_stale_is_regenerated_and_trained_once_fresh(uninterrupted):
    history, trained = uninterrupted
    assert sum(metrics["async/stale_regenerated_groups"] for metrics in history) > 0
    groups = _groups(trained)
    assert len(groups) == len(history) * 2 and all(count == 2 for count in groups.values())


def test_a_streaming_grpo_run_trains_with_finite_losses(uninterrupted):
    history, _ = uninterrupted
    assert len(history) == 6
    for metrics in history:
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
        assert metrics["async/sync_bytes"] > 0 and metrics["async/sync_gb_per_s"] > 0
    assert sum(metrics["actor/grad_norm"] > 0 for metrics in history) >= 4  # groups rarely tie on this reward
    assert [metrics["async/weight_version"] for metrics in history] == [0, 1, 2, 3, 4, 5]


def _first_epoch_exactly_once(trained: list[tuple[int, int]]) -> None:
    """No prompt trained twice; the first epoch's draws (0 .. rows - 1) all trained, each dataset row once."""
    groups = _groups(trained)
    assert all(count == 2 for count in groups.values()), groups
    first_epoch = sorted({(draw, row) for draw, row in trained if draw < DATASET_ROWS})
    assert [draw for draw, _ in first_epoch] == list(range(DATASET_ROWS))
    assert sorted(row for _, row in first_epoch) == sorted(set(row for _, row in first_epoch))
    assert len({row for _, row in first_epoch}) == DATASET_ROWS


def test_every_prompt_of_an_epoch_is_trained_exactly_once(uninterrupted):
    _first_epoch_exactly_once(uninterrupted[1])


@pytest.mark.parametrize("save_every, stop_after, resumes_at", [
    (2, 3, 2),  # step 3 trained and lost; the prompts in flight at step 2's checkpoint are regenerated
    (1, 2, 2),  # stopped right after a checkpoint
])
def test_a_stopped_streaming_run_resumed_trains_every_prompt_of_the_epoch_exactly_once(
        data_dir, tmp_path, save_every, stop_after, resumes_at):
    config = _config(data_dir, tmp_path / "run", f"trainer.save_every={save_every}")
    _, before = _train(config, stop_after=stop_after)
    after_history, after = _train(config)
    assert len(after_history) == 6 - resumes_at
    kept = before[:resumes_at * 4]  # what the checkpoint holds as trained
    _first_epoch_exactly_once(kept + after)
    assert all(metrics["async/staleness_max"] <= 1 for metrics in after_history)


def test_streaming_needs_staleness_and_a_backend_that_takes_weights_in_flight(data_dir, tmp_path):
    with pytest.raises(ValueError, match="async.max_staleness got 0"):
        _config(data_dir, tmp_path, "async.max_staleness=0")
    with pytest.raises(ValueError, match="async.stream_decode_tokens got 0"):
        _config(data_dir, tmp_path, "async.stream_decode_tokens=0")
    with pytest.raises(ValueError, match="actor.generation.backend got 'vllm'; allowed: a backend that takes new "
                                         "weights between decode steps with async.mode=streaming: native"):
        _config(data_dir, tmp_path, "actor.generation.backend=vllm")
