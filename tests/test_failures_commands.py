"""One line for every failure of every command: unexpected errors (traceback in OUTPUT_DIR/errors/), SIGTERM and
SIGINT (naming the last checkpoint, saving one first with trainer.save_on_signal), a hard os._exit in a reward
function, the worker timeout in local mode, and bad arguments of export, plan and data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register
from hybridflow.controller.errors import WorkerTimeoutError
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows

ROOT = Path(__file__).resolve().parents[1]


def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    write_jsonl(tmp_path / "train.jsonl",
                prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1)))
    return ["train", f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
            "algorithm.advantage_estimator=grpo", "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2", "batch.mini_batch_size=4", "trainer.progress_bar=false",
            "trainer.tensorboard=false", f"trainer.output_dir={tmp_path / 'run'}", "--local", *extra]


def _blocking_reward(tmp_path: Path, body: str) -> str:
    """A reward function whose calls after the first step's (4 samples) run ``body``; returns its spec."""
    (tmp_path / "blocking.py").write_text(
        "import os, time\ncalls = []\ndef reward(prompt, response, **fields):\n    calls.append(1)\n"
        f"    if len(calls) > 4:\n        {body}\n    return 0.0\n")
    return f"reward.function={tmp_path / 'blocking.py'}:reward"


def _start(tmp_path: Path, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridflow.cli", *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_for_step_1(tmp_path: Path, process: subprocess.Popen, *, saved: bool = False) -> None:
    """Until step 1 is logged (and with ``saved`` its checkpoint committed), then into step 2's reward."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    deadline = time.monotonic() + 240
    while process.poll() is None and not ((metrics.exists() and metrics.read_text().strip())
                                          and (checkpoint.is_dir() or not saved)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)


def test_an_unexpected_error_is_one_line_with_the_traceback_in_the_runs_errors_directory(tmp_path, capsys,
                                                                                         monkeypatch):
    from hybridflow.trainers.rl import RLTrainer

    def fit(self, **kwargs):
        raise KeyError("no such column")

    monkeypatch.setattr(RLTrainer, "fit", fit)
    assert main(_train_args(tmp_path, "reward.function=arithmetic")) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow train: error: KeyError: 'no such column' (full traceback: ")
    assert err.count("\n") == 1
    trace = Path(err.split("(full traceback: ")[1].rstrip(")\n"))
    assert trace.parent == tmp_path / "run" / "errors" and "Traceback" in trace.read_text()
    assert not (tmp_path / "run" / ".hybridflow.lock").exists()  # the lock is released on failure


@pytest.mark.slow  # 76 s on the shared 2-core machine (two command starts)
def test_sigterm_ends_a_run_in_one_line_naming_the_last_checkpoint(tmp_path):
    args = _train_args(tmp_path, _blocking_reward(tmp_path, "time.sleep(60)"), "trainer.total_steps=3",
                       "trainer.save_every=1", "reward.function_timeout_s=600")
    process = _start(tmp_path, args)
    _wait_for_step_1(tmp_path, process, saved=True)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"hybridflow train: stopped by SIGTERM; at step 2; last checkpoint: "
        f"{tmp_path / 'run' / 'checkpoints' / 'step_000001'}; the same command resumes from it")
    assert "Traceback" not in err and not (tmp_path / "run" / ".hybridflow.lock").exists()


@pytest.mark.slow  # 71 s on the shared 2-core machine
def test_with_save_on_signal_sigint_finishes_the_step_and_saves_a_checkpoint_first(tmp_path):
    args = _train_args(tmp_path, _blocking_reward(tmp_path, "time.sleep(2)"), "trainer.total_steps=5",
                       "trainer.save_on_signal=true", "reward.function_timeout_s=600")
    process = _start(tmp_path, args)
    _wait_for_step_1(tmp_path, process)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "SIGINT: finishing this step and saving a checkpoint; send it again to stop at once" in err
    saved = tmp_path / "run" / "checkpoints" / "step_000002"
    assert err.strip().splitlines()[-1] == (f"hybridflow train: stopped by SIGINT; at step 2; last checkpoint: "
                                            f"{saved}; the same command resumes from it")
    assert json.loads((saved / "driver.json").read_text())["step"] == 2


def test_a_reward_function_calling_os_exit_is_reported_in_one_line_naming_its_caller(tmp_path):
    args = _train_args(tmp_path, _blocking_reward(tmp_path, "os._exit(7)"), "trainer.total_steps=3")
    process = _start(tmp_path, args)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 7
    assert err.strip().splitlines()[-1] == (
        f"hybridflow train: error: os._exit(7) was called from {tmp_path / 'blocking.py'}:6 (in reward); the run ended "
        f"without cleaning up; at step 2; no checkpoint was saved (trainer.save_every=0 or none reached), so nothing "
        f"can be resumed")


class Sleeper(Worker):
    @register("ONE_TO_ALL")
    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "rested"


def test_the_worker_timeout_is_enforced_in_local_mode_naming_role_and_method():
    group = WorkerGroup(ResourcePool([1], mode="local"), Sleeper, name="sleeper", timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=r"sleeper\.nap did not finish within 0\.5 s on ranks \[0\]"):
            group.nap(30)
        assert time.monotonic() - started < 10
        assert group.nap(0.01) == ["rested"]  # the deadline is gone with the call
    finally:
        group.shutdown()


def test_export_plan_and_data_answer_bad_arguments_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["data", "arithmetic", "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == (f"hybridflow data: error: --out {str(tmp_path / 'file')!r} is a file, not a "
                                       f"directory\n")
    assert main(["export", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == (f"hybridflow export: error: run directory {str(tmp_path / 'nowhere')!r} does "
                                       f"not exist; give a `hybridflow train` trainer.output_dir (it holds "
                                       f"checkpoints/)\n")
    (tmp_path / "empty_run").mkdir()
    assert main(["export", str(tmp_path / "empty_run")]) == 2
    assert capsys.readouterr().err == (f"hybridflow export: error: no checkpoint under "
                                       f"{tmp_path / 'empty_run' / 'checkpoints'}; steps saved: none (set "
                                       f"trainer.save_every)\n")
    assert main(["plan", "--actor", "llama-7b", "--devices", "8", "--prompt-len", "10", "--response-len", "10",
                 "--batch", "8", "--hardware", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == (f"hybridflow plan: hardware profile {tmp_path / 'file'} is not valid JSON: "
                                       f"Expecting value at line 1 column 1\n")


def test_the_python_api_given_a_dict_instead_of_a_config_says_what_it_needs():
    from hybridflow.trainers.rl import run_rl

    with pytest.raises(ValueError, match=r"RLTrainer needs an RLConfig \(load_rl_config\(path, overrides\) builds "
                                         r"one\), got a dict"):
        run_rl({"data": {"train_path": "train.jsonl"}})
