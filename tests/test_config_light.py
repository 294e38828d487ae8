"""Configs load and fail without torch, transformers or Ray: a config error answers in a fraction of a second."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers", "ray", "tensordict")


def _modules_after(code: str) -> set[str]:
    probe = textwrap.dedent(code) + f"\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(eval(out.stdout.strip().splitlines()[-1]))


def test_importing_and_validating_every_config_imports_no_heavy_library():
    loaded = _modules_after("""
        from hybridflow.trainers.config.rl import load_rl_config
        from hybridflow.trainers.config.supervised import RMConfig, SFTConfig
        try:
            load_rl_config(None, ["data.train_path=x.jsonl", "actor.model.builtin=arithmetic",
                                  "reward.function=arithmetic", "trainer.total_steps=0"])
        except ValueError as error:
            assert "total_steps" in str(error)
        else:
            raise SystemExit("a bad value was accepted")
    """)
    assert loaded == set()


def test_the_train_command_reports_a_bad_config_value_before_importing_torch(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("data: {train_path: x.jsonl}\nactor: {model: {builtin: arithmetic}}\nreward: {function: arithmetic}\n")
    loaded = _modules_after(f"""
        from hybridflow.cli import main
        rc = main(["train", {str(config)!r}, "actor.engine.optim.lr=-1"])
        assert rc == 2, rc
    """)
    assert loaded == set()


def test_the_light_name_lists_equal_the_registries_they_name():
    from hybridflow.algorithms import KL_ESTIMATORS, LOSS_AGGREGATIONS, NON_FINITE_ACTIONS, POLICY_LOSSES, names
    from hybridflow.engine.hybrid_engine import STRATEGIES, TRANSITION_STRATEGIES
    from hybridflow.trainers.advantage import ESTIMATORS
    from hybridflow.trainers.estimators import ESTIMATOR_TRAITS

    assert names.POLICY_LOSS_NAMES == tuple(POLICY_LOSSES)
    assert names.LOSS_AGGREGATION_NAMES == tuple(LOSS_AGGREGATIONS)
    assert names.KL_ESTIMATOR_NAMES == tuple(KL_ESTIMATORS)
    assert names.NON_FINITE_ACTIONS == tuple(NON_FINITE_ACTIONS)
    assert tuple(ESTIMATOR_TRAITS) == tuple(ESTIMATORS)
    assert all(ESTIMATORS[name].traits is traits for name, traits in ESTIMATOR_TRAITS.items())
    assert STRATEGIES == tuple(TRANSITION_STRATEGIES)
    from hybridflow.engine.config import LAYOUT_TRAITS, LAYOUTS
    from hybridflow.engine.layouts import TRAINING_LAYOUTS

    assert LAYOUTS == tuple(TRAINING_LAYOUTS) == tuple(LAYOUT_TRAITS)
    assert all(TRAINING_LAYOUTS[name].traits is traits for name, traits in LAYOUT_TRAITS.items())


@pytest.mark.parametrize("package", ["engine", "models", "data", "workers", "algorithms"])
def test_lazy_packages_still_export_every_public_name(package):
    import importlib

    module = importlib.import_module(f"hybridflow.{package}")
    assert sorted(module.__all__) == sorted(module._EXPORTS)
    for name in module.__all__:
        assert getattr(module, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(module, "nope")
