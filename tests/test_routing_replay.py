"""Routing replay (R3) on tiny random Qwen3-MoE models: the native rollout records the experts its routers chose, the
training engine routes by them when asked (and only then), the rollout-training log-prob gap of a bf16 rollout under
fp32 training shrinks with it, a GRPO run trains with it, and the settings it cannot serve are refused."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from test_engine_layouts import make_batch, rank_slice, token_nll_loss
from test_families import family_model_dir

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.engine.decoder import DecoderStage
from hybridflow.engine.generation import GenerationEngine, SamplingConfig
from hybridflow.engine.rollout import ROLLOUT_BACKENDS, BackendEntry, rollout_backend
from hybridflow.models import build_tiny_model
from hybridflow.models.moe import ROUTED_EXPERTS, ROUTING_PAD, moe_routers, replayed_weights, route
from hybridflow.parallel.launch import run_distributed
from hybridflow.protocol import DataProto

BENCH_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_routing_replay.py"
_spec = importlib.util.spec_from_file_location("bench_routing_replay", BENCH_PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # the benchmark's measurement is the one the gap test checks


def tiny_moe(**overrides) -> torch.nn.Module:
    """Three layers, the middle one dense: ``routed_experts`` holds the two MoE layers only."""
    return build_tiny_model("qwen3_moe", seed=3, initializer_range=0.2, num_hidden_layers=3, mlp_only_layers=[1],
                            **overrides)


def with_positions(batch: dict) -> dict:
    return {**batch, "position_ids": (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)}


@pytest.mark.parametrize("static_decode", [False, True])
def test_the_recorded_routing_is_what_a_forward_in_the_same_precision_routes_each_processed_token_to(static_decode):
    model = tiny_moe()
    generator = torch.Generator().manual_seed(0)
    prompts_BP = torch.randint(3, 256, (6, 7), generator=generator)
    mask_BP = torch.ones_like(prompts_BP)
    mask_BP[1, :3] = mask_BP[4, :1] = 0
    engine = GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict()),
                              static_decode=static_decode)
    # a fifth of the vocabulary ends a response: rows finish at different steps (compacting decode drops them)
    config = SamplingConfig(max_new_tokens=12, seed=1, record_routing=True, eos_token_ids=tuple(range(3, 55)))
    out = engine.generate(prompts_BP * mask_BP, mask_BP, config)
    recorded_BSLK = out[ROUTED_EXPERTS]
    assert recorded_BSLK.shape == (6, 7 + 12, 2, model.config.num_experts_per_tok)
    assert recorded_BSLK.dtype == torch.int8
    lengths_B = out["response_mask"].sum(-1)
    assert 1 <= int(lengths_B.min()) < int(lengths_B.max())
    real_BS = out["attention_mask"].bool()
    assert bool((recorded_BSLK[~real_BS] == ROUTING_PAD).all())
    # every real token but each row's last (sampled after the last forward) went through the decoder
    last_B = real_BS.shape[1] - 1 - real_BS.flip(-1).long().argmax(-1)
    read_BS = real_BS.clone()
    read_BS[torch.arange(6), last_B] = False
    assert bool((recorded_BSLK[read_BS] >= 0).all())
    plain_BSLK = bench.fp32_routing(model, out)
    assert torch.equal(recorded_BSLK[read_BS].long(), plain_BSLK[read_BS])
    assert "routed_experts" not in engine.generate(prompts_BP, mask_BP, SamplingConfig(max_new_tokens=2))


def test_replayed_weights_of_the_top_k_equal_the_routers_own_and_reach_the_router_with_gradients():
    hidden_TH = torch.randn(10, 16, generator=torch.Generator().manual_seed(0))
    router_EH = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    logits_TE, weights_TK, experts_TK = route(hidden_TH, router_EH, 3, True)
    assert torch.equal(replayed_weights(logits_TE, experts_TK, True), weights_TK)
    other_TK = (experts_TK + 1) % 8
    replayed_TK = replayed_weights(logits_TE, other_TK, True)
    torch.testing.assert_close(replayed_TK.sum(-1), torch.ones(10))
    (replayed_TK * torch.arange(3.0)).sum().backward()
    assert router_EH.grad is not None and float(router_EH.grad.abs().sum()) > 0


def chosen_experts(ids_N: torch.Tensor, layer: int, config) -> torch.Tensor:
    """A routing unlike the router's: token v of MoE layer ``layer`` goes to experts (v + layer + k) % E, k < K."""
    return (ids_N[:, None] + layer + torch.arange(config.num_experts_per_tok, device=ids_N.device)) % config.num_experts


def forced_routing(batch: dict, config) -> torch.Tensor:
    """``chosen_experts`` of every token of the batch as ``routed_experts`` [B, S, 2, K] (padding unrecorded)."""
    ids_BS = batch["input_ids"]
    routing_BSLK = torch.stack([chosen_experts(ids_BS.reshape(-1), layer, config).view(*ids_BS.shape, -1)
                                for layer in range(2)], dim=2).to(torch.int8)
    return routing_BSLK.masked_fill(~batch["attention_mask"].bool()[..., None, None], ROUTING_PAD)


def _experts_inputs(model: torch.nn.Module) -> list:
    """Hooks recording (packed input ids, [per MoE layer: the experts it computed each token with]) per forward."""
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append((args[0][0].clone(), [])))
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda module, args: calls[-1][1].append(args[1].clone()))
    return calls


def test_a_replaying_forward_routes_every_token_to_the_given_experts_and_only_then():
    model = tiny_moe()
    batch = with_positions(make_batch())
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OptimConfig(lr=1e-2)),
                            lambda: copy.deepcopy(model))
    plain_BT = engine.forward(batch)["logprobs"]
    engine.enable_routing_replay()
    assert torch.equal(engine.forward(batch)["logprobs"], plain_BT)  # no routed_experts: the routers decide
    # the experts a plain forward picks, replayed: the same computation, bit for bit
    own_BSLK = bench.fp32_routing(model, batch).to(torch.int8)
    assert torch.equal(engine.forward({**batch, ROUTED_EXPERTS: own_BSLK})["logprobs"], plain_BT)

    # other experts than its own: token v of MoE layer l goes to experts (v + l + k) % E, k < K
    calls = _experts_inputs(engine.model)
    forced_BT = engine.forward({**batch, ROUTED_EXPERTS: forced_routing(batch, model.config)})["logprobs"]
    assert len(calls) > 1  # several packed micro-batches
    for ids_N, experts in calls:
        assert len(experts) == 2
        for layer, experts_NK in enumerate(experts):
            assert torch.equal(experts_NK, chosen_experts(ids_N, layer, model.config))
    mask_BT = batch["response_mask"].bool()
    assert float((forced_BT - plain_BT).abs()[mask_BT].max()) > 1e-3
    # training with replay: the loss is the forced routing's, and the router still learns
    router_before = moe_routers(engine.model)[0].weight.detach().clone()
    metrics = engine.train_step({**batch, ROUTED_EXPERTS: forced_routing(batch, model.config)}, token_nll_loss)
    expected = -(forced_BT * mask_BT).sum() / mask_BT.sum()
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert metrics["routing_replay_overridden"] > 0.5  # few tokens' own experts are the forced ones
    assert not torch.equal(moe_routers(engine.model)[0].weight.detach(), router_before)


def _replayed_logprobs(rank: int, world_size: int, layouts: dict) -> dict:
    """Per layout, this rank's rows' log-probs under the forced routing (rank 0 holds the first rows)."""
    results = {}
    for name, layout in layouts.items():
        engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, **layout), lambda: tiny_moe())
        engine.enable_routing_replay()
        batch = with_positions(make_batch())
        batch[ROUTED_EXPERTS] = forced_routing(batch, engine.hf_config)
        results[name] = engine.forward(rank_slice(engine, batch))["logprobs"]
    return results


def test_replay_under_fsdp_and_tensor_parallelism_on_two_ranks_equals_one_process():
    layouts = {"fsdp2": dict(layout="fsdp"), "tp2": dict(layout="3d", tp_size=2)}
    single_BT = _replayed_logprobs(0, 1, {"one": {}})["one"]
    for name, logprobs_BT in run_distributed(_replayed_logprobs, 2, layouts, timeout_s=300)[0].items():
        torch.testing.assert_close(logprobs_BT, single_BT[:len(logprobs_BT)], rtol=1e-6, atol=2e-6, msg=name)


def test_activation_checkpointing_recomputes_the_replayed_routing():
    batch = with_positions(make_batch())
    results = []
    for checkpointing in (False, True):
        engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, activation_checkpointing=checkpointing,
                                             optim=OptimConfig(lr=1e-2)), lambda: tiny_moe())
        engine.enable_routing_replay()
        metrics = engine.train_step({**batch, ROUTED_EXPERTS: forced_routing(batch, engine.hf_config)}, token_nll_loss)
        results.append((metrics["loss"], metrics["grad_norm"], engine.full_state_dict()))
    (loss, norm, weights), (loss_ckpt, norm_ckpt, weights_ckpt) = results
    assert loss_ckpt == pytest.approx(loss, rel=1e-6) and norm_ckpt == pytest.approx(norm, rel=1e-5)
    for name, tensor in weights.items():
        torch.testing.assert_close(weights_ckpt[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_replay_leaves_no_larger_log_prob_gap_between_a_bf16_rollout_and_fp32_training():
    model = bench.tiny_moe(seed=0, experts=16, top_k=4, layers=4)
    result = bench.measure(model, rows=16, prompt_len=8, new_tokens=24, seed=0)
    assert result["routing_differs_fraction"] > 0  # bf16 routes some token otherwise than fp32
    assert result["replay_max"] <= result["plain_max"]
    assert result["replay_mean"] < result["plain_mean"]


def test_the_engine_refuses_replay_for_a_dense_model_and_a_routing_it_cannot_use():
    dense = TrainingEngine(EngineConfig(), lambda: build_tiny_model("qwen3", seed=0))
    with pytest.raises(ValueError, match=r"actor\.routing_replay=True needs a mixture-of-experts model .*'qwen3'"):
        dense.enable_routing_replay()
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=64), lambda: tiny_moe())
    batch = with_positions(make_batch())
    routing_BSLK = torch.zeros((*batch["input_ids"].shape, 2, 2), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"holds 'routed_experts' but routing replay is off"):
        engine.forward({**batch, ROUTED_EXPERTS: routing_BSLK})
    engine.enable_routing_replay()
    with pytest.raises(ValueError, match=r"routed_experts must be integer expert ids of shape \[B, S, MoE layers, "
                                         r"top_k\] = \[8, 11, 2, 2\]; got torch.int8 \[8, 11, 3, 2\]"):
        engine.forward({**batch, ROUTED_EXPERTS: torch.zeros((*batch["input_ids"].shape, 3, 2), dtype=torch.int8)})


def test_the_config_refuses_replay_where_no_routing_is_recorded(monkeypatch):
    from hybridflow.trainers.config.rl import load_rl_config

    base = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score",
            "actor.routing_replay=true"]
    assert load_rl_config(None, base).actor.routing_replay
    assert rollout_backend("vllm").records_routing  # through hooks on its routers (tests/test_vllm_routing.py)
    if importlib.util.find_spec("vllm") is not None:  # a backend whose package is missing is refused first
        assert load_rl_config(None, [*base, "actor.generation.backend=vllm"]).actor.routing_replay
    monkeypatch.setitem(ROLLOUT_BACKENDS, "plain", BackendEntry("hybridflow.engine.native_rollout:NativeRollout"))
    with pytest.raises(ValueError, match=r"actor\.routing_replay got True; allowed: false with "
                                         r"actor\.generation\.backend=plain, which does not report .*: native"):
        load_rl_config(None, [*base, "actor.generation.backend=plain"])
    with pytest.raises(ValueError, match=r"actor\.routing_replay got True; allowed: false unless actor\.engine\."
                                         r"pp_size and actor\.hybrid_engine\.pp_size are 1 \(got 2 and 1\)"):
        load_rl_config(None, [*base, "actor.engine.layout=3d", "actor.engine.pp_size=2"])
    with pytest.raises(ValueError, match=r"actor\.routing_replay got True; allowed: false with env\.class or "
                                         r"placement\.roles\.rollout"):
        load_rl_config(None, [*base, "placement.pools={trainer: [1], gen: [1]}",
                              "placement.roles={actor: trainer, rollout: gen}"])


def test_dynamic_sampling_rounds_pad_their_routing_with_their_prompts():
    from hybridflow.trainers.sampling import concat_rounds

    def round_of(prompt_len: int) -> DataProto:
        ids = torch.full((2, prompt_len + 3), 7)
        return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                            "responses": ids[:, -3:],
                                            ROUTED_EXPERTS: torch.ones((2, prompt_len + 3, 2, 2), dtype=torch.int8)})

    joined = concat_rounds([round_of(4), round_of(6)], pad_token_id=0)
    assert joined[ROUTED_EXPERTS].shape == (4, 9, 2, 2)
    assert bool((joined[ROUTED_EXPERTS][:2, :2] == ROUTING_PAD).all())
    assert bool((joined[ROUTED_EXPERTS][:2, 2:] == 1).all()) and bool((joined[ROUTED_EXPERTS][2:] == 1).all())


def test_a_grpo_run_with_routing_replay_trains_a_qwen3_moe_model(tmp_path):
    from hybridflow.cli import main
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows

    model_dir = family_model_dir("qwen3_moe", tmp_path / "model")
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(4, split="train", seed=0, config=ArithmeticTaskConfig()))
    # recompute: the old log-probs come from a replaying forward (auto would take the fp32 rollout's own)
    assert main(["train", f"data.train_path={tmp_path / 'prompts.jsonl'}", f"actor.model.path={model_dir}",
                 "reward.function=arithmetic", "algorithm.advantage_estimator=grpo", "actor.routing_replay=true",
                 "actor.loss.old_log_probs=recompute", "actor.engine.dtype=float32",  # fp32 on a GPU too
                 "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2", "batch.samples_per_prompt=2",
                 "batch.mini_batch_size=4", "trainer.total_steps=1", "trainer.progress_bar=false",
                 "trainer.tensorboard=false", f"trainer.output_dir={tmp_path / 'grpo'}", "--local"]) == 0
    step = json.loads((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()[-1])
    # an fp32 rollout rescored in fp32 under its own routing: the recomputed old log-probs are the sampler's
    assert step["perf/old_log_prob_from_rollout"] == 0.0
    assert step["rollout/logprob_abs_diff_max"] < 1e-5
    assert step["actor/routing_replay_overridden"] == 0.0  # the update replayed: routing the same in fp32 here
    assert (tmp_path / "grpo" / "final" / "actor" / "config.json").exists()
