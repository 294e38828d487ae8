"""The training engine's non-finite guard: a NaN/inf loss or gradient norm never reaches the weights."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import NonFiniteError
from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import build_tiny_model


def tiny_engine(lr: float) -> TrainingEngine:
    config = EngineConfig(micro_batch_tokens=4096, optim=OptimConfig(lr=lr, eps=1e-4))
    return TrainingEngine(config, lambda: build_tiny_model(head="lm"), head="lm")


def make_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (4, 10), generator=generator)
    mask = torch.ones_like(ids)
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, -4:], response_mask=mask[:, -4:])


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"].bool()
    nll = -torch.where(mask, outputs["logprobs"], 0.0).sum() / micro_batch["num_tokens_global"]
    return nll, {"nll": nll.detach()}


def nan_kl_loss(outputs, micro_batch):
    nll, metrics = nll_loss(outputs, micro_batch)
    kl = outputs["logprobs"].sum() * math.nan
    return nll + kl, {**metrics, "kl_loss": kl.detach()}


def weights(engine: TrainingEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.params]


def test_a_huge_learning_rate_stops_training_before_nan_reaches_the_weights():
    # on the tiny fp32 model lr=1e6 only saturates the loss at ln(256); 1e20 overflows the activations
    engine, batch = tiny_engine(lr=1e20), make_batch()
    with pytest.raises(NonFiniteError, match=r"actor training step \d+: (nll|loss|grad_norm) is") as caught:
        for _ in range(5):
            before = weights(engine)
            engine.train_step(batch, nll_loss, outputs=("logprobs",), context="actor")
    assert caught.value.quantity in ("nll", "loss", "grad_norm")
    after = weights(engine)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(bool(torch.isfinite(p).all()) for p in after)


def test_an_injected_nan_loss_term_is_named_and_the_step_is_not_taken():
    engine, batch = tiny_engine(lr=1e-3), make_batch()
    before = weights(engine)
    with pytest.raises(NonFiniteError, match="critic training step 0: kl_loss is nan") as caught:
        engine.train_step(batch, nan_kl_loss, outputs=("logprobs",), context="critic")
    assert caught.value.quantity == "kl_loss"
    assert engine.step == 0
    assert all(torch.equal(a, b) for a, b in zip(weights(engine), before))


def test_skip_drops_a_non_finite_step_and_the_next_finite_step_trains():
    engine, batch = tiny_engine(lr=1e-3), make_batch()
    before = weights(engine)
    metrics = engine.train_step(batch, nan_kl_loss, outputs=("logprobs",), on_non_finite="skip")
    assert metrics["skipped_non_finite"] == 1.0 and engine.step == 0
    assert all(torch.equal(a, b) for a, b in zip(weights(engine), before))
    metrics = engine.train_step(batch, nll_loss, outputs=("logprobs",), on_non_finite="skip")
    assert "skipped_non_finite" not in metrics and engine.step == 1
    assert all(not torch.equal(a, b) for a, b in zip(weights(engine), before))


def test_an_unknown_non_finite_action_is_a_value_error():
    engine = tiny_engine(lr=1e-3)
    with pytest.raises(ValueError, match="on_non_finite must be one of"):
        engine.train_step(make_batch(), nll_loss, outputs=("logprobs",), on_non_finite="ignore")
