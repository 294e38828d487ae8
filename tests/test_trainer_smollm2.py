"""Two GRPO steps on SmolLM2-135M-Instruct with GSM8K-style prompts (skipped when the checkpoint is absent)."""

from __future__ import annotations

import pytest

from smollm2_example import run_two_grpo_steps


@pytest.mark.slow
@pytest.mark.needs_smollm2
def test_two_grpo_steps_on_smollm2_run_end_to_end(tmp_path):
    history = run_two_grpo_steps(tmp_path, max_new_tokens=24, num_train=8, num_eval=2)
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert 1 <= record["response/length_mean"] <= 24
        assert 0.0 <= record["reward/score_mean"] <= 1.0
        assert record["actor/lr"] > 0 and record["actor/grad_norm"] >= 0
    assert history[0]["kl/coef"] == 0.001 and "actor/kl_loss" in history[0]
