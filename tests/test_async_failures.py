"""A worker or the driver lost mid-run (issue 34 items 4 and 6): a killed (SIGKILL) or frozen (SIGSTOP) worker process
is noticed within seconds whatever the driver waits on, reported in one line naming the role, rank, pid and host,
and the run stops with its last checkpoint intact; a resume with the same config trains every prompt of the epoch
exactly once, with the metrics of an uninterrupted run. Kills land at chosen points (mid-update, mid-sync,
mid-checkpoint, mid-generation) through hooks run in the killed process itself, not timers (docs/async.md)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from hybridflow.controller import (LivenessMonitor, ResourcePool, Worker, WorkerGroup, WorkerLostError,
                                   WorkerTimeoutError, register)
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

    @register("ONE_TO_ALL")
    def take(self, value) -> int:
        """A call whose argument may be another group's future (fetched here from the object store)."""
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
    with LivenessMonitor(watched, timeout_s=20.0, interval_s=0.2):
        generating = watched.sleep.future(2.0)
        assert busy.sleep(3.0).get() == [0]  # the monitor looked at every poll of the wait meanwhile
        assert generating.get() == [0, 1]


def test_a_frozen_idle_replica_is_reported_once_its_ping_is_older_than_the_timeout(groups):
    busy, watched = groups
    pids = watched.pid()
    os.kill(pids[0], signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerLostError) as info, LivenessMonitor(watched, timeout_s=3.0, interval_s=0.5):
            busy.sleep(20).get()
        waited = time.monotonic() - started
    finally:
        os.kill(pids[0], signal.SIGCONT)
    assert 3.0 <= waited < 40.0
    error = info.value
    assert (error.role, error.rank, error.pid) == ("rollout", 0, pids[0])
    assert "stopped answering: no call finished for" in str(error) and "past the timeout of 3 s" in str(error)
    assert str(error).splitlines()[0].endswith("while idle")
    assert watched.pid() == pids  # resumed, it answers: nothing was killed


def test_a_call_failing_because_the_process_holding_its_argument_died_names_that_process(groups):
    """The trainer's group fetches an argument (a future) from a colocated pair's process, which is SIGKILLed before
    the value exists: the call fails with Ray's actor error, and the driver names the dead process instead (the
    monitor looks only once here: its interval is longer than the test, so the forced look names it)."""
    busy, _ = groups
    pool = ResourcePool([1], name="pair")
    pair = WorkerGroup.colocate(pool, {"first": (SleepyWorker,), "second": (SleepyWorker,)}, timeout_s=300)
    try:
        with pytest.raises(ValueError, match=r"also host \['second'\], whose calls the monitor would not see"):
            LivenessMonitor(pair["first"], timeout_s=60)
        pid = pair["first"].pid()[0]
        with LivenessMonitor([pair["first"], pair["second"]], timeout_s=300, interval_s=1e6) as monitor:
            monitor.check()  # the one periodic look: all alive
            value = pair["first"].sleep.future(60)
            taking = busy.take.future(value)  # waits in the worker for the pair's value
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerLostError) as info:
                taking.get()
        error = info.value
        assert (error.role, error.rank, error.method, error.pid) == ("first", 0, "sleep", pid)
        assert monitor.spent
        assert busy.take(1) == [0]  # the trainer's group is intact: only its call failed
    finally:
        for group in pair.values():
            group.shutdown()
        pool.release()


def test_a_call_queued_behind_the_one_its_process_died_in_names_that_one(ray_session):
    """A rank runs its calls in order: killed in the first of two calls, the second one's future (collected first,
    as a streaming driver collects the poll queued behind a weight sync) names the first, not itself."""
    pool = ResourcePool([1], name="queued")
    group = WorkerGroup(pool, SleepyWorker, name="rollout", timeout_s=300)
    try:
        pid = group.pid()[0]
        running = group.sleep.future(60)
        queued = group.take.future(1)
        os.kill(pid, signal.SIGKILL)
        for future in (queued, running):
            with pytest.raises(WorkerLostError) as info:
                future.get()
            assert (info.value.role, info.value.method, info.value.pid) == ("rollout", "sleep", pid)
    finally:
        group.shutdown()
        pool.release()


def test_a_replica_killed_mid_call_is_reported_within_seconds_while_the_driver_waits_on_another_group(groups):
    busy, watched = groups
    pids = watched.pid()
    monitor = LivenessMonitor([busy, watched], timeout_s=300, interval_s=0.5)
    with monitor:
        watched.sleep.future(60)  # both replicas generating
        training = busy.sleep.future(60)  # the driver waits on the trainer
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            training.get()
        noticed = time.monotonic() - killed
    assert noticed < 30.0  # far below the 60 s the driver would otherwise have waited (generous: a shared machine)
    error = info.value
    assert (error.role, error.rank, error.method, error.pid) == ("rollout", 1, "sleep", pids[1])
    assert error.host  # the Ray node's host name
    assert str(error).splitlines()[0] == (f"rollout rank 1 (pid {pids[1]} on host {error.host}) died (its process is "
                                          f"gone: killed, out of memory or crashed) during rollout.sleep")
    assert monitor.spent  # reported once


def identify(batch) -> list[str]:
    """What a learn's batch trained, one entry per sample: its prompt (the pipelined runs' record; a ``suite`` of
    ``_driver_main`` names its own)."""
    return [str(prompt) for prompt in batch["raw_prompt"]]


def _record_learns(trainer: RLTrainer, before_learn=lambda: None, identify=identify) -> list:
    """``identify(batch)`` of every batch the trainer's ``learn`` gets, from now on (``before_learn()`` runs after
    each)."""
    trained: list = []
    learn = trainer.learn

    def recording_learn(experience, **kwargs):
        trained.extend(identify(experience.batch))
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


# ---------------------------------------------------------------- kills at chosen points of a run, and the resume

RAY_RUN = (*ASYNC, "placement.runtime=ray", "trainer.save_every=1", "trainer.worker_timeout_s=300")
"""k = 1 on Ray: the actor in one process, one rollout replica in another; a checkpoint after every step."""
PROMPTS_PER_STEP = 4  # 2 prompts x 2 samples, as _config sets them


@pytest.fixture(scope="module")
def ray_uninterrupted(ray_session, data_dir, tmp_path_factory):  # noqa: F811 (data_dir)
    """The prompts each learn got and the metrics of a RAY_RUN without a stop."""
    return _fit(_config(data_dir, tmp_path_factory.mktemp("ray_whole"), *RAY_RUN))


def _kill_at_call(host, role: str | None, target: str, nth: int, marker: str, describe=None) -> int:
    """Runs in a worker process (Ray's ``__ray_call__``, ``host`` the WorkerHost): from now on, the ``nth`` call of
    ``target`` writes ``marker`` (the pid, the time, ``describe(*args, **kwargs)``) and SIGKILLs this process before
    the call runs. ``target``: a dotted path from ``role``'s worker object, or ``module:attribute.path``."""
    if role is not None:
        owner, path = host._roles[role], target
    else:
        module, path = target.split(":")
        owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original, calls = getattr(owner, name), [0]

    def killing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            details = describe(*args, **kwargs) if describe is not None else None
            Path(marker).write_text(json.dumps({"pid": os.getpid(), "time": time.time(), "details": details}))
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, killing)
    return os.getpid()


def _files_of_writer(writer, *args, **kwargs) -> list[str]:
    """What DCP's file writer has written so far (``finish`` writes the metadata, last)."""
    return sorted(os.listdir(writer.path))


KILL_POINTS = {  # name: (role killed, its method the driver names, hook role, hook target, nth call, describe)
    "actor mid-update": ("actor", "update_actor", "actor", "engine.train_step", 4, None),
    "actor mid-sync": ("actor", "generation_weights", None, "hybridflow.workers.actor:pack_weights", 2,
                       lambda state, **kwargs: kwargs["version"]),
    "replica mid-sync": ("rollout", "sync_weights", None, "hybridflow.workers.rollout:verify_weights", 2,
                         lambda weights, checksums, **kwargs: kwargs["version"]),
    "actor mid-checkpoint": ("actor", "save_checkpoint", None,
                             "torch.distributed.checkpoint.filesystem:FileSystemWriter.finish", 1, _files_of_writer),
}
"""Each kill in its run, resumed from the checkpoint of the step before (save_every=1): the actor between the two
mini-batch updates of step 2 (4th optimizer step); the actor packing version 2 for step 3's sync; the replica
verifying version 3 in step 4's sync; the actor in DCP's save of step 4's checkpoint, its data files written and
the metadata not."""


def _run_killed(config, point: str, marker: Path, *, points=KILL_POINTS,
                identify=identify) -> tuple[list, WorkerLostError, float, dict]:
    """Run ``config`` (resuming) with the hook of ``point`` (one of ``points``, laid out as KILL_POINTS) in the
    process it kills; ``identify`` of each learn's batch, the error the run ended with, the seconds from the kill to
    the error, what the hook recorded."""
    role, _, hook_role, target, nth, describe = points[point]
    trainer = RLTrainer(config, tensorboard=False)
    try:
        host = trainer.groups[role]._hosts.actors[0]  # the process behind rank 0 (a test's reach into the group)
        ray.get(host.__ray_call__.remote(_kill_at_call, hook_role, target, nth, str(marker), describe))
        trained = _record_learns(trainer, identify=identify)
        with pytest.raises(WorkerLostError) as info:
            trainer.fit()
        noticed = time.time()
    finally:
        trainer.shutdown()
    killed = json.loads(marker.read_text())
    return trained, info.value, noticed - killed["time"], killed


@pytest.mark.slow
def test_a_ray_run_killed_mid_update_mid_sync_and_mid_checkpoint_resumes_to_train_each_prompt_once(
        ray_uninterrupted, data_dir, tmp_path):  # noqa: F811 (data_dir)
    """One run killed four times in turn (KILL_POINTS), each time resumed with the same config, then to the end:
    each kill is reported within seconds naming the role, rank, pid and call; no partial checkpoint stays; the steps
    kept across the resumes train the uninterrupted run's prompts, step by step, with its metrics."""
    uninterrupted, history = ray_uninterrupted
    config = _config(data_dir, tmp_path / "run", *RAY_RUN)
    checkpoints = tmp_path / "run" / "checkpoints"
    kept: list[str] = []  # the prompts of the steps the checkpoints hold as trained
    resumed_at = 0
    for point, saved in zip(KILL_POINTS, (1, 2, 3, 3)):  # the last checkpoint when each kill lands
        marker = tmp_path / f"{point.replace(' ', '-')}.json"
        trained, error, noticed, killed = _run_killed(config, point, marker)
        role, method = KILL_POINTS[point][:2]
        assert (error.role, error.rank, error.method, error.pid) == (role, 0, method, killed["pid"]), point
        print(f"{point}: reported {noticed:.2f} s after the kill")
        assert noticed < 60.0, point  # seconds, not the 300 s worker timeout (bound generous: a shared machine)
        assert error.note.startswith("the run stopped at step ") and checkpoints.name in error.note, point
        assert f"last checkpoint: {checkpoints / f'step_{saved:06d}'}" in error.note, point
        assert sorted(path.name for path in checkpoints.iterdir() if path.name.startswith("step_")) == [
            f"step_{step:06d}" for step in range(1, saved + 1)], point  # complete ones only: nothing half-written
        kept += trained[:(saved - resumed_at) * PROMPTS_PER_STEP]
        resumed_at = saved
    assert json_of(tmp_path, "actor mid-sync") == 2 and json_of(tmp_path, "replica mid-sync") == 3  # their versions
    written = json_of(tmp_path, "actor mid-checkpoint")
    assert any(name.endswith(".distcp") for name in written) and ".metadata" not in written
    after, resumed = _fit(config)
    assert len(after) == (4 - resumed_at) * PROMPTS_PER_STEP
    assert kept + after == uninterrupted  # every prompt trained exactly once, by the uninterrupted run's step
    assert [metrics["step"] for metrics in resumed] == [1, 2, 3, 4]
    for expected, got in zip(_learning_metrics(history), _learning_metrics(resumed), strict=True):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7), got["step"]


def json_of(directory: Path, point: str):
    """What the hook of ``point`` recorded (``describe``'s value)."""
    return json.loads((directory / f"{point.replace(' ', '-')}.json").read_text())["details"]


# ---------------------------------------------------------------- the driver killed

def ray_config(data_dir: Path, output_dir: Path):
    """The config of a RAY_RUN (what ``_driver_main`` runs for this suite)."""
    return _config(data_dir, output_dir, *RAY_RUN)


DRIVER_KILLS = {"generation": ("_submit_pending", lambda pipeline: True), "checkpoint": ("save", lambda pipeline: True)}
"""``_driver_main``'s kill points of this suite (the pipelined mode): point -> (the ``trainer.pipeline`` method after
whose return the driver kills itself, a condition on the pipeline that must hold too)."""


def _driver_main(suite: str, data_dir: str, output_dir: str, trained_path: str, kill: str) -> None:
    """The driver of a run in a process of its own (``python tests/test_async_failures.py SUITE ...``, joined to the
    test session's Ray cluster through RAY_ADDRESS). ``suite``: the test module whose ``ray_config(data_dir,
    output_dir)`` is run, whose ``identify(batch)`` says what a learn trained and whose ``DRIVER_KILLS`` places the
    kill. Prints its workers' pids, appends ``identify`` of every learn's batch to ``trained_path`` and SIGKILLs
    itself at ``kill`` (``POINT:S``: after the POINT's method returns in step S with its condition true). This
    suite's points: ``generation:S``, as step S has submitted its sync and the generation of batch S + 1 (the
    replica generating, the driver about to wait for batch S); ``checkpoint:S``, in step S's checkpoint once the
    actor's part and the in-flight batches are written, before the driver's state."""
    import torch

    torch.set_num_threads(1)  # as conftest.py sets it for the in-process runs this one is compared with
    module = importlib.import_module(suite)
    trainer = RLTrainer(module.ray_config(Path(data_dir), Path(output_dir)), tensorboard=False)
    print(json.dumps({"workers": [pid for group in trainer.groups.values() for pid in group.pids]}), flush=True)
    learn, pipeline = trainer.learn, trainer.pipeline

    def recording_learn(experience, **kwargs):
        with open(trained_path, "a") as handle:
            handle.write(json.dumps(module.identify(experience.batch)) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return learn(experience, **kwargs)

    point, step = kill.split(":")
    name, condition = module.DRIVER_KILLS[point]
    hooked = getattr(pipeline, name)

    def killing(*args, **kwargs):
        result = hooked(*args, **kwargs)
        if pipeline.step == int(step) and condition(pipeline):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    trainer.learn = recording_learn
    setattr(pipeline, name, killing)
    trainer.fit()


def _run_driver_killed(data_dir: Path, output_dir: Path, kill: str, trained_path: Path, *, ray_address: str,
                       suite: str = __name__) -> tuple[list, list[int]]:
    """Run ``_driver_main`` of ``suite`` (a test module's name) in a new process to its kill; the entries of
    ``identify`` of each learn (its prompts in this suite, JSON values), its workers' pids."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RAY_ADDRESS": ray_address,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, suite, str(data_dir), str(output_dir), str(trained_path), kill],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, (kill, done.returncode, done.stderr[-4000:])
    workers = next(json.loads(line)["workers"] for line in done.stdout.splitlines() if line.startswith('{"workers"'))
    trained = [prompt for line in trained_path.read_text().splitlines() for prompt in json.loads(line)]
    return trained, workers


def _gone(pids: list[int], *, within_s: float) -> bool:
    """Whether every process of ``pids`` has ended within ``within_s`` seconds (polled)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
def test_a_driver_killed_mid_generation_then_mid_checkpoint_resumes_to_train_each_prompt_once(
        ray_session, ray_uninterrupted, data_dir, tmp_path):  # noqa: F811 (data_dir)
    """The driver (a process of its own on the session's Ray cluster) SIGKILLed as step 3 waits for its generation,
    then, resumed, inside step 3's checkpoint; the same config resumes once more, to the end. Its workers end with
    it; the half-written checkpoint is never resumed from and is gone once the step is saved again; the steps kept
    train the uninterrupted run's prompts, step by step, with its metrics."""
    uninterrupted, history = ray_uninterrupted
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    address = ray_session.get_runtime_context().gcs_address
    trained, workers = _run_driver_killed(data_dir, run, "generation:3", tmp_path / "first.jsonl", ray_address=address)
    assert len(trained) == 2 * PROMPTS_PER_STEP  # steps 1 and 2 trained, step 3 waiting for its batch
    assert sorted(path.name for path in checkpoints.glob("step_*")) == ["step_000001", "step_000002"]
    assert _gone(workers, within_s=60.0)  # Ray ends a dead driver's workers
    kept = trained[:2 * PROMPTS_PER_STEP]
    trained, workers = _run_driver_killed(data_dir, run, "checkpoint:3", tmp_path / "second.jsonl", ray_address=address)
    assert len(trained) == PROMPTS_PER_STEP  # step 3, trained again from step 2's checkpoint and its batch in flight
    partial = checkpoints / "step_000003.partial"
    assert (partial / "in_flight.pt").is_file() and (partial / "actor").is_dir()
    assert not (partial / "driver.json").exists()  # killed mid-checkpoint: never a resume point
    assert _gone(workers, within_s=60.0)
    trainer = RLTrainer(_config(data_dir, run, *RAY_RUN), tensorboard=False)  # resumes from step 2
    assert not partial.exists()  # removed by the resume, not left until step 3 is saved again
    after = _record_learns(trainer)
    try:
        resumed = trainer.fit()
    finally:
        trainer.shutdown()
    assert len(after) == 2 * PROMPTS_PER_STEP
    assert kept + after == uninterrupted  # every prompt trained exactly once, by the uninterrupted run's step
    assert sorted(path.name for path in checkpoints.glob("step_*")) == [f"step_{step:06d}" for step in range(1, 5)]
    assert [metrics["step"] for metrics in resumed] == [1, 2, 3, 4]
    for expected, got in zip(_learning_metrics(history), _learning_metrics(resumed), strict=True):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7), got["step"]


if __name__ == "__main__":
    _driver_main(*sys.argv[1:])
