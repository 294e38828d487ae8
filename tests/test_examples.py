"""The examples: the README's hand-written loop (examples/custom_grpo_loop.py) and the first `train` example
(examples/arithmetic_ppo.yaml) start from the demo's SFT policy on prompts written in its format."""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "custom_grpo_loop.py"


def _load_loop():
    spec = importlib.util.spec_from_file_location("custom_grpo_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_custom_grpo_loop_runs_two_steps_in_single_process_mode(tmp_path):
    history = _load_loop().run(2, tmp_path, local=True, model="builtin")
    assert len(history) == 2
    for metrics in history:
        assert {"actor/loss", "actor/grad_norm", "reward/score_mean"} <= set(metrics)
        assert all(math.isfinite(value) for value in metrics.values())
        assert 0.0 <= metrics["reward/score_mean"] <= 1.0


def test_the_custom_loop_without_the_demo_model_says_how_to_get_it(tmp_path):
    with pytest.raises(SystemExit, match=r"no model at '.*nowhere': run `hybridflow demo` first"):
        _load_loop().run(1, tmp_path, local=True, model=str(tmp_path / "nowhere"))


def test_the_custom_loop_uses_the_demo_task_and_the_demo_policy():
    from hybridflow.trainers.demo import DemoConfig, _task

    loop = _load_loop()
    assert loop.DEMO_TASK == _task(DemoConfig())
    assert Path(loop.DEMO_MODEL) == Path(DemoConfig().output_dir) / "sft" / "model"


def _commented_commands(path: Path) -> list[list[str]]:
    return [shlex.split(line.split("#", 2)[1].strip())
            for line in path.read_text().splitlines() if re.match(r"#\s+hybridflow ", line)]


def test_the_arithmetic_ppo_example_reads_prompts_in_the_format_of_the_model_it_starts_from(tmp_path, monkeypatch,
                                                                                           capsys):
    from hybridflow.cli import main
    from hybridflow.data import read_rows
    from hybridflow.data.builtin import prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.demo import DemoConfig, _task

    path = EXAMPLES / "arithmetic_ppo.yaml"
    commands = _commented_commands(path)
    assert [command[:2] for command in commands] == [["hybridflow", "demo"], ["hybridflow", "data"],
                                                     ["hybridflow", "train"]]
    config = load_rl_config(path)
    assert Path(config.actor.model.path) == Path(DemoConfig().output_dir) / "sft" / "model"
    monkeypatch.chdir(tmp_path)
    assert main(commands[1][1:]) == 0  # the example's data command, as written
    rows = list(read_rows(config.data.train_path))
    assert rows[:50] == prompt_rows(50, split="train", seed=0, config=_task(DemoConfig()))
