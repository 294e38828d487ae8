"""Checkpoints that survive the disk: a real full file system (a small tmpfs, mounted when the tests run as root),
torch's distributed-checkpoint exception, and resume from the newest complete checkpoint when the newest is
deleted, unreadable or named by a dangling ``latest``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.checkpoint import CheckpointSaveError, RunCheckpointer


def _mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path``; the reason when that is impossible here (not root, no mount)."""
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs (CI runs as root)"
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                            text=True)
    return None if result.returncode == 0 else f"mount -t tmpfs failed: {result.stderr.strip()}"


@pytest.fixture
def small_disk(tmp_path):
    """A factory of tmpfs mounts under tmp_path, unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        reason = _mount_tmpfs(path, size)
        if reason is not None:
            pytest.skip(reason)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path, leave_bytes: int) -> Path:
    """Write a filler file until ``disk`` has about ``leave_bytes`` free."""
    filler = disk / "filler.bin"
    with filler.open("wb") as handle:
        chunk = b"\0" * 65536
        try:
            while shutil.disk_usage(disk).free > leave_bytes + len(chunk):
                handle.write(chunk)
                handle.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


def _train_args(tmp_path: Path, output_dir: Path, *extra: str) -> list[str]:
    data = tmp_path / "train.jsonl"
    if not data.exists():
        write_jsonl(data, prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1)))
    return ["train", f"data.train_path={data}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
            "algorithm.advantage_estimator=grpo", "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2", "batch.mini_batch_size=4", "trainer.progress_bar=false",
            "trainer.tensorboard=false", "trainer.save_every=1", f"trainer.output_dir={output_dir}", "--local", *extra]


def _metric_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- a real full file system --------------------------------------------------------------------------------------


def test_a_full_disk_during_the_first_checkpoint_is_one_line_naming_no_space_and_leaves_no_partial(
        tmp_path, small_disk, capsys):
    disk = small_disk("4m")  # the built-in model's checkpoint (weights + Adam state) needs about 11 MB
    run = disk / "run"
    assert main(_train_args(tmp_path, run, "trainer.total_steps=1")) == 2
    err = capsys.readouterr().err
    partial = run / "checkpoints" / "step_000001.partial"
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"hybridflow train: error: could not save the checkpoint of step 1 to '{partial}': no space "
                          f"left on the device (")
    assert err.endswith(f"no earlier checkpoint exists, so a resume starts from step 0; free disk space under "
                        f"'{run / 'checkpoints'}'\n")
    assert "Traceback" not in err
    assert not partial.exists() and list((run / "checkpoints").iterdir()) == []


def test_a_disk_too_full_for_the_next_checkpoint_is_refused_before_writing_and_the_previous_one_resumes(
        tmp_path, small_disk, capsys):
    disk = small_disk("40m")
    run = disk / "run"
    assert main(_train_args(tmp_path, run, "trainer.total_steps=1")) == 0
    previous = run / "checkpoints" / "step_000001"
    filler = _fill(disk, leave_bytes=2 << 20)
    capsys.readouterr()
    assert main(_train_args(tmp_path, run, "trainer.total_steps=2")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"hybridflow train: error: not enough free space to save the checkpoint of step 2 under "
                          f"'{run / 'checkpoints'}': about ")
    assert f"needed (the size of step_000001), " in err
    assert err.endswith(f"free; the previous checkpoint '{previous}' is intact and a resume starts from it; free disk "
                        f"space there\n")
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    filler.unlink()
    assert main(_train_args(tmp_path, run, "trainer.total_steps=2")) == 0
    out = capsys.readouterr().out
    assert f"resuming from {previous} (step 1 of 2)" in out
    assert "moved the 1 later lines of the interrupted run to" in out  # the failed run's step 2, kept aside
    assert _metric_steps(run) == [1, 2]
    assert (run / "checkpoints" / "step_000002" / "driver.json").is_file()


def test_torchs_checkpoint_exception_is_not_an_exception_yet_becomes_the_one_line_save_error(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    assert not issubclass(CheckpointException, Exception)  # why `except Exception` never saw it
    checkpointer = RunCheckpointer(tmp_path / "checkpoints")
    previous = checkpointer.save(1, {}, lambda directory: None)

    def dcp_fails(directory):
        raise CheckpointException("save failed", {0: (OSError(errno.EIO, "Input/output error"), None)})

    with pytest.raises(CheckpointSaveError, match=r"could not save the checkpoint of step 2 to '.*step_000002\.partial'"
                                                  r": an I/O error of the disk \(CheckpointException: OSError: "
                                                  r"\[Errno 5\] Input/output error\); the previous checkpoint "
                                                  r"'.*step_000001' is intact"):
        checkpointer.save(2, {}, dcp_fails)
    assert checkpointer.latest() == previous and not (tmp_path / "checkpoints" / "step_000002.partial").exists()


def test_the_engines_checkpoint_on_a_full_disk_raises_the_os_error_and_removes_its_temporary_directory(small_disk):
    from hybridflow.engine.checkpoint import save_checkpoint
    from tests.test_engine import tiny_engine

    disk = small_disk("256k")
    engine = tiny_engine()
    with pytest.raises(OSError) as caught:
        save_checkpoint(engine, str(disk / "engine"))
    assert caught.value.errno == errno.ENOSPC
    assert list(disk.iterdir()) == []


# -- a broken newest checkpoint: resume from the newest complete one, never from step 0 --------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run of two steps with a checkpoint after each."""
    root = tmp_path_factory.mktemp("two_checkpoints")
    assert main(_train_args(root, root / "run", "trainer.total_steps=2")) == 0
    return root


def _copy_run(two_checkpoints: Path, tmp_path: Path) -> Path:
    shutil.copytree(two_checkpoints / "run", tmp_path / "run")
    return tmp_path / "run"


def test_a_deleted_newest_checkpoint_resumes_from_the_previous_one_saying_so(two_checkpoints, tmp_path, capsys):
    run = _copy_run(two_checkpoints, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_000002")  # the natural manual fix of a corrupt newest checkpoint
    first = (run / "checkpoints" / "step_000001" / "driver.json").read_text()
    capsys.readouterr()
    assert main(_train_args(two_checkpoints, run, "trainer.total_steps=3")) == 0
    out = capsys.readouterr().out
    assert ("resume: 'latest' names step_000002, which is not a complete checkpoint; step_000001 is the newest "
            "complete one") in out
    assert f"resuming from {run / 'checkpoints' / 'step_000001'} (step 1 of 3)" in out
    assert (run / "checkpoints" / "step_000001" / "driver.json").read_text() == first  # never overwritten
    assert _metric_steps(run) == [1, 2, 3]
    assert [json.loads(line)["step"] for path in run.glob("metrics.after-step-1-*.jsonl")
            for line in path.read_text().splitlines()] == [2]


def test_a_newest_checkpoint_without_its_driver_state_is_skipped_naming_what_is_missing(two_checkpoints, tmp_path):
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    run = _copy_run(two_checkpoints, tmp_path)
    (run / "checkpoints" / "step_000002" / "driver.json").unlink()
    checkpointer = RunCheckpointer(run / "checkpoints")
    assert checkpointer.resume_point() == run / "checkpoints" / "step_000001"
    config = load_rl_config(None, [arg for arg in _train_args(two_checkpoints, run, "trainer.total_steps=3")[1:]
                                   if arg != "--local"])
    trainer = RLTrainer(config, mode="local", tensorboard=False)
    try:
        assert trainer.step == 1
    finally:
        trainer.shutdown()


def test_latest_naming_a_missing_step_is_not_trusted(tmp_path, capsys):
    checkpointer = RunCheckpointer(tmp_path)
    checkpointer.save(1, {}, lambda directory: None)
    (tmp_path / "latest").write_text("step_000007")
    assert checkpointer.latest() == tmp_path / "step_000001"
    assert checkpointer.resume_point() == tmp_path / "step_000001"
    assert capsys.readouterr().out == ("resume: 'latest' names step_000007, which is not a complete checkpoint; "
                                       "step_000001 is the newest complete one\n")


def test_checkpoints_none_of_which_is_complete_are_refused_naming_each_not_restarted_from_step_0(tmp_path):
    for step in (1, 2):
        (tmp_path / f"step_00000{step}" / "actor").mkdir(parents=True)
    (tmp_path / "step_000002" / "driver.json").write_text("{not json")
    with pytest.raises(ValueError) as caught:
        RunCheckpointer(tmp_path).resume_point()
    assert str(caught.value) == (
        f"'{tmp_path}' holds checkpoints but none is complete: step_000001: its driver state driver.json is missing; "
        f"step_000002: its driver state driver.json is unreadable; allowed: restore the missing files, or "
        f"trainer.overwrite=true to delete the run and start over")


def test_a_signal_during_a_save_stops_the_run_instead_of_passing_for_a_broken_disk(tmp_path, monkeypatch):
    import hybridflow.engine.checkpoint as engine_checkpoint
    from torch.distributed.checkpoint.api import CheckpointException

    from hybridflow.trainers.boundary import RunInterrupted
    from tests.test_engine import tiny_engine

    def interrupted_save(state, **kwargs):  # what DCP's writer thread reports when SIGTERM lands mid-write
        raise CheckpointException("save", {0: (RunInterrupted(15), None), 1: (RuntimeError("unexpected pos"), None)})

    monkeypatch.setattr(engine_checkpoint.dcp, "save", interrupted_save)
    engine = tiny_engine()
    checkpointer = RunCheckpointer(tmp_path / "checkpoints")
    with pytest.raises(RunInterrupted):
        checkpointer.save(1, {}, lambda directory: engine_checkpoint.save_checkpoint(engine, str(directory / "actor")))
    assert list((tmp_path / "checkpoints").iterdir()) == []  # neither the .partial nor the engine's .tmp
