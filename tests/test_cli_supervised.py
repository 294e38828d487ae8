"""`hybridflow sft|rm` on the command line: help that names only their own keys, and the shipped sample configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridflow.cli import main

RL_ONLY = ("actor.", "placement.", "prompts_per_step", "critic", "trainer")


def _help(kind: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([kind, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_supervised_help_lists_the_commands_own_keys_and_no_rl_only_key(kind, capsys):
    text = _help(kind, capsys)
    keys = re.search(r"Keys of the config: ([a-z_, ]+)\.", text).group(1).split(", ")
    assert keys[:3] == ["model", "engine", "batch_size"]
    assert ("reward_type" in keys) == (kind == "rm") and ("val_function" in keys) == (kind == "sft")
    assert [word for word in RL_ONLY if word in text] == []


def test_train_help_lists_the_rl_sections(capsys):
    text = _help("train", capsys)
    keys = re.search(r"Keys of the config: ([a-z_, ]+)\.", text).group(1).split(", ")
    assert {"data", "actor", "critic", "reward", "algorithm", "batch", "placement", "trainer"} <= set(keys)


@pytest.mark.parametrize("kind, override, model", [
    ("sft", "model.path=runs/base/model", {"path": "runs/base/model"}),   # the YAML's model is {builtin: arithmetic}
    ("rm", "model.builtin=arithmetic", {"builtin": "arithmetic"}),        # the YAML's model is {path: ...}
])
def test_a_model_source_override_replaces_the_one_in_the_shipped_example(kind, override, model, capsys):
    import yaml

    from hybridflow.trainers.config.loader import load_yaml

    example = Path(__file__).resolve().parents[1] / "examples" / f"{kind}.yaml"
    assert set(load_yaml(example)["model"]) != set(model)
    assert main([kind, str(example), override, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model"]
    assert {key: value for key, value in printed.items() if key in ("path", "tiny", "builtin")} == {
        "path": None, "tiny": None, "builtin": None, **model}
