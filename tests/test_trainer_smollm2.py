"""Two GRPO steps on SmolLM2-135M-Instruct with GSM8K-style prompts (skipped when the checkpoint is absent)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hybridflow.controller import local_mode
from hybridflow.models import smollm2_path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_gsm8k"


@pytest.mark.slow
@pytest.mark.needs_smollm2
def test_two_grpo_steps_on_smollm2_run_end_to_end(tmp_path):
    if smollm2_path() is None:
        pytest.skip("SmolLM2-135M-Instruct not converted (run scripts/get_smollm2.py)")
    if importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning-gym not installed (pip install 'hybridflow[math]')")
    sys.path.insert(0, str(EXAMPLE))
    try:
        import run as example
    finally:
        sys.path.remove(str(EXAMPLE))
    with local_mode():
        history = example.run([f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", "trainer.val_every=0",
                               "trainer.save_every=0", "trainer.progress_bar=false", "batch.prompts_per_step=2",
                               "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
                               "actor.generation.max_new_tokens=24"], num_train=8, num_eval=2)
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert 1 <= record["response/length_mean"] <= 24
        assert 0.0 <= record["reward/score_mean"] <= 1.0
        assert record["actor/lr"] > 0 and record["actor/grad_norm"] >= 0
    assert history[0]["kl/coef"] == 0.001 and "actor/kl_loss" in history[0]
