"""The run directory is owned by one run: a lock (stale after SIGKILL, recovered), no two runs mixed in one
directory (resume, overwrite or refuse), no empty or non-directory output path, metrics never silently cut."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows, sft_rows
from hybridflow.trainers.run_dir import (LOCK_FILE, RunDirectoryBusyError, claim_run_directory,
                                         set_aside_later_metrics)

ROOT = Path(__file__).resolve().parents[1]
HOLD_LOCK = ("import sys, time; from hybridflow.trainers.run_dir import claim_run_directory; "
             "held = claim_run_directory(sys.argv[1], key='trainer.output_dir', overwrite_key='trainer.overwrite'); "
             "print('locked', flush=True); time.sleep(120)")


def _claim(path, **kwargs):
    return claim_run_directory(path, key="trainer.output_dir", overwrite_key="trainer.overwrite",
                               resume_key="trainer.resume", **kwargs)


def _holder(path: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_writer_is_refused_naming_the_holders_pid_and_host_and_a_killed_holders_lock_is_recovered(
        tmp_path, capsys):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunDirectoryBusyError) as caught:
            _claim(tmp_path / "run")
        message = str(caught.value)
        assert f"is in use by another run (pid {holder.pid} on host {socket.gethostname()}, started " in message
        assert "give another trainer.output_dir" in str(caught.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / "run" / LOCK_FILE).exists()  # the killed run could not clean up
    claimed = _claim(tmp_path / "run")
    assert f"recovered the lock of a run that ended without releasing it (pid {holder.pid} on host" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
    claimed.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_output_dir_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"config key trainer\.output_dir got .*; allowed: a directory path \(an "
                                         r"empty value would write the run into the current directory\)"):
        _claim(value)


def test_a_tilde_in_the_output_dir_is_refused_not_made_into_a_directory_named_tilde():
    with pytest.raises(ValueError, match=r"config key trainer\.output_dir got '~/runs/a'; '~' is not expanded here "
                                         r"\(it would make a directory named '~'\); allowed: the full path, "
                                         r"e\.g\. '/.*runs/a'"):
        _claim("~/runs/a")
    assert not Path("~").exists()


def test_a_file_given_as_the_output_dir_is_refused_naming_the_key(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"config key trainer\.output_dir got '.*notes\.txt', which is a file, not a "
                                         r"directory"):
        _claim(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match=r"notes\.txt' is a file, not a directory"):
        _claim(tmp_path / "notes.txt" / "run")


def test_an_output_dir_that_cannot_be_created_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"config key trainer\.output_dir: cannot write the run directory "
                                         r"'/proc/hybridflow-run': No such file or directory; give a writable "
                                         r"directory"):
        _claim("/proc/hybridflow-run")


def test_a_new_run_into_a_directory_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    write_jsonl(run / "metrics.jsonl", [{"step": 1}, {"step": 2}])
    (run / "final" / "actor").mkdir(parents=True)
    with pytest.raises(ValueError) as caught:
        _claim(run, resume=False)
    assert str(caught.value) == (
        f"config key trainer.output_dir: '{run}' holds a previous run (final/, metrics.jsonl (2 lines)); allowed: "
        f"trainer.resume=true to continue it, trainer.overwrite=true to delete it and start over, or another "
        f"trainer.output_dir")
    with pytest.raises(ValueError, match=r"\(trainer\.resume is on, but there is no checkpoint to resume from\)"):
        _claim(run, resume=True, has_checkpoint=lambda path: False)
    assert (run / "metrics.jsonl").exists() and not (run / LOCK_FILE).exists()  # nothing touched, lock released
    claimed = _claim(run, resume=False, overwrite=True)
    assert capsys.readouterr().out == (f"overwrite: deleted the previous run in '{run}': final/, metrics.jsonl (2 "
                                       f"lines)\n")
    assert sorted(entry.name for entry in run.iterdir()) == [LOCK_FILE]
    claimed.release()


def test_overwrite_deletes_only_what_a_run_writes_and_other_files_never_make_a_run(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("{}")  # data kept next to the run: neither a run nor deleted
    _claim(tmp_path, resume=False).release()
    (tmp_path / "final").mkdir()
    _claim(tmp_path, overwrite=True).release()
    assert capsys.readouterr().out == f"overwrite: deleted the previous run in '{tmp_path}': final/\n"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["train.jsonl"]


def test_a_failed_start_alone_does_not_count_as_a_run(tmp_path):
    run = tmp_path / "run"
    (run / "errors").mkdir(parents=True)
    (run / "config.yaml").write_text("a: 1")
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints").mkdir()
    claimed = _claim(run, resume=False)
    assert not claimed.resumes
    claimed.release()


def test_metrics_after_the_resumed_step_are_moved_aside_not_dropped(tmp_path, capsys):
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "loss": s} for s in (1, 2, 3, 4)])
    aside = set_aside_later_metrics(tmp_path, 2)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [3, 4]
    assert aside.name.startswith("metrics.after-step-2-")
    assert "kept the 2 lines up to step 2; moved the 2 later lines of the interrupted run to" in capsys.readouterr().out
    assert set_aside_later_metrics(tmp_path, 2) is None  # nothing later: nothing moved


# -- through the commands ---------------------------------------------------------------------------------------


def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    if not (tmp_path / "train.jsonl").exists():
        write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0,
                                                          config=ArithmeticTaskConfig(max_digits=1)))
    return ["train", f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
            "reward.function=arithmetic", "algorithm.advantage_estimator=grpo", "actor.generation.max_new_tokens=3",
            "batch.prompts_per_step=2", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
            "trainer.progress_bar=false", "trainer.tensorboard=false", f"trainer.output_dir={tmp_path / 'run'}",
            "--local", *extra]


def test_train_with_resume_false_on_a_finished_run_is_refused_and_overwrite_starts_over(tmp_path, capsys):
    assert main(_train_args(tmp_path, "trainer.total_steps=2", "trainer.save_every=2")) == 0
    capsys.readouterr()
    assert main(_train_args(tmp_path, "trainer.total_steps=1", "trainer.resume=false")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hybridflow train: error: config key trainer.output_dir: '{tmp_path / 'run'}' holds a "
                          f"previous run (checkpoints/ (1: step_000002), config.yaml") or "holds a previous run" in err
    assert "trainer.overwrite=true to delete it and start over" in err and len(err.strip().splitlines()) == 1
    assert main(_train_args(tmp_path, "trainer.total_steps=1", "trainer.resume=false", "trainer.overwrite=true")) == 0
    out = capsys.readouterr().out
    assert f"overwrite: deleted the previous run in '{tmp_path / 'run'}': checkpoints/ (1: step_000002)" in out
    # the old run's later checkpoint is gone: nothing of it stays next to the new run
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_sft_into_a_directory_holding_a_model_is_refused_unless_overwrite(tmp_path, capsys):
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(8, split="train", seed=0, config=ArithmeticTaskConfig()))
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    argv = ["sft", f"data.train_path={tmp_path / 'sft.jsonl'}", "model.builtin=arithmetic", "batch_size=4",
            "max_steps=1", "progress_bar=false", f"output_dir={out}", "--local"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"hybridflow sft: error: config key output_dir: '{out}' holds a previous run (model/); allowed: "
        f"overwrite=true to delete it and start over, or another output_dir\n")
    assert main([*argv, "overwrite=true"]) == 0
    assert (out / "model" / "config.json").read_text() != "{}" and not (out / LOCK_FILE).exists()


@pytest.mark.slow  # 62 s on the shared 2-core machine
def test_two_concurrent_runs_on_one_directory_the_second_is_refused_and_the_firsts_metrics_stay_in_order(tmp_path,
                                                                                                       capsys):
    go = tmp_path / "go"  # the first run's reward waits for it from step 2 on: the second starts mid-run
    (tmp_path / "slow_reward.py").write_text(
        "import pathlib, time\ncalls = []\ndef reward(prompt, response, **fields):\n    calls.append(1)\n"
        f"    while len(calls) > 4 and not pathlib.Path({str(go)!r}).exists():\n        time.sleep(0.05)\n"
        "    return 0.0\n")
    args = _train_args(tmp_path, "trainer.total_steps=5", f"reward.function={tmp_path / 'slow_reward.py'}:reward",
                       "reward.function_timeout_s=600")
    first = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", *args], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()) and first.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)  # the first run is training (it logged step 1)
    assert main(args) == 2
    go.touch()
    err = capsys.readouterr().err
    out, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err[-2000:]
    assert "started " in err, err
    started = err.split("started ")[1].split(")")[0]
    assert err == (f"hybridflow train: error: config key trainer.output_dir: '{tmp_path / 'run'}' is in use by another "
                   f"run (pid {first.pid} on host {socket.gethostname()}, started {started}); wait for it to end or "
                   f"give another trainer.output_dir\n")
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]
