"""A rollout replica lost while the trainer trains (issue 34 item 6): a killed (SIGKILL) or frozen (SIGSTOP) process
is noticed within seconds whatever the driver waits on, reported in one line naming the role, rank, pid and host,
and the run stops with its last checkpoint intact; a resume trains every prompt exactly once (docs/async.md)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray.cloudpickle

from hybridflow.controller import (LivenessMonitor, ResourcePool, Worker, WorkerGroup, WorkerLostError,
                                   WorkerTimeoutError, register)
from hybridflow.controller.future import DRIVER_CHECKS
from hybridflow.trainers.boundary import one_line
from hybridflow.trainers.rl import RLTrainer
from test_async import ASYNC, _config, _learning_metrics, data_dir  # noqa: F401 (data_dir: a fixture)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SleepyWorker(Worker):
    @register("ONE_TO_ALL")
    def pid(self) -> int:
        return os.getpid()

    @register("ONE_TO_ALL", blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module")
def groups(ray_session):
    """A busy group (what the driver waits on: the trainer) and a watched one of two ranks (the rollout replicas),
    shared by the tests below in their order: the last one kills a watched rank."""
    pools = [ResourcePool([1], name="busy"), ResourcePool([2], name="watched")]
    busy = WorkerGroup(pools[0], SleepyWorker, name="trainer", timeout_s=300)
    watched = WorkerGroup(pools[1], SleepyWorker, name="rollout", timeout_s=300)
    yield busy, watched
    for group in (busy, watched):
        group.shutdown()
    for pool in pools:
        pool.release()


def test_a_healthy_group_is_not_reported_while_its_calls_take_longer_than_the_poll(groups):
    busy, watched = groups
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0, got 0"):
        LivenessMonitor(watched, timeout_s=0)
    monitor = LivenessMonitor(watched, timeout_s=20.0, interval_s=0.2).start()
    try:
        generating = watched.sleep.future(2.0)
        assert busy.sleep(3.0).get() == [0]  # the monitor looked at every poll of the wait meanwhile
        assert generating.get() == [0, 1]
    finally:
        monitor.close()


def test_a_frozen_idle_replica_is_reported_once_its_ping_is_older_than_the_timeout(groups):
    busy, watched = groups
    pids = watched.pid()
    monitor = LivenessMonitor(watched, timeout_s=3.0, interval_s=0.5).start()
    os.kill(pids[0], signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            busy.sleep(20).get()
        waited = time.monotonic() - started
    finally:
        os.kill(pids[0], signal.SIGCONT)
        monitor.close()
    assert 3.0 <= waited < 40.0
    error = info.value
    assert (error.role, error.rank, error.pid) == ("rollout", 0, pids[0])
    assert "stopped answering: no call finished for" in str(error) and "past the timeout of 3 s" in str(error)
    assert str(error).splitlines()[0].endswith("while idle")
    assert watched.pid() == pids  # resumed, it answers: nothing was killed


def test_a_replica_killed_mid_call_is_reported_within_seconds_while_the_driver_waits_on_another_group(groups):
    busy, watched = groups
    pids = watched.pid()
    monitor = LivenessMonitor(watched, timeout_s=300, interval_s=0.5).start()
    try:
        watched.sleep.future(60)  # both replicas generating
        training = busy.sleep.future(60)  # the driver waits on the trainer
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            training.get()
        noticed = time.monotonic() - killed
    finally:
        monitor.close()
    assert noticed < 30.0  # far below the 60 s the driver would otherwise have waited (generous: a shared machine)
    error = info.value
    assert (error.role, error.rank, error.method, error.pid) == ("rollout", 1, "sleep", pids[1])
    assert error.host  # the Ray node's host name
    assert str(error).splitlines()[0] == (f"rollout rank 1 (pid {pids[1]} on host {error.host}) died (its process is "
                                          f"gone: killed, out of memory or crashed) during rollout.sleep")
    assert monitor.check not in DRIVER_CHECKS  # reported once: the monitor closed itself


def _record_learns(trainer: RLTrainer, before_learn=lambda: None) -> list[str]:
    """The prompts of every batch the trainer's ``learn`` gets, from now on (``before_learn()`` runs after each)."""
    trained: list[str] = []
    learn = trainer.learn

    def recording_learn(experience, **kwargs):
        trained.extend(str(prompt) for prompt in experience.batch["raw_prompt"])
        before_learn()
        return learn(experience, **kwargs)

    trainer.learn = recording_learn
    return trained


def _fit(config) -> tuple[list[str], list[dict]]:
    """Run ``config`` (resuming from its last checkpoint) to the end; the prompts each learn got, the metrics."""
    trainer = RLTrainer(config, tensorboard=False)
    trained = _record_learns(trainer)
    try:
        return trained, trainer.fit()
    finally:
        trainer.shutdown()


def _fit_killing(config, *, kill_step: int, rank: int) -> tuple[list[str], WorkerLostError, float, RLTrainer]:
    """Run ``config`` on Ray, SIGKILL rollout replica ``rank`` just before the trainer trains step ``kill_step``;
    returns the prompts each learn got, the error the run ended with, the seconds from the kill to it, the trainer."""
    trainer = RLTrainer(config, tensorboard=False)
    killed: list[float] = []

    def kill_at_the_step() -> None:
        if trainer.step == kill_step:
            os.kill(trainer.groups["rollout"].pids[rank], signal.SIGKILL)
            killed.append(time.monotonic())

    trained = _record_learns(trainer, kill_at_the_step)
    try:
        with pytest.raises(WorkerLostError) as info:
            trainer.fit()
        return trained, info.value, time.monotonic() - killed[0], trainer
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_a_rollout_replica_killed_as_the_trainer_trains_stops_the_run_and_the_resume_trains_each_prompt_once(
        ray_session, data_dir, tmp_path):  # noqa: F811 (data_dir)
    """Two replicas, k = 1, a checkpoint every 2 steps; replica rank 1 is killed as step 3 trains."""
    overrides = (*ASYNC, "placement.pools={trainer: [1], gen: [2]}", "placement.runtime=ray", "trainer.save_every=2",
                 "trainer.worker_timeout_s=300")
    uninterrupted, history = _fit(_config(data_dir, tmp_path / "whole", *overrides))
    config = _config(data_dir, tmp_path / "run", *overrides)
    before, error, noticed, trainer = _fit_killing(config, kill_step=3, rank=1)
    assert noticed < 60.0  # generous: it is seconds, not the 300 s timeout
    assert (error.role, error.rank) == ("rollout", 1) and error.pid == trainer.groups["rollout"].pids[1]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert error.note.startswith("the run stopped at step ") and f"last checkpoint: {checkpoint}" in error.note
    line = one_line(error, tmp_path / "errors", "hybridflow train")
    assert "\n" not in line and line.startswith(f"rollout rank 1 (pid {error.pid} on host {error.host}) died")
    assert sorted(path.name for path in checkpoint.parent.glob("step_*")) == ["step_000002"]  # nothing half-written
    after, resumed = _fit(config)  # the same command: resumes from step 2, on new replicas
    assert len(after) == 2 * 4 and len(before) >= 3 * 4
    kept = before[:2 * 4]  # what the checkpoint holds as trained
    assert kept + after == uninterrupted  # every prompt trained exactly once, by the step of the uninterrupted run
    # metrics.jsonl after the resume: steps 1-2 of the killed run, 3-4 of the resumed one; pipelined, they are
    # the uninterrupted run's steps
    assert [metrics["step"] for metrics in resumed] == [1, 2, 3, 4]
    for expected, got in zip(_learning_metrics(history), _learning_metrics(resumed), strict=True):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7), got["step"]


@pytest.mark.slow
def test_a_rollout_replica_frozen_as_the_trainer_trains_stops_the_run_once_the_worker_timeout_passes(
        ray_session, data_dir, tmp_path):  # noqa: F811 (data_dir)
    """One replica, k = 1; it is stopped with SIGSTOP as step 3 trains: the run ends naming it after
    ``trainer.worker_timeout_s`` (30 s: room for the workers' start on a loaded machine), step 2's checkpoint kept."""
    config = _config(data_dir, tmp_path / "run", *ASYNC, "placement.runtime=ray", "trainer.save_every=2",
                     "trainer.worker_timeout_s=30")
    trainer = RLTrainer(config, tensorboard=False)
    pid = trainer.groups["rollout"].pids[0]
    frozen: list[float] = []

    def freeze_at_step_3() -> None:
        if trainer.step == 3 and not frozen:
            os.kill(pid, signal.SIGSTOP)
            frozen.append(time.monotonic())

    _record_learns(trainer, freeze_at_step_3)
    try:
        with pytest.raises((WorkerLostError, WorkerTimeoutError)) as info:  # the monitor's, or the wait's own
            trainer.fit()
        waited = time.monotonic() - frozen[0]
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        trainer.shutdown()
    assert waited < 120.0  # the timeout and a few seconds, bounded generously (no speed claim)
    message = str(info.value).splitlines()[0]
    assert str(pid) in message and message.startswith(("rollout rank 0 (", "rollout."))
    assert "stopped answering" in message or "did not finish within 30 s on ranks [0]" in message
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert message.endswith(f"the run stopped at step {trainer.step}; last checkpoint: {checkpoint}; the same "
                            f"command resumes from it")
    assert sorted(path.name for path in checkpoint.parent.glob("step_*")) == ["step_000002"]
