"""Optimizer-state offload around generation (actor.hybrid_engine.offload_optimizer), tested on the CPU by
offloading CPU state too (``include_cpu=True``): same tensors, freed storage between phases, same training."""

from __future__ import annotations

import pytest
import torch

from hybridflow.controller import ResourcePool, WorkerGroup, local_mode
from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.engine.generation import GenerationConfig
from hybridflow.engine.generation_config import GenerationTokens
from hybridflow.engine.hybrid_engine_config import HybridEngineConfig
from hybridflow.engine.optim import OptimizerOffload
from hybridflow.models import build_tiny_model

ROWS, LENGTH = 4, 10


def batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 256, (ROWS, LENGTH), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, -4:], response_mask=mask[:, -4:])


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"]
    return -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"], {}


def engine() -> TrainingEngine:
    config = EngineConfig(dtype="float32", optim=OptimConfig(lr=1e-2, eps=1e-4, weight_decay=0.1))
    return TrainingEngine(config, lambda: build_tiny_model(head="lm"), head="lm")


def state_of(engine: TrainingEngine) -> list[torch.Tensor]:
    return [value.clone() for state in engine.optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor)]


def test_training_with_the_state_offloaded_between_steps_is_bitwise_the_training_without():
    plain, offloaded = engine(), engine()
    offload = OptimizerOffload(offloaded.optimizer, include_cpu=True)
    for step in range(3):
        plain.train_step(batch(step), nll_loss)
        offloaded.train_step(batch(step), nll_loss)
        moved = offload.state_tensors()
        identities = [id(local) for _, local in moved]
        freed = offload.offload()
        # between the phases: every state storage is empty and the host copies hold its bytes
        assert freed == sum(host.numel() for host in offload._host.values()) > 0
        assert all(local.untyped_storage().nbytes() == 0 for _, local in moved)
        assert offload.offloaded
        offload.reload()
        assert not offload.offloaded
        assert [id(local) for _, local in moved] == identities
        assert all(local.untyped_storage().nbytes() > 0 for _, local in moved)
    for (name, a), b in zip(plain.model.named_parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(state_of(plain), state_of(offloaded)):
        assert torch.equal(a, b)


def test_offload_moves_every_moment_of_adamw_and_frees_their_bytes():
    trained = engine()
    trained.train_step(batch(0), nll_loss)
    offload = OptimizerOffload(trained.optimizer, include_cpu=True)
    moments = sum(state[k].numel() * state[k].element_size() for state in trained.optimizer.state.values()
                  for k in ("exp_avg", "exp_avg_sq"))
    steps = sum(state["step"].numel() * state["step"].element_size() for state in trained.optimizer.state.values())
    assert offload.offload() == moments + steps
    offload.reload()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine keeps its state on the GPU here: nothing is on the CPU")
def test_state_already_on_the_cpu_is_left_alone_so_a_cpu_run_offloads_nothing():
    trained = engine()
    trained.train_step(batch(0), nll_loss)
    before = state_of(trained)
    offload = OptimizerOffload(trained.optimizer)
    assert offload.state_tensors() == [] and offload.offload() == 0 and not offload.offloaded
    offload.reload()
    assert all(torch.equal(a, b) for a, b in zip(before, state_of(trained)))


def test_offloading_twice_without_a_reload_is_an_error():
    trained = engine()
    trained.train_step(batch(0), nll_loss)
    offload = OptimizerOffload(trained.optimizer, include_cpu=True)
    offload.offload()
    with pytest.raises(RuntimeError, match="offloaded twice"):
        offload.offload()
    offload.reload()


def test_the_actor_reports_in_its_transition_stats_that_a_cpu_run_offloads_nothing():
    from test_workers import _prompts, _spec

    from hybridflow.data.builtin import builtin_tokenizer
    from hybridflow.workers import ActorSpec, ActorWorker

    tokenizer = builtin_tokenizer()
    spec = ActorSpec(engine=_spec("lm"), hybrid_engine=HybridEngineConfig(offload_optimizer=True),
                     generation=GenerationConfig(max_new_tokens=3),
                     tokens=GenerationTokens(eos_token_ids=(tokenizer.eos_token_id,),
                                             pad_token_id=tokenizer.pad_token_id))
    with local_mode():
        actor = WorkerGroup(ResourcePool([1]), ActorWorker, spec)
        actor.generate_sequences(_prompts(2))
        stats = actor.transition_stats()[0]
        actor.shutdown()
    assert stats["optimizer_offloaded"] == 0.0 and stats["optimizer_offloaded_bytes"] == 0


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_non_boolean_offload_option_is_rejected_with_the_field_named(value):
    with pytest.raises(ValueError, match="offload_optimizer"):
        HybridEngineConfig(offload_optimizer=value)


def _train_with_offload(rank: int, world_size: int, layouts: dict) -> dict:
    from test_engine_layouts import NUM_STEPS, as_numpy, build_engine, make_batch, rank_slice, token_nll_loss

    data, results = make_batch(), {}
    for name, layout in layouts.items():
        trained = build_engine(**layout)
        offload = OptimizerOffload(trained.optimizer, include_cpu=True)
        emptied = []
        for _ in range(NUM_STEPS):
            trained.train_step(rank_slice(trained, data), token_nll_loss)
            moved = offload.state_tensors()
            offload.offload()
            emptied.append(bool(moved) and all(local.untyped_storage().nbytes() == 0 for _, local in moved))
            offload.reload()
        sharded = any(hasattr(value, "to_local") for state in trained.optimizer.state.values()
                      for value in state.values())
        results[name] = (as_numpy(trained.full_state_dict()), emptied, sharded)
    return results


def test_sharded_dtensor_state_under_fsdp2_and_tp2_offloads_and_trains_as_a_single_process():
    from test_engine_layouts import assert_same_weights, single_process_run

    from hybridflow.parallel.launch import run_distributed

    layouts = {"fsdp2": dict(layout="fsdp"), "tp2": dict(layout="3d", tp_size=2)}
    results = run_distributed(_train_with_offload, 2, layouts, timeout_s=400)[0]
    _, weights, _ = single_process_run()
    for name in layouts:
        got, emptied, sharded = results[name]
        assert sharded and all(emptied), name  # DTensor moments, every storage emptied between phases
        assert_same_weights(weights, got)
