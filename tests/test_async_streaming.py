"""Streaming asynchronous RL (issue 34, ``async.mode: streaming``): requests in flight on the rollout pool across
weight syncs, admission of whole groups at most k versions stale, the stale rule, and exactly-once data across a
resume (docs/async.md "Modes")."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.engine.rollout import RolloutOutput, RolloutRequest, SamplingOptions, sampling_options
from hybridflow.protocol import DataProto
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer
from hybridflow.trainers.streaming import DRAW_INDEX, StreamingSampling
from hybridflow.workers.rollout import StreamReport, StreamWork

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
    assert sum(metrics["async/stale_regenerated_groups"] for metrics in history) == 0  # k steps' worth in flight
    assert all(count == 2 for count in _groups(trained).values())  # a group is trained whole or not at all


class _Done:
    """A controller future that has finished."""

    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        return self.value


class _Replicas:
    """A stand-in for the rollout group: one replica whose polls return the outputs given to ``finish``."""

    world_size, is_local = 1, True

    def __init__(self) -> None:
        self.works: list[StreamWork] = []
        self.outputs: list[RolloutOutput] = []
        self.stream = self

    def future(self, work: list[StreamWork]) -> _Done:
        self.works.append(work[0])
        outputs, self.outputs = self.outputs, []
        return _Done([StreamReport(finished=outputs, version=None, pending=0, logprobs_match_training=False)])


def _output(request_id: str, versions: tuple[int, ...]) -> RolloutOutput:
    return RolloutOutput(request_id, (1, 2), tuple(range(len(versions))), (-1.0,) * len(versions), versions, "stop")


def test_the_stale_rule_aborts_and_regenerates_a_group_older_than_k_and_ignores_its_late_outputs():
    replicas = _Replicas()
    options = SamplingOptions(max_new_tokens=4)
    sampling = StreamingSampling(actor=None, rollout=replicas, loader=None, score=None, options=options,
                                 max_staleness=1, prompts_per_step=2, samples_per_prompt=2, decode_tokens=2,
                                 run_seed=0, tis_cap=2.0)
    prompts = DataProto.from_dict(tensors={"input_ids": torch.tensor([[0, 1, 2], [3, 4, 5]]),
                                           "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])},
                                  non_tensors={"row_index": [0, 1]})
    sampling.waiting = sampling._groups(prompts)
    sampling.weights.version = 0
    sampling._issue()  # both prompts submitted with version 0
    assert [request.request_id for request in replicas.works[0].submit] == ["0:0:0", "0:0:1", "1:0:0", "1:0:1"]
    assert replicas.works[0].submit[0].prompt_ids == (1, 2) and replicas.works[0].submit[2].prompt_ids == (3, 4, 5)
    sampling._poll()
    replicas.outputs = [_output("0:0:0", (0, 1)), _output("0:0:1", (0, 0))]
    sampling.weights.version = 1
    sampling._poll()  # prompt 0 finished (oldest token: version 0), prompt 1 still running
    assert list(sampling.ready) == [0] and list(sampling.running) == [1]

    sampling._restart_stale(trained=1)  # staleness 1 = k: nothing to do
    assert list(sampling.ready) == [0] and sampling.regenerated == 0
    sampling._restart_stale(trained=2)  # both groups hold a version-0 token: 2 versions stale
    assert sampling.ready == {} and sampling.running == {} and sampling.regenerated == 2
    assert [(group.draw_index, group.attempt) for group in sampling.waiting] == [(0, 1), (1, 1)]
    sampling.weights.version = 2
    replicas.outputs = [_output("1:0:0", (0, 1, 2)), _output("1:0:1", (0, 1, 2))]  # the dropped attempt, late
    sampling._poll()
    assert set(replicas.works[-1].abort) == {"1:0:0", "1:0:1"}  # the running group's requests, aborted
    assert [request.request_id for request in replicas.works[-1].submit] == ["0:1:0", "0:1:1", "1:1:0", "1:1:1"]
    assert sampling.ready == {} and all(group.submitted_version == 2 for group in sampling.running.values())


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


def test_streaming_needs_staleness_and_a_backend_that_takes_weights_in_flight(data_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="async.max_staleness got 0"):
        _config(data_dir, tmp_path, "async.max_staleness=0")
    with pytest.raises(ValueError, match="async.stream_decode_tokens got 0"):
        _config(data_dir, tmp_path, "async.stream_decode_tokens=0")
    from hybridflow.engine.rollout import ROLLOUT_BACKENDS

    # a backend with requests whose loads do not reach the requests in flight
    monkeypatch.setitem(ROLLOUT_BACKENDS, "frozen", dataclasses.replace(ROLLOUT_BACKENDS["native"],
                                                                         in_flight_weights=False))
    with pytest.raises(ValueError, match="actor.generation.backend got 'frozen'; allowed: a backend that takes new "
                                         "weights between decode steps with async.mode=streaming: native, vllm"):
        _config(data_dir, tmp_path, "actor.generation.backend=frozen")


@pytest.mark.slow
def test_on_ray_the_replica_decodes_while_the_step_trains_and_admits_nothing_staler_than_k(data_dir, tmp_path):
    """Two processes: the polls overlap the actor's update (rounds for as long as the last step trained), the
    weights reach the replica as a future between rounds, and the admission bound holds."""
    config = _config(data_dir, tmp_path / "ray", "placement.runtime=ray", "trainer.total_steps=4")
    trainer = RLTrainer(config, tensorboard=False)
    try:
        history = trainer.fit()
        assert trainer.groups["rollout"].weight_version() == [3]
    finally:
        trainer.shutdown()
    assert [metrics["async/weight_version"] for metrics in history] == [0, 1, 2, 3]
    assert all(metrics["async/staleness_max"] <= 1 for metrics in history)
    assert all(metrics["async/sync_bytes"] > 0 and metrics["async/sync_verify_s"] > 0 for metrics in history)


def test_streaming_refuses_episodes(data_dir, tmp_path):
    with pytest.raises(ValueError, match="env got 'a section'; allowed: null with"):
        _config(data_dir, tmp_path, "reward.function=null", "env.class=hybridflow.agents:RewardFunctionEnvironment")

