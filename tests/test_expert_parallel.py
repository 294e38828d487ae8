"""Expert parallelism (``engine.ep_size``, parallel/expert_parallel.py) on a tiny random Qwen3-MoE (8 experts, top-2,
a dense layer among the MoE ones) over gloo processes: log-probs, losses and updated weights equal one process, the
router's balancing loss and routing replay work under it, checkpoints and generation weights hold whole experts,
and bad sizes are refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine_layouts import as_numpy, make_batch, rank_slice, token_nll_loss
from test_hybrid_engine import GREEDY, generate_on, prompts_and_mask
from transformers import AutoModelForCausalLM

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import build_tiny_model
from hybridflow.models.moe import ROUTED_EXPERTS
from hybridflow.parallel.launch import run_distributed

OPTIM = OptimConfig(lr=1e-3, eps=1e-4)
STEPS = 2
EXPERT_KEY = "model.layers.0.mlp.experts.gate_up_proj"


def tiny_moe(**overrides) -> torch.nn.Module:
    """Three layers, the middle one dense."""
    return build_tiny_model("qwen3_moe", seed=3, initializer_range=0.2, num_hidden_layers=3, mlp_only_layers=[1],
                            **overrides)


def routing(batch: dict, num_layers: int = 2, top_k: int = 2) -> torch.Tensor:
    """A random routing [B, S, L, K] of distinct experts per token (not the routers' own top-k)."""
    generator = torch.Generator().manual_seed(7)
    rows, columns = batch["input_ids"].shape
    scores = torch.rand(rows, columns, num_layers, 8, generator=generator)
    return scores.topk(top_k, dim=-1).indices.to(torch.int8)


def _run(rank: int, world_size: int, ep_sizes: list[int], checkpoint_dir: str | None) -> dict:
    """Per ep size: log-probs, losses and weights of STEPS steps; balancing-loss metrics and weights of one step
    (against the same world without ep); log-probs under routing replay; generation weights of the experts; with
    ``checkpoint_dir``: a checkpoint, and the log-probs of the model directory there read onto the meta device."""
    batch = make_batch()
    batch[ROUTED_EXPERTS] = routing(batch)
    results = {}
    for ep_size in ep_sizes:
        # four ranks: with activation checkpointing (backward recomputes each layer, all-to-alls included)
        config = EngineConfig(layout="3d", ep_size=ep_size, micro_batch_tokens=24, optim=OPTIM,
                              activation_checkpointing=world_size == 4)
        engine = TrainingEngine(config, tiny_moe)
        local = rank_slice(engine, batch)
        plain = {k: v for k, v in local.items() if k != ROUTED_EXPERTS}
        logprobs = engine.forward(plain)["logprobs"].numpy()
        shard = engine.model.model.layers["0"].mlp.experts.gate_up_proj.to_local().shape[0]
        losses = [engine.train_step(plain, token_nll_loss)["loss"] for _ in range(STEPS)]
        generation = engine.local_shards()[EXPERT_KEY].clone()
        weights = as_numpy(engine.full_state_dict())
        greedy = _generate(engine)
        if checkpoint_dir is not None:
            engine.save_checkpoint(f"{checkpoint_dir}/ep{ep_size}")
            results[f"meta{ep_size}"] = _meta_logprobs(config, f"{checkpoint_dir}/model", plain)
        engine.enable_routing_replay()
        replayed = engine.forward(local)["logprobs"].numpy()
        aux = {}
        for name, size in (("ep", ep_size), ("dp", 1)):  # the same world, experts split or replicated
            aux_config = EngineConfig(layout="3d", ep_size=size, micro_batch_tokens=1024, optim=OPTIM,
                                      router_aux_loss_coef=0.5)
            aux_engine = TrainingEngine(aux_config, tiny_moe)
            aux[name] = (aux_engine.train_step(plain, token_nll_loss), as_numpy(aux_engine.full_state_dict()))
        results[ep_size] = dict(logprobs=logprobs, losses=losses, weights=weights, generation=generation,
                                replayed=replayed, aux=aux, shard=shard, greedy=greedy)
    return results


def _meta_logprobs(config: EngineConfig, model_dir: str, batch: dict):
    from hybridflow.models.config import ModelConfig

    assert TrainingEngine.meta_init_supported(config, ModelConfig(path=model_dir))
    return TrainingEngine.from_model_config(config, ModelConfig(path=model_dir)).forward(batch)["logprobs"].numpy()


def _generate(engine: TrainingEngine) -> torch.Tensor:
    """Greedy responses of the hybrid engine's generation weights built from ``engine``'s shards."""
    from hybridflow.engine.hybrid_engine import HybridEngine, HybridEngineConfig

    hybrid = HybridEngine.for_training(engine, HybridEngineConfig())
    hybrid.to_generation(engine.local_shards())
    try:
        return generate_on(hybrid, *prompts_and_mask(4), GREEDY)["responses"]
    finally:
        hybrid.to_training()


def _single_process():
    batch = make_batch()
    batch[ROUTED_EXPERTS] = routing(batch)
    plain = {k: v for k, v in batch.items() if k != ROUTED_EXPERTS}
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OPTIM), tiny_moe)
    logprobs = engine.forward(plain)["logprobs"].numpy()
    losses = [engine.train_step(plain, token_nll_loss)["loss"] for _ in range(STEPS)]
    weights = as_numpy(engine.full_state_dict())
    engine.enable_routing_replay()
    return logprobs, losses, weights, engine.forward(batch)["logprobs"].numpy()


@pytest.fixture(scope="module")
def reference():
    return _single_process()


def _slice_aux_metric(world_size: int, rank: int) -> float:
    """The balancing loss one process reports training on rank ``rank``'s rows alone (one micro-batch, as there)."""
    batch = make_batch()
    rows = batch["input_ids"].shape[0] // world_size
    part = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=1024, optim=OPTIM, router_aux_loss_coef=0.5), tiny_moe)
    return engine.train_step(part, token_nll_loss)["router_aux_loss"]


def _check(reference, by_rank: list[dict], world_size: int, ep_size: int) -> None:
    logprobs, losses, weights, replayed = reference
    rows = len(logprobs) // world_size
    result = by_rank[0][ep_size]
    assert result["shard"] == 8 // ep_size  # each rank holds E / ep experts of every MoE layer
    for rank, per_rank in enumerate(by_rank):
        mine = per_rank[ep_size]
        part = slice(rank * rows, (rank + 1) * rows)
        np.testing.assert_allclose(mine["logprobs"], logprobs[part], rtol=1e-6, atol=2e-6, err_msg=f"rank {rank}")
        np.testing.assert_allclose(mine["replayed"], replayed[part], rtol=1e-6, atol=2e-6, err_msg=f"rank {rank}")
        # generation gets whole experts on every rank: the gathered tensor the exported weights hold
        np.testing.assert_array_equal(mine["generation"].numpy(), result["weights"][EXPERT_KEY])
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    # the hybrid engine generates from whole experts: transformers' greedy tokens on the trained weights
    model = tiny_moe().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in result["weights"].items()}, strict=False)
    prompts, mask = prompts_and_mask(4)
    with torch.no_grad():
        expected = model.generate(prompts, attention_mask=mask, max_new_tokens=GREEDY.max_new_tokens,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)[:, prompts.shape[1]:]
    for rank, per_rank in enumerate(by_rank):
        assert torch.equal(per_rank[ep_size]["greedy"], expected), rank
    assert set(result["weights"]) == set(weights)
    for key, value in weights.items():
        np.testing.assert_allclose(result["weights"][key], value, rtol=0, atol=1e-5, err_msg=key)
    # the balancing loss: each rank's is one process's on its rows; splitting the experts changes neither it nor the
    # step it takes (the same world with the experts replicated)
    (ep_metrics, ep_weights), (dp_metrics, dp_weights) = result["aux"]["ep"], result["aux"]["dp"]
    expected = np.mean([_slice_aux_metric(world_size, rank) for rank in range(world_size)])
    assert ep_metrics["router_aux_loss"] == pytest.approx(expected, rel=1e-6)
    assert ep_metrics["loss"] == pytest.approx(dp_metrics["loss"], rel=1e-6)
    for key, value in dp_weights.items():
        np.testing.assert_allclose(ep_weights[key], value, rtol=0, atol=1e-6, err_msg=f"aux {key}")


def test_ep2_on_two_ranks_equals_one_process_reads_a_model_directory_and_resumes_in_one(reference, tmp_path):
    tiny_moe().save_pretrained(str(tmp_path / "model"))
    by_rank = run_distributed(_run, 2, [2], str(tmp_path), timeout_s=500)
    _check(reference, by_rank, 2, 2)
    for rank, per_rank in enumerate(by_rank):  # read shard by shard onto the meta device: the same model
        rows = slice(rank * 4, (rank + 1) * 4)
        np.testing.assert_allclose(per_rank["meta2"], reference[0][rows], rtol=1e-6, atol=2e-6)
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OPTIM), tiny_moe)
    engine.load_checkpoint(str(tmp_path / "ep2"))
    assert engine.step == STEPS
    for key, value in as_numpy(engine.full_state_dict()).items():
        np.testing.assert_array_equal(value, by_rank[0][2]["weights"][key], err_msg=key)


@pytest.mark.slow
def test_ep4_and_ep2_by_edp2_on_four_ranks_equal_one_process(reference):
    by_rank = run_distributed(_run, 4, [4, 2], None, timeout_s=900)
    _check(reference, by_rank, 4, 4)
    _check(reference, by_rank, 4, 2)  # two ep groups of two: expert gradients summed over the ranks sharing them


def test_bad_expert_parallel_sizes_are_refused_naming_the_field_the_value_and_what_is_allowed():
    from hybridflow.parallel.expert_parallel import validate_ep_size

    with pytest.raises(ValueError, match=r"engine.ep_size=2 needs layout='3d' with pp_size=1 and tp_size=1, got "
                                         r"layout='fsdp'.*allowed: ep_size 1, or ep_size > 1 with layout='3d'"):
        EngineConfig(layout="fsdp", ep_size=2)
    with pytest.raises(ValueError, match=r"engine.ep_size=2 needs layout='3d' with pp_size=1 and tp_size=1, got "
                                         r"layout='3d', pp_size=1, tp_size=2"):
        EngineConfig(layout="3d", tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match=r"engine.ep_size must be a positive integer, got 0"):
        EngineConfig(layout="3d", ep_size=0)
    with pytest.raises(ValueError, match=r"engine.ep_size=2 needs a mixture-of-experts model; model_type 'qwen3' "
                                         r"has no experts; allowed: ep_size 1 for dense models"):
        TrainingEngine(EngineConfig(layout="3d", ep_size=2), lambda: build_tiny_model("qwen3"))
    with pytest.raises(ValueError, match=r"engine.ep_size=2 must divide the world size 1; allowed: \[1\]"):
        TrainingEngine(EngineConfig(layout="3d", ep_size=2), tiny_moe)
    with pytest.raises(ValueError, match=r"engine.ep_size=4 must divide the 6 experts of 'qwen3_moe'; allowed "
                                         r"\(also dividing the world size 4\): \[1, 2\]"):
        validate_ep_size(tiny_moe(num_experts=6), 4, 4)


def test_a_run_config_refuses_an_ep_size_that_does_not_divide_the_roles_pool():
    from hybridflow.trainers.config.rl import load_rl_config

    overrides = ["data.train_path=unused.jsonl", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
                 "placement.pools.global=[2]", "actor.engine.layout=3d"]
    with pytest.raises(ValueError, match=r"config key actor.engine.ep_size got 4; allowed: a divisor of the 2 devices "
                                         r"of pool 'global'"):
        load_rl_config(None, [*overrides, "actor.engine.ep_size=4"]).derived()
    assert load_rl_config(None, [*overrides, "actor.engine.ep_size=2"]).derived()



def test_a_grpo_run_on_ray_trains_a_qwen3_moe_actor_under_expert_parallel_with_routing_replay(ray_session, tmp_path):
    from test_families import family_model_dir

    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    model_dir = family_model_dir("qwen3_moe", tmp_path / "model")
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(4, split="train", seed=0, config=ArithmeticTaskConfig()))
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'prompts.jsonl'}", f"actor.model.path={model_dir}", "placement.pools={all: [2]}",
        "actor.engine.layout=3d", "actor.engine.ep_size=2", "actor.engine.router_aux_loss_coef=0.001",
        "actor.routing_replay=true", "actor.loss.old_log_probs=recompute", "reward.function=arithmetic",
        "algorithm.advantage_estimator=grpo", "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2",
        "batch.samples_per_prompt=2", "batch.mini_batch_size=4", "trainer.total_steps=1", "trainer.progress_bar=false",
        "trainer.resume=false", f"trainer.output_dir={tmp_path / 'grpo'}"])
    trainer = RLTrainer(config, mode="ray", tensorboard=False)
    try:
        step = trainer.fit()[-1]
        trainer.groups["actor"].export_hf(str(tmp_path / "export"))
    finally:
        trainer.shutdown()
    # an fp32 rollout from the gathered experts, rescored under expert parallel with its routing: the same log-probs
    assert step["rollout/logprob_abs_diff_max"] < 1e-5
    assert step["actor/routing_replay_overridden"] == 0.0
    assert step["actor/router_aux_loss"] > 0.5
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    expert = "model.layers.0.mlp.experts.gate_up_proj"
    assert trained.state_dict()[expert].shape == initial.state_dict()[expert].shape  # whole experts exported
    assert not torch.equal(trained.state_dict()[expert], initial.state_dict()[expert])
