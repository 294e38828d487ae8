"""Streaming mode (``async.mode: streaming``) killed with SIGKILL at the points that matter for it, on Ray, and
resumed (issue 34 item 4): the driver with requests in flight on the replica, the replica in a weight update that
lands between two decode rounds of its requests, the actor mid-update, the driver mid-checkpoint.
After each kill the same config resumes; every prompt of the epoch is trained exactly once, as in an uninterrupted
run. Streaming is not reproducible from the seed, so the metrics are not compared (the pipelined mode's kills,
tests/test_async_failures.py, compare them too). The kills use that file's hooks (docs/async.md "Exactly-once
data")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray.cloudpickle
import torch

from hybridflow.trainers.rl import RLTrainer
from hybridflow.trainers.streaming import DRAW_INDEX
from test_async_failures import KILL_POINTS, _gone, _record_learns, _run_driver_killed, _run_killed, json_of
from test_async_streaming import (DATASET_ROWS, _config, _first_epoch_exactly_once, data_dir,  # noqa: F401 (fixtures)
                                  sample_records, uninterrupted)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

RAY_RUN = ("placement.runtime=ray", "trainer.save_every=1", "trainer.worker_timeout_s=300")
"""test_async_streaming's run (k = 1, 6 steps of 2 prompts x 2 samples, responses of 6 tokens decoded 2 per round)
on Ray: the actor in one process, one rollout replica in another; a checkpoint after every step."""
SAMPLES_PER_STEP = 4


def ray_config(data_dir: Path, output_dir: Path):
    """The config of a RAY_RUN (what ``test_async_failures._driver_main`` runs for this suite)."""
    return _config(data_dir, output_dir, *RAY_RUN)


def identify(batch) -> list[list]:
    """What a learn's batch trained, one ``[draw index, dataset row, sample index in its group, response token ids]``
    per sample (a JSON value): the sample itself, not only its prompt."""
    return [[draw, row, sample, tokens] for draw, row, (_, sample, tokens, *_) in zip(
        map(int, batch[DRAW_INDEX]), map(int, batch["row_index"]), sample_records(batch))]


def saved_samples(checkpoint: Path) -> tuple[dict, dict]:
    """What ``checkpoint``'s ``in_flight.pt`` holds of the groups not trained: (draw index, sample index) -> the
    token ids of each finished sample, and of each running sample's tokens so far."""
    groups = torch.load(checkpoint / "in_flight.pt", weights_only=False)["groups"]
    return tuple({(item["draw_index"], sample): list(output["token_ids"]) for item in groups
                  for sample, output in item[kind].items()} for kind in ("outputs", "partial"))


DRIVER_KILLS = {"generation": ("_issue", lambda sampling: bool(sampling.outstanding is not None and sampling.running)),
                "checkpoint": ("save", lambda sampling: True)}
"""The driver's kill points (``_driver_main``): ``generation:S``, once step S has issued a poll with groups running
(the replica decoding their requests, the driver about to wait for it); ``checkpoint:S``, in step S's checkpoint
once the actor's part and the untrained groups with their samples (``in_flight.pt``) are written, before the
driver's state."""


def _requests_held(rollout, shard, *, version: int) -> dict:
    """What the replica's backend holds as a weight update reaches it: the version, the requests in flight."""
    return {"version": version, "pending": rollout.pending()}


KILLS = {  # as test_async_failures.KILL_POINTS
    "replica mid-sync": ("rollout", "sync_weights", None, "hybridflow.engine.native_rollout:NativeRollout.load", 2,
                         _requests_held),
    "actor mid-update": KILL_POINTS["actor mid-update"],
}
"""The worker kills, each in a run resumed from a checkpoint: the replica as its backend is about to load the second
version it receives (verified, not loaded: the second step's sync, which always finds requests in flight since
the poll issued after a resume's first step decodes one round of 2 of their 6 tokens); the actor at its 4th
optimizer step (the second mini-batch of the second step). The actor mid-checkpoint (in DCP's save, before the
driver writes ``in_flight.pt``) is the pipelined chain's: the same files, the same removal of the partial step."""

SEGMENTS = (  # (who is killed, the kill, the last complete checkpoint when it lands)
    ("driver", "generation:2", 1),
    ("worker", "replica mid-sync", 2),  # resumed at 1: step 3's sync
    ("worker", "actor mid-update", 3),  # resumed at 2: step 4's update
    ("driver", "checkpoint:6", 5),  # resumed at 3: step 6's checkpoint; step 5's, the resume point, after 2 steps
)
"""A checkpoint written after a resume's first step holds running samples only (that step's poll decodes one round,
2 of 6 tokens); step 5's, after the second, finished ones too (its poll decodes for as long as step 4 trained)."""


def _complete(checkpoints: Path) -> list[str]:
    return sorted(path.name for path in checkpoints.glob("step_*") if not path.name.endswith(".partial"))


@pytest.mark.slow
def test_a_streaming_run_killed_at_each_point_resumes_to_train_every_prompt_of_the_epoch_once(
        ray_session, uninterrupted, data_dir, tmp_path):  # noqa: F811 (data_dir, uninterrupted)
    """One run killed four times in turn (SEGMENTS), each time resumed with the same config, then to the end: the
    driver's kills end its workers, a worker's is reported within seconds naming the role, rank, pid and call; no
    partial checkpoint is resumed from; the samples of the steps the checkpoints kept plus those trained after the
    last resume train every prompt of the epoch exactly once, each as a whole group, the draws of the first epoch
    the uninterrupted run's."""
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    address = ray_session.get_runtime_context().gcs_address
    kept: list[list[int]] = []  # the samples of the steps the checkpoints hold as trained
    resumed_at = 0
    for who, kill, saved in SEGMENTS:
        name = kill.replace(" ", "-").replace(":", "-")
        if who == "driver":
            trained, workers = _run_driver_killed(data_dir, run, kill, tmp_path / f"{name}.jsonl", ray_address=address,
                                                  suite=__name__)
            assert _gone(workers, within_s=60.0), kill  # Ray ends a dead driver's workers
            if kill.startswith("checkpoint:"):  # half written: never a resume point, removed by the resume
                partial = checkpoints / f"step_{saved + 1:06d}.partial"
                assert (partial / "in_flight.pt").is_file() and not (partial / "driver.json").exists(), kill
        else:
            trained, error, noticed, killed = _run_killed(ray_config(data_dir, run), kill, tmp_path / f"{name}.json",
                                                          points=KILLS, identify=identify)
            role, method = KILLS[kill][:2]
            assert (error.role, error.rank, error.method, error.pid) == (role, 0, method, killed["pid"]), kill
            print(f"{kill}: reported {noticed:.2f} s after the kill")
            assert noticed < 60.0, kill  # seconds, not the 300 s worker timeout (bound generous: a shared machine)
            assert f"last checkpoint: {checkpoints / f'step_{saved:06d}'}" in error.note, kill
        assert _complete(checkpoints) == [f"step_{step:06d}" for step in range(1, saved + 1)], kill
        assert len(trained) >= (saved - resumed_at) * SAMPLES_PER_STEP, kill
        kept += trained[:(saved - resumed_at) * SAMPLES_PER_STEP]
        resumed_at = saved
    assert json_of(tmp_path, "replica mid-sync")["version"] == 2
    assert json_of(tmp_path, "replica mid-sync")["pending"] > 0  # the update landed between two decode rounds
    trainer = RLTrainer(ray_config(data_dir, run), tensorboard=False)  # resumes from step 5
    after = _record_learns(trainer, identify=identify)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert not list(checkpoints.glob("*.partial"))
    assert len(after) == (6 - resumed_at) * SAMPLES_PER_STEP
    assert [metrics["step"] for metrics in history] == [1, 2, 3, 4, 5, 6]  # metrics.jsonl: the kept steps and these
    whole = kept + after
    prompts = [(draw, row) for draw, row, *_ in whole]
    _first_epoch_exactly_once(prompts)  # every draw a whole group, none twice; the epoch's draws all, each row once
    expected = uninterrupted[1]
    assert len(whole) == len(expected) == 6 * SAMPLES_PER_STEP
    first_epoch = sorted({sample for sample in prompts if sample[0] < DATASET_ROWS})
    assert first_epoch == sorted({sample for sample in expected if sample[0] < DATASET_ROWS})
    assert all(metrics["async/staleness_max"] <= 1 for metrics in history)
    _samples_kept_across_each_resume(whole, checkpoints, history)


def _samples_kept_across_each_resume(whole: list, checkpoints: Path, history: list[dict]) -> None:
    """The samples each resume point's ``in_flight.pt`` holds: each finished one trained exactly once, in a step
    after that checkpoint and unchanged; each running one trained once, continued from its tokens so far. None was
    stale (k steps' worth in flight), so none may be missing."""
    assert sum(metrics["async/stale_regenerated_groups"] for metrics in history) == 0
    trained = {(draw, sample): (index // SAMPLES_PER_STEP, list(tokens)) for index, (draw, _, sample, tokens)
               in enumerate(whole)}  # tokens: a list when read back from a killed driver's JSON, else a tuple
    assert len(trained) == len(whole)  # no sample trained twice
    counts = {"finished": 0, "running": 0}
    for step in sorted({saved for _, _, saved in SEGMENTS}):
        finished, running = saved_samples(checkpoints / f"step_{step:06d}")
        for kind, samples in (("finished", finished), ("running", running)):
            for key, tokens in samples.items():
                trained_at, trained_tokens = trained[key]
                assert trained_at >= step, (step, key)  # in a step after the checkpoint (0-based: step + 1 and on)
                assert trained_tokens[:len(tokens)] == tokens and (kind == "running" or trained_tokens == tokens)
            counts[kind] += len(samples)
    print(f"samples kept across the resumes: {counts}")
    assert counts["finished"] > 0 and counts["running"] > 0, counts
