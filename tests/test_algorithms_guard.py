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
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, -4:], "response_mask": mask[:, -4:]}


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


# ------------------------------------------------------------------ every objective trains the tiny model
@pytest.mark.parametrize(("policy_loss", "aggregation"), [
    ("ppo", "token-mean"), ("ppo", "seq-mean-token-sum-norm"), ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean"),
])
def test_each_policy_objective_updates_every_parameter_of_the_tiny_model(policy_loss, aggregation):
    from hybridflow.algorithms import POLICY_LOSSES, aggregate_loss, kl_estimate

    engine, batch = tiny_engine(lr=1e-3), make_batch()
    batch["response_mask"] = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    old = engine.forward(batch, outputs=("logprobs",))["logprobs"]
    batch["old_logprobs"], batch["ref_logprobs"] = old, old - 0.1
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 4).contiguous()

    def loss_fn(outputs, micro_batch):
        mask_BT = micro_batch["response_mask"]
        out = POLICY_LOSSES[policy_loss](outputs["logprobs"], micro_batch["old_logprobs"], micro_batch["advantages"],
                                         mask_BT=mask_BT, clip_ratio_low=0.2, clip_ratio_high=0.28)
        counts = {"num_tokens_global": micro_batch["num_tokens_global"],
                  "num_sequences_global": micro_batch["num_sequences_global"], "constant_normalizer": 4}
        kl_BT = kl_estimate(outputs["logprobs"], micro_batch["ref_logprobs"], estimator="k3", mask_BT=mask_BT)
        loss = aggregate_loss(out.loss_BT, mask_BT, aggregation=aggregation, **counts)
        return loss + 0.01 * aggregate_loss(kl_BT, mask_BT, aggregation=aggregation, **counts), {}

    before = weights(engine)
    for _ in range(2):
        metrics = engine.train_step(batch, loss_fn, outputs=("logprobs",))
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert all(not torch.equal(a, b) for a, b in zip(weights(engine), before))
