"""The vLLM backend's parts that need no vLLM: the config field, the weight plan, stop sequences, the
log-prob mismatch metrics; they run in every environment."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hybridflow.algorithms import rollout_logprob_mismatch
from hybridflow.engine.generation_config import GenerationConfig
from hybridflow.engine.hybrid_engine import parameter_shapes
from hybridflow.engine.vllm_rollout import (check_supported, check_tp_groups, copy_pieces, cut_at_stop_sequence,
                                           max_model_len, pad_intermediate, vllm_parameter_plan)
from hybridflow.models.tiny import tiny_config


def test_backend_defaults_to_native_and_an_unknown_backend_names_the_field():
    assert GenerationConfig().backend == "native"
    with pytest.raises(ValueError, match=r"actor\.generation\.backend must be one of \('native', 'vllm'\), got 'sglang'"):
        GenerationConfig(backend="sglang")
    with pytest.raises(ValueError, match="vllm_kv_cache_gib must be a number > 0, got 0"):
        GenerationConfig(vllm_kv_cache_gib=0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_backend_vllm_without_vllm_installed_says_how_to_install_it():
    with pytest.raises(ValueError, match=r"backend='vllm' needs vllm, which is not installed here: pip install"):
        GenerationConfig(backend="vllm")


def test_vllm_plan_stacks_qkv_and_gate_up_rows_in_order_and_ties_the_head_to_the_embedding():
    config = tiny_config("qwen2", num_hidden_layers=1, tie_word_embeddings=True)
    shapes = parameter_shapes(config)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
             "model.layers.0.self_attn.qkv_proj.bias", "model.layers.0.mlp.gate_up_proj.weight",
             "model.layers.0.self_attn.o_proj.weight", "lm_head.weight"]
    plan = vllm_parameter_plan(shapes, names, tie_word_embeddings=True)
    q, kv = 64, 2 * 16  # 4 query heads and 2 kv heads of 16 dims
    assert [(s.hf_name, s.offset, s.rows) for s in plan["model.layers.0.self_attn.qkv_proj.bias"]] == [
        ("model.layers.0.self_attn.q_proj.bias", 0, q), ("model.layers.0.self_attn.k_proj.bias", q, kv),
        ("model.layers.0.self_attn.v_proj.bias", q + kv, kv)]
    assert [(s.hf_name, s.offset) for s in plan["model.layers.0.mlp.gate_up_proj.weight"]] == [
        ("model.layers.0.mlp.gate_proj.weight", 0), ("model.layers.0.mlp.up_proj.weight", 128)]
    assert [s.hf_name for s in plan["lm_head.weight"]] == ["model.embed_tokens.weight"]
    assert [s.hf_name for s in plan["model.layers.0.self_attn.o_proj.weight"]] == ["model.layers.0.self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match=r"block_sparse_moe.gate.weight.* the vLLM backend loads the families whose "
                                         r"weights it maps to vLLM's \(tested: .*qwen3_moe, gemma3_text\)"):
        vllm_parameter_plan(shapes, ["model.layers.0.block_sparse_moe.gate.weight"], tie_word_embeddings=True)


def test_vllm_plan_under_tensor_parallelism_stacks_each_parts_shard_and_keeps_row_parallel_rows_whole():
    config = tiny_config("qwen2", num_hidden_layers=1, tie_word_embeddings=True)
    shapes = parameter_shapes(config)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
             "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.input_layernorm.weight"]
    plan = vllm_parameter_plan(shapes, names, tie_word_embeddings=True, tp_size=2)
    q, kv = 64 // 2, 2 * 16 // 2  # this rank's 2 query heads and 1 kv head of 16 dims
    assert [(s.offset, s.rows) for s in plan["model.layers.0.self_attn.qkv_proj.weight"]] == [
        (0, q), (q, kv), (q + kv, kv)]
    assert [(s.offset, s.rows) for s in plan["model.layers.0.mlp.gate_up_proj.weight"]] == [(0, 64), (64, 64)]
    assert [s.rows for s in plan["model.embed_tokens.weight"]] == [256 // 2]
    assert [s.rows for s in plan["model.layers.0.self_attn.o_proj.weight"]] == [64]  # split along dim 1
    assert [s.rows for s in plan["model.layers.0.input_layernorm.weight"]] == [64]


def test_vllm_plan_fills_the_fused_moe_weights_with_the_stacked_experts_and_the_router_and_dense_layer_by_name():
    config = tiny_config("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    shapes = parameter_shapes(config)
    # vLLM 0.32 names them under its MoE runner's routed experts
    names = ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.routed_experts.w13_weight",
             "model.layers.0.mlp.experts.routed_experts.w2_weight", "model.layers.1.mlp.gate_up_proj.weight"]
    plan = vllm_parameter_plan(shapes, names, tie_word_embeddings=False)
    experts = 8  # the whole stack [E, ...]: vLLM's w13 is [E, 2I, H] gate rows then up rows, as transformers'
    assert [(s.hf_name, s.offset, s.rows) for s in plan["model.layers.0.mlp.experts.routed_experts.w13_weight"]] == [
        ("model.layers.0.mlp.experts.gate_up_proj", 0, experts)]
    assert [s.hf_name for s in plan["model.layers.0.mlp.experts.routed_experts.w2_weight"]] == [
        "model.layers.0.mlp.experts.down_proj"]
    assert [s.hf_name for s in plan["model.layers.0.mlp.gate.weight"]] == ["model.layers.0.mlp.gate.weight"]
    assert [s.hf_name for s in plan["model.layers.1.mlp.gate_up_proj.weight"]] == [
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (experts, 2 * 32, 64)


def test_expert_weights_are_padded_to_the_kernels_intermediate_size_with_gate_and_up_halves_padded_apart():
    gate_up = torch.arange(1.0, 1 + 2 * 4 * 3).view(2, 4, 3)  # 2 experts, I = 2, H = 3
    padded = pad_intermediate(gate_up, torch.Size((2, 8, 3)), "w13_weight")  # P = 4
    assert torch.equal(padded[:, :2], gate_up[:, :2]) and torch.equal(padded[:, 4:6], gate_up[:, 2:])
    assert not padded[:, 2:4].any() and not padded[:, 6:].any()
    down = torch.arange(1.0, 1 + 2 * 3 * 2).view(2, 3, 2)
    padded = pad_intermediate(down, torch.Size((2, 3, 4)), "w2_weight")
    assert torch.equal(padded[..., :2], down) and not padded[..., 2:].any()
    assert pad_intermediate(down, down.shape, "w2_weight") is down


def test_vllm_tensor_parallel_generation_of_a_mixture_of_experts_model_needs_tg_to_divide_the_experts_width():
    # vLLM splits every expert's intermediate rows over its TP ranks: tg must divide moe_intermediate_size
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's moe_intermediate_size 30"):
        check_tp_groups([[0, 1, 2, 3]], tiny_config("qwen3_moe", num_key_value_heads=4, moe_intermediate_size=30))
    # a width tg divides passes the model's checks (then fails on this one-rank world, not on the experts)
    with pytest.raises(ValueError, match=r"must cover every rank of the torch.distributed world"):
        check_tp_groups([[0, 1]], tiny_config("qwen3_moe"))
    assert check_tp_groups([[0]], tiny_config("qwen3_moe", moe_intermediate_size=30)) == 1


def test_vllm_tp_groups_must_be_equal_and_divide_the_heads_and_vocabulary():
    config = tiny_config("llama")  # 4 heads, 2 kv heads, vocab 256
    assert check_tp_groups([[0], [1]], config) == 1
    with pytest.raises(ValueError, match=r"tp_groups must all have one size, got sizes \[1, 2\]"):
        check_tp_groups([[0, 2], [1]], config)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's num_key_value_heads 2"):
        check_tp_groups([[0, 1, 2, 3]], config)
    with pytest.raises(ValueError, match=r"must cover every rank of the torch.distributed world \(0..0\)"):
        check_tp_groups([[0, 1]], config)  # this process's world has one rank (or none)


def test_each_tp_rank_holds_its_share_of_the_kv_heads_so_a_longer_sequence_fits_its_kv_cache():
    config = tiny_config("llama", hidden_size=128, max_position_embeddings=1 << 20)
    one, two = (max_model_len(config, torch.float32, 0.0625, tp_size=size) for size in (1, 2))
    assert one == 0.0625 * 2**30 * 0.9 // (2 * 4 * 2 * 32 * 4) // 128 * 128 and two > one  # K and V, 4 layers, 2 kv heads


def test_pieces_of_a_generation_shard_are_copied_side_by_side_along_their_tensor_parallel_dim():
    full = torch.arange(24.0).view(4, 6)
    target = torch.zeros(4, 6)
    copied = copy_pieces(target, "model.layers.0.self_attn.o_proj.weight", list(full.chunk(2, dim=1)))
    assert torch.equal(target, full) and copied == 24 * 4
    target = torch.zeros(4, 6)
    copy_pieces(target, "model.layers.0.mlp.up_proj.weight", list(full.chunk(2, dim=0)))
    assert torch.equal(target, full)


def test_a_response_is_cut_after_its_first_completed_stop_sequence():
    assert cut_at_stop_sequence([5, 7, 8, 7, 8], [(7, 8)]) == 3
    assert cut_at_stop_sequence([5, 7, 9, 1], [(7, 8), (9,)]) == 3
    assert cut_at_stop_sequence([5, 7], [(7, 8)]) == 2


def test_the_tiny_default_model_is_refused_by_vllms_cpu_attention_with_its_head_size():
    if torch.cuda.is_available():
        pytest.skip("the head-size limit is the CPU build's")
    with pytest.raises(ValueError, match=r"head_dim is 16 \(hidden_size 64 / 4 heads\)"):
        check_supported(tiny_config("llama"))
    check_supported(tiny_config("llama", hidden_size=128))  # head_dim 32: supported
    with pytest.raises(ValueError, match=r"CPU mixture-of-experts kernel needs a hidden_size that is a multiple of "
                                         r"32; this qwen3_moe model's is 112"):
        check_supported(tiny_config("qwen3_moe", hidden_size=112, head_dim=32))
    check_supported(tiny_config("qwen3_moe", hidden_size=128, head_dim=32))


def test_logprob_mismatch_reports_mean_and_max_abs_difference_and_sequence_kl_on_real_tokens():
    old_BT = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    rollout_BT = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -0.25, 0.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 0]])
    mismatch = rollout_logprob_mismatch(old_BT, rollout_BT, mask_BT)
    assert mismatch.mean_abs_diff.item() == pytest.approx((0.5 + 0 + 0 + 0.25) / 4)
    assert mismatch.max_abs_diff.item() == pytest.approx(0.5)  # the padded -9 is not counted

    def k3(d):
        return torch.exp(torch.tensor(d)) - d - 1

    expected = (k3(0.5) + k3(-0.25)) / 2  # log(old / rollout) per real token, summed per sequence
    assert mismatch.sequence_kl.item() == pytest.approx(expected.item(), rel=1e-6)
    same = rollout_logprob_mismatch(old_BT, old_BT, mask_BT)
    assert same.max_abs_diff.item() == 0 and same.sequence_kl.item() == 0
