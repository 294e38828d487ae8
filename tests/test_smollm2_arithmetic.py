"""examples/smollm2_arithmetic in short form: two GRPO steps of SmolLM2-135M-Instruct with the response prefix
(skipped when the checkpoint or reasoning-gym is absent)."""

from __future__ import annotations

from pathlib import Path

import pytest
from smollm2_example import load_example

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_arithmetic"


@pytest.mark.slow
@pytest.mark.needs_smollm2
def test_two_steps_of_the_arithmetic_example_learn_from_prefixed_answers(tmp_path):
    example = load_example(EXAMPLE)
    history = example.run([f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", "trainer.val_every=2",
                           "trainer.progress_bar=false", "batch.prompts_per_step=2", "batch.samples_per_prompt=4",
                           "batch.mini_batch_size=4", "actor.generation.max_new_tokens=4"],
                          num_train=16, num_eval=4, mode="local")
    assert [record["step"] for record in history] == [0, 1, 2]
    for record in history[1:]:
        assert 0.0 <= record["signal/tied_groups"] <= 1.0 and 0.0 <= record["reward/score_mean"] <= 1.0
        assert record["actor/lr"] == 2e-5 and "actor/pg_grad_share" in record
    assert abs(history[1]["kl/sequence_kl"]) < 1e-4  # the reference equals the actor before the first update
    # the answers the reward read start with the prefix; the exported model scores with plain transformers
    config = example.build_config([f"trainer.output_dir={tmp_path}", "actor.generation.max_new_tokens=4"],
                                  num_train=16, num_eval=4)
    assert 0.0 <= example.evaluate(str(tmp_path / "final" / "actor"), config) <= 1.0
