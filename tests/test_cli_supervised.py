"""`hybridflow sft|rm` on the command line: help that names only their own keys, and the shipped sample configs."""

from __future__ import annotations

import re

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
