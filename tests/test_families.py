"""The newer decoder families (Qwen3, Gemma 3) on tiny random models built from transformers' config classes:
packed-training log-probs, greedy generation, export and the multi-rank layouts equal transformers / one process,
and `hybridflow train` (GRPO) and `hybridflow sft` run end to end on a model directory of the family."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
from test_engine_layouts import as_numpy, make_batch, rank_slice, token_nll_loss
from test_generation import assert_greedy_equals_hf
from test_tensor_parallel import _check_reports, _compare_tp_with_single_process
from transformers import AutoModelForCausalLM

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import build_tiny_model
from hybridflow.parallel.launch import run_distributed

FAMILIES = {
    "qwen3": {},
    "qwen3_moe": {"mlp_only_layers": [1]},  # a dense layer among the mixture-of-experts ones
    "gemma3_text": {"final_logit_softcapping": 30.0},  # sliding (window 4) and full layers alternate
}
"""Family -> tiny-config overrides that exercise what is particular to it."""
OPTIM = OptimConfig(lr=1e-3, eps=1e-4)
# Top-k routing is discontinuous: once two layouts' weights differ by float rounding (after one step, ~1e-6), a
# token whose two best experts score alike can pick another expert in one of them (measured: the second step's loss
# of tp2 differs by 1.4e-5 relative while the weights after the first step agree to 1.4e-6). The MoE family is
# compared over one step, where both runs route every token alike.
TRAIN_STEPS = {"qwen3_moe": 1}
WORLD2_LAYOUTS = {"fsdp2": dict(layout="fsdp"), "tp2": dict(layout="3d", tp_size=2),
                  "pp2": dict(layout="3d", pp_size=2)}


def tiny(family: str, **overrides) -> torch.nn.Module:
    """A tiny random model of ``family``; a wide initialisation so that logits (and greedy tokens) differ."""
    return build_tiny_model(family, seed=3, initializer_range=0.2, **{**FAMILIES[family], **overrides})


def reference_logprobs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """log p(response token) from a plain transformers forward of the left-padded batch, [B, T]."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    num_response = batch["responses"].shape[1]
    logprobs_BTV = torch.log_softmax(logits[:, -num_response - 1:-1].float(), -1)
    return logprobs_BTV.gather(-1, batch["responses"][..., None])[..., 0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_training_logprobs_equal_a_transformers_forward(family):
    model = tiny(family)
    batch = make_batch()
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, dtype="float32"), lambda: copy.deepcopy(model))
    logprobs_BT = engine.forward(batch)["logprobs"]
    mask_BT = batch["response_mask"].bool()
    assert engine.last_batch_stats["micro_batches"] > 1  # several packed sequences per micro-batch, several packs
    torch.testing.assert_close(logprobs_BT[mask_BT], reference_logprobs(model, batch)[mask_BT], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_of_the_native_decoder_equals_transformers_generate(family):
    assert_greedy_equals_hf(tiny(family))


@pytest.mark.parametrize("static_decode", [False, True])  # True: the fixed-shape decode steps CUDA graphs replay
def test_gemma3_sliding_layers_cache_only_their_window_and_generation_past_it_equals_transformers(static_decode):
    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig

    model = tiny("gemma3_text")
    window = model.config.sliding_window
    stage = DecoderStage.from_state_dict(model.config, model.state_dict())
    cache = stage.new_cache(batch=3, max_len=40)
    sliding = [i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]
    assert sliding and len(sliding) < model.config.num_hidden_layers
    for slot, keys in enumerate(cache.keys):
        assert keys.shape[2] == (window if slot in sliding else 40)
        assert cache.values[slot].shape == keys.shape
    # 7-token prompts and 24 new tokens: every sequence is several windows long
    generator = torch.Generator().manual_seed(4)
    prompts = torch.randint(3, 256, (3, 7), generator=generator)
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0
    engine = GenerationEngine(stage, static_decode=static_decode)
    out = engine.generate(prompts * mask, mask, SamplingConfig(max_new_tokens=24, greedy=True))
    with torch.no_grad():
        expected = model.generate(prompts * mask, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[:, 7:]
    assert torch.equal(out["responses"], expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reloads_with_from_pretrained_and_gives_the_same_logprobs(family, tmp_path):
    model = tiny(family)
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=64, dtype="float32"), lambda: copy.deepcopy(model))
    engine.export_hf(str(tmp_path / "export"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert type(reloaded) is type(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    batch = make_batch()
    # equal weights; the log-probs to fp32 rounding (in a long session Qwen3-MoE's reloaded model may sum its
    # experts in another order than the grouped implementation)
    torch.testing.assert_close(reference_logprobs(reloaded, batch), reference_logprobs(model, batch), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_saved_model_directory_loads_shard_by_shard_onto_the_meta_device_with_the_same_logprobs(family, tmp_path):
    from hybridflow.models.config import ModelConfig

    model = tiny(family)
    model.save_pretrained(str(tmp_path / "model"))  # the hub's layout (Qwen3-MoE: one Linear per expert)
    engine = TrainingEngine.from_model_config(EngineConfig(micro_batch_tokens=64, dtype="float32"),
                                              ModelConfig(path=str(tmp_path / "model")))
    batch = make_batch()
    mask_BT = batch["response_mask"].bool()
    torch.testing.assert_close(engine.forward(batch)["logprobs"][mask_BT], reference_logprobs(model, batch)[mask_BT],
                               rtol=0, atol=1e-5)


def _train_layouts(rank: int, world_size: int, family: str) -> dict:
    """Initial log-probs, two steps' losses and the final weights of each two-rank layout."""
    batch = make_batch()
    results = {}
    for name, layout in WORLD2_LAYOUTS.items():
        engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OPTIM, **layout), lambda: tiny(family))
        logprobs = engine.forward(rank_slice(engine, batch))["logprobs"].numpy()
        losses = [engine.train_step(rank_slice(engine, batch), token_nll_loss)["loss"]
                  for _ in range(TRAIN_STEPS.get(family, 2))]
        results[name] = (logprobs, losses, as_numpy(engine.full_state_dict()))
    return results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fsdp_tp_and_pp_layouts_on_two_ranks_equal_one_process(family):
    batch = make_batch()
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OPTIM), lambda: tiny(family))
    logprobs = engine.forward(batch)["logprobs"].numpy()
    losses = [engine.train_step(batch, token_nll_loss)["loss"] for _ in range(TRAIN_STEPS.get(family, 2))]
    weights = as_numpy(engine.full_state_dict())
    results = run_distributed(_train_layouts, 2, family, timeout_s=500)[0]
    for name, (layout_logprobs, layout_losses, layout_weights) in results.items():
        # rank 0 holds the first rows of the batch in every layout
        np.testing.assert_allclose(layout_logprobs, logprobs[:len(layout_logprobs)], rtol=1e-6, atol=2e-6,
                                   err_msg=name)
        np.testing.assert_allclose(layout_losses, losses, rtol=1e-5, err_msg=name)
        assert set(layout_weights) == set(weights)
        for key, value in weights.items():
            # Adam divides by each element's gradient RMS, so ulp-level gradient differences (another summation
            # order) grow to ~3e-6 in the norm weights after two steps of lr 1e-3; the gradients themselves are
            # checked at 1e-5 relative by the tensor-parallel plan test below
            np.testing.assert_allclose(layout_weights[key], value, rtol=0, atol=1e-5, err_msg=f"{name} {key}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_tensor_parallel_plan_gives_single_process_logits_and_gradients(family):
    cases = [(family, "lm", FAMILIES[family]), (family, "lm", {**FAMILIES[family], "tie_word_embeddings": True})]
    for reports in run_distributed(_compare_tp_with_single_process, 2, cases, timeout_s=480):
        _check_reports(reports)


def family_model_dir(family: str, directory, **overrides) -> str:
    """A Hugging Face directory of a tiny random ``family`` model sized to the built-in task's tokenizer."""
    from hybridflow.data.builtin import ASSETS_DIR

    model = build_tiny_model(family, seed=5, vocab_size=24, **{**FAMILIES[family], **overrides})
    model.save_pretrained(str(directory))
    for path in ASSETS_DIR.iterdir():
        if path.name != "config.json":
            shutil.copy(path, directory / path.name)
    return str(directory)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grpo_train_and_sft_run_end_to_end_from_a_model_directory_of_the_family(family, tmp_path):
    _train_and_sft(family, tmp_path, ["--local"], ["--local"])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_grpo_train_and_sft_run_end_to_end_on_two_fsdp_ranks(ray_session, family, tmp_path):
    # two Ray workers per role: the actor trains under fsdp (dp 2) and generates as two replicas; SFT on two ranks
    _train_and_sft(family, tmp_path, ["placement.pools={all: [2]}"], ["devices=[2]"])


def _train_and_sft(family: str, tmp_path, train_extra: list[str], sft_extra: list[str]) -> None:
    """`hybridflow train` (GRPO, two steps) and `hybridflow sft` (two steps) from a model directory of ``family``:
    both exit 0, the exported actor is of the family, SFT changed the weights."""
    from hybridflow.cli import main
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows, sft_rows

    task = ArithmeticTaskConfig(max_digits=1)
    model_dir = family_model_dir(family, tmp_path / "model")
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(8, split="train", seed=0, config=task))
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(8, split="train", seed=0, config=task))
    assert main(["train", f"data.train_path={tmp_path / 'prompts.jsonl'}", f"actor.model.path={model_dir}",
                 "reward.function=arithmetic", "algorithm.advantage_estimator=grpo",
                 "actor.generation.max_new_tokens=3",
                 "batch.prompts_per_step=2", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
                 "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.tensorboard=false",
                 f"trainer.output_dir={tmp_path / 'grpo'}", *train_extra]) == 0
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "grpo" / "final" / "actor"))
    assert trained.config.model_type == family
    assert main(["sft", f"data.train_path={tmp_path / 'sft.jsonl'}", f"model.path={model_dir}", "batch_size=4",
                 "max_steps=2", "progress_bar=false", f"output_dir={tmp_path / 'sft'}", *sft_extra]) == 0
    tuned = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sft" / "model"))
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    changed = [name for name, tensor in initial.state_dict().items()
               if not torch.equal(tuned.state_dict()[name], tensor)]
    assert type(tuned) is type(initial) and "model.layers.0.self_attn.q_proj.weight" in changed


def test_a_scalar_head_on_gemma3_is_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match=r"head 'value' .* transformers does not have for 'gemma3_text' .*; "
                                         r"allowed: head 'lm'"):
        build_tiny_model("gemma3_text", head="value")
    assert type(build_tiny_model("qwen3_moe", head="value")).__name__ == "Qwen3MoeForTokenClassification"


@pytest.mark.parametrize("family, overrides", [("qwen3", {"head_dim": 32}), ("qwen3_moe", {"mlp_only_layers": []})])
def test_the_planners_model_spec_counts_the_parameters_of_a_saved_model_of_the_family(family, overrides, tmp_path):
    from hybridflow.mapping.model_spec import model_spec

    model = build_tiny_model(family, **{**FAMILIES[family], **overrides})
    model.config.save_pretrained(str(tmp_path))
    spec = model_spec(str(tmp_path))
    assert spec.head_dim == model.config.head_dim
    # the per-head q/k norms (2 * head_dim per layer) are the only weights the spec leaves out
    norms = 2 * model.config.head_dim * model.config.num_hidden_layers
    assert spec.num_params() + norms == sum(p.numel() for p in model.parameters())


def test_the_router_balancing_loss_equals_transformers_aux_loss_and_joins_the_training_loss_with_its_coefficient():
    from hybridflow.models.moe import RouterLogitsRecorder

    model = tiny("qwen3_moe").train()
    recorder = RouterLogitsRecorder(model)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids, output_router_logits=True).aux_loss
    torch.testing.assert_close(recorder.balancing_loss(12), expected, rtol=1e-6, atol=0)

    batch = make_batch()
    steps = {}
    for coef in (0.0, 0.5):  # one micro-batch: the loss is the NLL plus coef times its balancing loss
        engine = TrainingEngine(EngineConfig(micro_batch_tokens=1024, optim=OPTIM, router_aux_loss_coef=coef),
                                lambda: tiny("qwen3_moe"))
        steps[coef] = (engine.train_step(batch, token_nll_loss), as_numpy(engine.full_state_dict()))
    with_aux, without = steps[0.5][0], steps[0.0][0]
    assert "router_aux_loss" not in without and with_aux["router_aux_loss"] > 0.9  # 1 when perfectly balanced
    assert with_aux["loss"] == pytest.approx(without["loss"] + 0.5 * with_aux["router_aux_loss"], rel=1e-6)
    router = "model.layers.0.mlp.gate.weight"
    assert not np.allclose(steps[0.5][1][router], steps[0.0][1][router], rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.5 needs a mixture-of-experts model under pp_size 1"):
        TrainingEngine(EngineConfig(router_aux_loss_coef=0.5), lambda: tiny("qwen3"))


def test_moe_experts_with_static_shapes_equal_the_largest_group_layout():
    from hybridflow.models.moe import grouped_experts

    generator = torch.Generator().manual_seed(0)
    T, H, I, E, K = 7, 8, 4, 5, 2
    hidden_TH = torch.randn(T, H, generator=generator)
    gate_up_E2IH, down_EHI = torch.randn(E, 2 * I, H, generator=generator), torch.randn(E, H, I, generator=generator)
    experts_TK = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    weights_TK = torch.rand(T, K, generator=generator)
    grouped_TH = grouped_experts(hidden_TH, experts_TK, weights_TK, gate_up_E2IH, down_EHI, torch.nn.functional.silu)
    static_TH = grouped_experts(hidden_TH, experts_TK, weights_TK, gate_up_E2IH, down_EHI, torch.nn.functional.silu,
                                static_shapes=True)  # capacity T: what the CUDA-graphed decode steps run
    torch.testing.assert_close(static_TH, grouped_TH, rtol=1e-5, atol=1e-5)  # other matmul shapes: rounding only


def test_the_moe_fixed_shape_decode_that_cuda_graphs_replay_equals_the_compacting_decode():
    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig

    model = tiny("qwen3_moe")
    stage = DecoderStage.from_state_dict(model.config, model.state_dict())
    prompts_BP = torch.randint(3, model.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    greedy = SamplingConfig(max_new_tokens=8, greedy=True)
    outputs = [GenerationEngine(stage, static_decode=static, cuda_graphs=False).generate(
        prompts_BP, torch.ones_like(prompts_BP), greedy) for static in (False, True)]
    assert torch.equal(outputs[1]["responses"], outputs[0]["responses"])
    torch.testing.assert_close(outputs[1]["logprobs"], outputs[0]["logprobs"], rtol=0, atol=1e-5)
