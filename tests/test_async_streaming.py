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


def sample_records(batch) -> list[tuple]:
    """Per sample of a streamed batch: (draw index, sample index in its group, response token ids, their log-probs,
    the version of its oldest token): what identifies a generated sample."""
    samples_per_prompt = batch.meta_info["samples_per_prompt"]
    return [(int(batch[DRAW_INDEX][row]), row % samples_per_prompt,
             tuple(batch["responses"][row][batch["response_mask"][row].bool()].tolist()),
             tuple(batch["logprobs"][row][batch["response_mask"][row].bool()].tolist()),
             int(batch["policy_version"][row])) for row in range(len(batch))]


def _train(config, *, stop_after: int | None = None, samples: list | None = None
           ) -> tuple[list[dict], list[tuple[int, int]]]:
    """The run's metrics per step and, per trained sample, (its prompt's draw index, its dataset row); ``samples``
    gets each trained sample's ``sample_records``. ``stop_after``: the driver dies after that many steps (nothing
    after its last checkpoint survives)."""
    trainer = RLTrainer(config, mode="local", tensorboard=False)
    trained: list[tuple[int, int]] = []
    learn = trainer.learn

    def recording_learn(experience, **kwargs):
        batch = experience.batch
        trained.extend(zip(map(int, batch[DRAW_INDEX]), map(int, batch["row_index"])))
        if samples is not None:
            samples.extend(sample_records(batch))
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
    """The metrics, the trained (draw index, dataset row) and ``sample_records`` of a run without a stop."""
    samples: list[tuple] = []
    history, trained = _train(_config(data_dir, tmp_path_factory.mktemp("streaming_whole")), samples=samples)
    return history, trained, samples


def test_a_replica_keeps_its_requests_across_weight_syncs_and_stamps_every_token_with_its_version(data_dir, tmp_path):
    trainer = RLTrainer(_config(data_dir, tmp_path / "run"), mode="local", tensorboard=False)
    try:
        rollout, actor = trainer.groups["rollout"], trainer.actor
        options = sampling_options(trainer.specs.actor.generation.for_call(trainer.specs.actor.tokens), seed=3)
        requests = tuple(RolloutRequest(f"r{index}", (5, 6, 7, index + 1), options) for index in range(4))
        finished, snapshots = [], []
        for version, work in enumerate([StreamWork(submit=requests, decode_tokens=2),
                                        StreamWork(abort=("r2",), snapshot=("r3", "r9"), decode_tokens=3),
                                        StreamWork(decode_tokens=2)]):  # r9: not held, ignored
            rollout.sync_weights(actor.generation_weights(version)[0])  # between two polls of the same requests
            (report,) = rollout.stream([work])
            assert report.version == version
            finished += report.finished
            snapshots += report.snapshots
        assert report.pending == 0
        assert sorted(output.request_id for output in finished) == ["r0", "r1", "r3"]  # r2 was aborted
        for output in finished:
            assert output.versions == (0, 0, 1, 1, 1, 2) and len(output.token_ids) == 6
            assert all(math.isfinite(value) and value <= 0 for value in output.logprobs)
        # r3's tokens so far, read before the second poll decoded: r3 went on from them
        (snapshot,) = snapshots
        assert (snapshot.request_id, snapshot.versions, snapshot.finish_reason) == ("r3", (0, 0), "abort")
        (r3,) = [output for output in finished if output.request_id == "r3"]
        assert r3.token_ids[:2] == snapshot.token_ids and r3.logprobs[:2] == snapshot.logprobs
    finally:
        trainer.shutdown()


def test_admitted_samples_are_never_more_than_k_versions_stale_and_some_span_several_versions(uninterrupted):
    history, trained, _ = uninterrupted
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
    """A stand-in for the rollout group: one replica whose polls return the outputs put in ``outputs``, and the
    snapshots they ask for from ``partial`` (request id -> its tokens so far)."""

    world_size, is_local = 1, True

    def __init__(self) -> None:
        self.works: list[StreamWork] = []
        self.outputs: list[RolloutOutput] = []
        self.partial: dict[str, RolloutOutput] = {}
        self.stream = self

    def future(self, work: list[StreamWork]) -> _Done:
        self.works.append(work[0])
        outputs, self.outputs = self.outputs, []
        snapshots = [self.partial[request_id] for request_id in work[0].snapshot if request_id in self.partial]
        return _Done([StreamReport(finished=outputs, version=None, pending=0, logprobs_match_training=False,
                                   snapshots=snapshots)])


def _output(request_id: str, versions: tuple[int, ...], reason: str = "stop") -> RolloutOutput:
    """An output whose tokens and log-probs differ by request (a round trip that mixes them up shows); the log-probs
    are exact in float32, as the batch holds them."""
    seed = sum(map(ord, request_id))
    return RolloutOutput(request_id, (1, 2), tuple(seed + token for token in range(len(versions))),
                         tuple(-(seed + token) / 64 for token in range(len(versions))), versions, reason,
                         SamplingOptions(max_new_tokens=4, seed=seed))


def _sampling(replicas: _Replicas) -> StreamingSampling:
    """Streaming sampling on stand-in replicas: k = 1, 2 prompts x 2 samples a step, 4 tokens a response."""
    return StreamingSampling(actor=None, rollout=replicas, loader=None, score=None,
                             options=SamplingOptions(max_new_tokens=4), max_staleness=1, prompts_per_step=2,
                             samples_per_prompt=2, decode_tokens=2, run_seed=0, tis_cap=2.0)


def _two_prompts() -> DataProto:
    return DataProto.from_dict(tensors={"input_ids": torch.tensor([[0, 1, 2], [3, 4, 5]]),
                                        "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])},
                               non_tensors={"row_index": [0, 1]})


def test_the_stale_rule_aborts_and_regenerates_a_group_older_than_k_and_ignores_its_late_outputs():
    replicas = _Replicas()
    sampling = _sampling(replicas)
    sampling.waiting = sampling._groups(_two_prompts())
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


class _Answering(_Replicas):
    """Stand-in replicas whose polls finish every request they submit: 4 tokens, those after a continued request's
    prefix stamped with the version of the last sync."""

    version = -1

    def future(self, work: list[StreamWork]) -> _Done:
        self.outputs += [RolloutOutput(request.request_id, request.prompt_ids, (*request.prefix_ids, 7, 8, 9, 10)[:4],
                                       (*request.prefix_logprobs, -0.5, -0.75, -1.0, -1.25)[:4],
                                       (*request.prefix_versions, *[self.version] * 4)[:4], "length", request.options)
                         for request in work[0].submit]
        return super().future(work)


class _Weights:
    """Stand-in for the weight sync: a sync reaches the replicas at once."""

    def __init__(self, replicas: _Answering) -> None:
        self.replicas, self.version, self.metrics = replicas, None, {}

    def sync(self, version: int) -> None:
        self.version = self.replicas.version = version

    def finish(self) -> None:
        pass


def _checkpointed(directory) -> StreamingSampling:
    """After step 1 (version 1 trains next): two prompts submitted with version 0; prompt 0's samples finished,
    prompt 1's first finished and its second running, 1 token so far; then the checkpoint into ``directory``."""
    replicas = _Replicas()
    sampling = _sampling(replicas)
    sampling.step, sampling.waiting, sampling.weights.version = 1, sampling._groups(_two_prompts()), 0
    sampling._poll()  # submits both prompts
    replicas.outputs = [_output("0:0:0", (0, 0, 0)), _output("0:0:1", (0, 0)), _output("1:0:0", (0, 0, 0, 0))]
    sampling._poll()
    replicas.partial = {"1:0:1": _output("1:0:1", (0,), "abort")}
    sampling.save(directory)
    assert replicas.works[-1] == StreamWork(snapshot=("1:0:1",), decode_tokens=0)  # reads it without decoding
    return sampling


def _resumed(directory) -> tuple[StreamingSampling, _Answering]:
    replicas = _Answering()
    sampling = _sampling(replicas)
    sampling.load(directory)
    sampling.weights = _Weights(replicas)
    sampling.score = lambda batch: batch
    return sampling, replicas


def test_a_checkpoint_keeps_finished_and_running_samples_and_the_resume_trains_them_unchanged_once(tmp_path):
    live = _checkpointed(tmp_path)
    partial = live.rollout.partial["1:0:1"]
    saved = {0: (live.ready[0].outputs, {}), 1: (live.running[1].outputs, {1: partial})}
    assert set(live.ready[0].outputs) == {0, 1} and set(live.running[1].outputs) == {0}
    assert live.running[1].replica == 0 and live.running[1].partial == {}  # in the checkpointing run, it goes on
    sampling, replicas = _resumed(tmp_path)
    assert (sampling.step, sampling.next_draw, sampling.waiting) == (1, 2, [])
    assert {draw: (group.outputs, group.partial) for draw, group in [*sampling.ready.items(),
                                                                     *sampling.running.items()]} == saved
    experience = sampling.sample(_two_prompts(), seed=0)  # step 2 trains version 1: staleness 1 = k, admitted
    continued = replicas.works[0].submit  # the running sample goes on from its tokens so far, nothing else
    assert [(request.request_id, request.prefix_ids, request.prefix_logprobs, request.prefix_versions,
             request.options) for request in continued] == [
        ("1:0:1", partial.token_ids, partial.logprobs, partial.versions, partial.options)]
    batch = experience.batch
    assert list(batch[DRAW_INDEX]) == [0, 0, 1, 1] and list(batch["policy_version"]) == [0, 0, 0, 0]
    records = sample_records(batch)
    finished = [saved[0][0][0], saved[0][0][1], saved[1][0][0]]
    assert [record[2:4] for record in records[:3]] == [(output.token_ids, output.logprobs) for output in finished]
    assert records[3][2][:1] == partial.token_ids and records[3][3][:1] == partial.logprobs
    assert records[3][2][1:] == (7, 8, 9) and experience.sampling_metrics["async/stale_regenerated_groups"] == 0
    sampling.save(tmp_path)  # trained: neither prompt is in flight any more, only the new ones (draws 2 and 3)
    groups = torch.load(tmp_path / "in_flight.pt", weights_only=False)["groups"]
    assert sorted(item["draw_index"] for item in groups) == [2, 3]


def test_a_resumed_group_older_than_k_is_regenerated_and_counted_as_in_a_live_run(tmp_path):
    _checkpointed(tmp_path)
    state = torch.load(tmp_path / "in_flight.pt", weights_only=False)
    torch.save({**state, "step": 2}, tmp_path / "in_flight.pt")  # so step 3 trains version 2: version 0 is 2 stale
    sampling, replicas = _resumed(tmp_path)
    experience = sampling.sample(_two_prompts(), seed=0)
    assert experience.sampling_metrics["async/stale_regenerated_groups"] == 2
    assert [request.request_id for request in replicas.works[0].submit] == ["0:1:0", "0:1:1", "1:1:0", "1:1:1"]
    assert all(not request.prefix_ids for request in replicas.works[0].submit)  # generated again from the start
    assert list(experience.batch[DRAW_INDEX]) == [0, 0, 1, 1] and set(experience.batch["policy_version"]) == {2}


def test_an_in_flight_file_of_format_1_resumes_its_prompts_afresh_and_a_newer_format_is_refused(tmp_path, capsys):
    prompts = _two_prompts()
    torch.save({"step": 3, "next_draw": 9, "polls": 4, "mode": "streaming",
                "untrained": [{"draw_index": 7, "prompt": prompts[[0]]}, {"draw_index": 8, "prompt": prompts[[1]]}]},
               tmp_path / "in_flight.pt")
    sampling, _ = _resumed(tmp_path)
    assert [(group.draw_index, group.outputs) for group in sampling.waiting] == [(7, {}), (8, {})]
    assert (sampling.step, sampling.next_draw, sampling.running, sampling.ready) == (3, 9, {}, {})
    assert "(format 1): they are generated afresh" in capsys.readouterr().out
    torch.save({"format": 3, "mode": "streaming"}, tmp_path / "in_flight.pt")
    with pytest.raises(ValueError, match="has format 3; this hybridflow reads in_flight.pt formats 1 and 2"):
        _resumed(tmp_path)


def test_a_streaming_grpo_run_trains_with_finite_losses(uninterrupted):
    history = uninterrupted[0]
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
    (2, 3, 2),  # step 3 trained and lost; the samples in flight at step 2's checkpoint are continued
    (1, 2, 2),  # stopped right after a checkpoint
])
def test_a_stopped_streaming_run_resumed_trains_every_prompt_of_the_epoch_exactly_once(
        uninterrupted, data_dir, tmp_path, save_every, stop_after, resumes_at):
    config = _config(data_dir, tmp_path / "run", f"trainer.save_every={save_every}")
    samples_before, samples_after = [], []
    _, before = _train(config, stop_after=stop_after, samples=samples_before)
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{resumes_at:06d}"
    kept_partial = [(item["draw_index"], sample, output["token_ids"], output["versions"]) for item in torch.load(
        checkpoint / "in_flight.pt", weights_only=False)["groups"] for sample, output in item["partial"].items()]
    after_history, after = _train(config, samples=samples_after)
    assert len(after_history) == 6 - resumes_at
    kept = before[:resumes_at * 4]  # what the checkpoint holds as trained
    _first_epoch_exactly_once(kept + after)
    assert all(metrics["async/staleness_max"] <= 1 for metrics in after_history)
    # the samples running at the checkpoint (2 of their 6 tokens decoded) were continued from their tokens, and in
    # one process, where the polls run in order, the resumed run trains the uninterrupted run's samples exactly
    assert len(kept_partial) == 4 and all(len(tokens) == 2 for _, _, tokens, _ in kept_partial)
    trained_after = {record[:2]: record for record in samples_after}
    for draw, sample, tokens, versions in kept_partial:
        assert trained_after[draw, sample][2][:2] == tokens and versions == (resumes_at - 1,) * 2
    assert samples_before[:resumes_at * 4] + samples_after == uninterrupted[2]


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

