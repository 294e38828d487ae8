"""A run never hangs silently and reports failures in one line: reward timeouts, worker timeouts from the
config, and the CLI's one-line message for errors raised while training."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.rewards import RewardError
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import run_rl


def slow_reward(prompt: str, response: str, **extra_fields) -> float:
    time.sleep(30)
    return 0.0


def crashing_reward(prompt: str, response: str, **extra_fields) -> float:
    raise RuntimeError("checker crashed")


def _overrides(tmp_path, reward: str, *extra: str) -> list[str]:
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1)))
    return [f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
            f"reward.function={__file__}:{reward}", "algorithm.advantage_estimator=grpo",
            "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2", "batch.samples_per_prompt=2",
            "batch.mini_batch_size=4", "trainer.total_steps=1", "trainer.progress_bar=false",
            "trainer.val_before_train=false", f"trainer.output_dir={tmp_path / 'run'}", *extra]


@pytest.mark.parametrize("key, value", [("reward.function_timeout_s", "0"), ("trainer.worker_timeout_s", "-1"),
                                        ("trainer.watchdog_s", ".inf")])
def test_timeouts_must_be_finite_positive_seconds_and_the_error_names_the_key(tmp_path, key, value):
    with pytest.raises(ValueError, match=key.split(".")[1]):
        load_rl_config(None, _overrides(tmp_path, "crashing_reward", f"{key}={value}"))


def test_a_reward_function_that_never_returns_fails_the_step_within_its_timeout_naming_it(tmp_path):
    config = load_rl_config(None, _overrides(tmp_path, "slow_reward", "reward.function_timeout_s=1"))
    assert config.trainer.worker_timeout_s == 3600.0 and config.trainer.watchdog_s == 120.0
    start = time.monotonic()
    with pytest.raises(RewardError, match="slow_reward"):
        run_rl(config, mode="local", tensorboard=False)
    assert time.monotonic() - start < 25  # not the 30 s the function sleeps


def test_the_train_command_reports_a_failing_reward_in_one_line_with_exit_code_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", *_overrides(tmp_path, "crashing_reward"),
                             "--local"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow train: error: reward function") and "checker crashed" in last
    assert "Traceback" not in result.stderr


def test_the_sft_command_reports_a_worker_error_in_one_line_with_the_traceback_in_a_file(tmp_path):
    from pathlib import Path

    from hybridflow.data.builtin import sft_rows

    write_jsonl(tmp_path / "sft.jsonl", sft_rows(16, split="train", seed=0, config=ArithmeticTaskConfig()))
    example = Path(__file__).resolve().parents[1] / "examples" / "sft.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "sft", str(example), "--local", "data.train_path=sft.jsonl",
         "engine.optim.lr=1e30", "engine.optim.lr_schedule=constant", "engine.optim.warmup_steps=0",
         "batch_size=8", "output_dir=out"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow sft: error: sft.train_batch failed on rank 0:") and "is nan" in last
    trace = Path(tmp_path, last.split("(full traceback: ")[1].rstrip(")"))
    assert trace.is_file() and "Traceback" in trace.read_text()
    assert "Traceback" not in result.stderr
