"""The README's hand-written loop (examples/custom_grpo_loop.py) runs as shown."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_grpo_loop.py"


def test_the_readme_custom_grpo_loop_runs_two_steps_in_single_process_mode(tmp_path):
    spec = importlib.util.spec_from_file_location("custom_grpo_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.run(2, tmp_path, local=True)
    assert len(history) == 2
    for metrics in history:
        assert {"actor/loss", "actor/grad_norm", "reward/score_mean"} <= set(metrics)
        assert all(math.isfinite(value) for value in metrics.values())
        assert 0.0 <= metrics["reward/score_mean"] <= 1.0
