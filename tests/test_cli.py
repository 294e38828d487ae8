"""Tests of the `hybridflow` command's dispatch."""

from __future__ import annotations

import importlib

from hybridflow import cli


def test_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.SUBCOMMANDS:
        assert name in out


def test_unknown_subcommand_names_it_and_the_allowed_ones(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "'trian'" in err and "train" in err and "plan" in err


def test_every_subcommand_target_is_importable():
    for name, (target, _) in cli.SUBCOMMANDS.items():
        module_name, function_name = target.split(":")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, function_name)), name
