"""engine.activation_checkpointing: each decoder layer recomputes in backward, and gradients and training
steps equal those without it (single process, FSDP2 and 3d layouts on gloo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.engine import EngineConfig
from hybridflow.models import build_tiny_model
from hybridflow.parallel.activation_checkpoint import apply_activation_checkpointing
from hybridflow.parallel.launch import run_distributed
from hybridflow.parallel.pipeline import build_stage

WORLD2_LAYOUTS = {
    "fsdp2": dict(layout="fsdp", activation_checkpointing=True),
    "tp2": dict(layout="3d", tp_size=2, activation_checkpointing=True),
    "pp2": dict(layout="3d", pp_size=2, activation_checkpointing=True),
}


def stage_gradients(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of a whole-model stage on a packed row of three sequences, and the attention calls made."""
    torch.manual_seed(0)
    stage = build_stage(build_tiny_model(), head="lm", pp_size=1, pp_rank=0)
    if checkpointing:
        apply_activation_checkpointing(stage)
    calls = []
    for layer in stage.model.layers.values():
        layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    logits = stage(tokens, positions)
    torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).sum().backward()
    return {name: p.grad.clone() for name, p in stage.named_parameters()}, len(calls)


def test_checkpointed_layers_recompute_in_backward_and_give_the_same_gradients():
    plain, plain_calls = stage_gradients(checkpointing=False)
    checkpointed, checkpointed_calls = stage_gradients(checkpointing=True)
    layers = len(build_tiny_model().model.layers)
    assert plain_calls == layers and checkpointed_calls == 2 * layers  # one recompute per layer in backward
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-6, msg=name)


def test_forwards_without_gradients_do_not_recompute_or_change_the_outputs():
    torch.manual_seed(0)
    stage = build_stage(build_tiny_model(), head="lm", pp_size=1, pp_rank=0)
    tokens, positions = torch.arange(3, 11)[None], torch.arange(8)[None]
    with torch.no_grad():
        before = stage(tokens, positions)
        apply_activation_checkpointing(stage)
        after = stage(tokens, positions)
    assert torch.equal(before, after)


def test_parameter_names_are_unchanged_by_checkpointing():
    torch.manual_seed(0)
    plain = build_stage(build_tiny_model(), head="lm", pp_size=1, pp_rank=0)
    torch.manual_seed(0)
    checkpointed = apply_activation_checkpointing(build_stage(build_tiny_model(), head="lm", pp_size=1, pp_rank=0))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()


def _train(rank: int, world_size: int, layouts: dict) -> dict:
    from test_engine_layouts import NUM_STEPS, as_numpy, build_engine, make_batch, rank_slice, token_nll_loss

    batch, results = make_batch(), {}
    for name, layout in layouts.items():
        engine = build_engine(**layout)
        losses = [engine.train_step(rank_slice(engine, batch), token_nll_loss)["loss"] for _ in range(NUM_STEPS)]
        results[name] = (losses, as_numpy(engine.full_state_dict()))
    return results


@pytest.fixture(scope="module")
def world2_checkpointed():
    return run_distributed(_train, 2, WORLD2_LAYOUTS, timeout_s=400)[0]


@pytest.mark.parametrize("name", list(WORLD2_LAYOUTS))
def test_training_with_checkpointing_under_fsdp2_and_3d_layouts_equals_a_plain_single_process(name,
                                                                                              world2_checkpointed):
    from test_engine_layouts import assert_same_weights, single_process_run

    losses, weights, _ = single_process_run()
    got_losses, got_weights = world2_checkpointed[name]
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    assert_same_weights(weights, got_weights)


@pytest.mark.parametrize("value", [1, "true", None])
def test_a_non_boolean_activation_checkpointing_is_rejected_with_the_field_named(value):
    with pytest.raises(ValueError, match="engine.activation_checkpointing"):
        EngineConfig(activation_checkpointing=value)
