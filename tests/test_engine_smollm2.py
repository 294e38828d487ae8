"""Tensor parallelism of size 3 on SmolLM2-135M (9 heads, 3 key/value heads, tied embeddings) matches a
single process for one training step."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import ModelConfig, build_model, smollm2_path
from hybridflow.parallel.launch import run_distributed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.needs_smollm2,
    pytest.mark.skipif(smollm2_path() is None,
                       reason="SmolLM2-135M not converted; run `python scripts/get_smollm2.py`"),
]

ROWS, PROMPT_LEN, RESPONSE_LEN = 3, 10, 6
OPTIM = OptimConfig(lr=1e-4, eps=1e-4)


def make_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 49152, (ROWS, PROMPT_LEN + RESPONSE_LEN), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, -3:] = 0
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, -RESPONSE_LEN:],
                response_mask=mask[:, -RESPONSE_LEN:])


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"]
    return -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"], {}


def one_step_and_export(rank, world_size, export_dir):
    config = EngineConfig(layout="3d", tp_size=world_size, micro_batch_tokens=32, optim=OPTIM)
    engine = TrainingEngine(config, lambda: build_model(ModelConfig(path=smollm2_path(), dtype="float32")))
    loss = engine.train_step(make_batch(), nll_loss)["loss"]
    engine.export_hf(export_dir)
    return loss


def test_tp3_on_smollm2_gives_single_process_loss_and_weights_after_one_step(tmp_path):
    from safetensors.torch import load_file

    reference_loss = one_step_and_export(0, 1, str(tmp_path / "single"))
    tp3_loss = run_distributed(one_step_and_export, 3, str(tmp_path / "tp3"), timeout_s=500)[0]
    assert tp3_loss == pytest.approx(reference_loss, rel=1e-5)
    expected = load_file(str(tmp_path / "single" / "model.safetensors"))
    actual = load_file(str(tmp_path / "tp3" / "model.safetensors"))
    assert set(actual) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=5e-6, msg=name)
