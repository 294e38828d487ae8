"""A LoRA actor on the vLLM rollout of the newer families (``actor.lora.vllm_sync: adapter``): vLLM applies the
adapter itself as a LoRA request on the base weights it loaded once, and its greedy tokens and log-probs equal the
native decoder's on the merged weights after training steps that move the adapter; each later sync moves only the
adapter's bytes; the merged sync (``vllm_sync: merged``) too. Skipped where vLLM is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from test_families import family_model_dir  # noqa: E402
from test_families_vllm import TOKENIZER, VLLM_FAMILIES  # noqa: E402
from test_trainer import data_dir  # noqa: E402, F401 (the built-in task's prompt files, a fixture)

from hybridflow.controller.local import init_local_process_group  # noqa: E402
from hybridflow.data import PromptDataset  # noqa: E402
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows  # noqa: E402
from hybridflow.engine import EngineConfig, OptimConfig  # noqa: E402
from hybridflow.engine.generation import GenerationConfig  # noqa: E402
from hybridflow.engine.generation_config import GenerationTokens  # noqa: E402
from hybridflow.models.config import ModelConfig  # noqa: E402
from hybridflow.models.lora_config import LoraConfig  # noqa: E402
from hybridflow.trainers.build import model_config_of  # noqa: E402
from hybridflow.workers import ActorSpec, ActorWorker, EngineSpec  # noqa: E402
from hybridflow.workers.actor import next_token_loss_fn  # noqa: E402
from hybridflow.workers.base import SEQUENCE_KEYS, tensors_of  # noqa: E402


def _actor(model: ModelConfig, backend: str, lora: LoraConfig) -> ActorWorker:
    engine = EngineSpec(model=model_config_of(model), head="lm", seed=0, lora=lora,
                        engine=EngineConfig(dtype="float32", optim=OptimConfig(lr=1e-2)))
    generation = GenerationConfig(backend=backend, max_new_tokens=6, greedy=True, vllm_kv_cache_gib=0.0625)
    tokens = GenerationTokens(eos_token_ids=(TOKENIZER.eos_token_id,), pad_token_id=TOKENIZER.pad_token_id)
    return ActorWorker(ActorSpec(engine=engine, generation=generation, tokens=tokens))


def _prompts(count: int):
    rows = prompt_rows(count, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=2))
    return PromptDataset(rows, TOKENIZER, max_prompt_tokens=16).batch(range(count))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "vllm_sync"), [("llama", "adapter"), ("llama", "merged"), ("qwen3", "adapter"),
                                                   ("gemma3_text", "adapter")])
def test_vllm_generates_a_lora_actor_as_the_native_decoder_with_merged_weights_after_each_sync(family, vllm_sync,
                                                                                             tmp_path):
    """Two training steps, each followed by a rollout on both backends: vLLM with the adapter as a LoRA request
    (``adapter``: the base weights once, then only A and B) or with the merged weights, against the native decoder
    on the merged shard. Llama is the built-in task's model."""
    init_local_process_group()
    model = (ModelConfig(builtin="arithmetic") if family == "llama"
             else ModelConfig(path=family_model_dir(family, tmp_path / family, **VLLM_FAMILIES[family])))
    lora = LoraConfig(rank=4, alpha=8.0, vllm_sync=vllm_sync)  # every projection of attention and MLP
    native, vllm = _actor(model, "native", lora), _actor(model, "vllm", lora)
    assert vllm.syncs_adapter == (vllm_sync == "adapter") and not native.syncs_adapter
    prompts = _prompts(6)
    batch = tensors_of(native.generate_sequences(prompts), SEQUENCE_KEYS)
    generated = []
    for sync in range(2):
        for actor in (native, vllm):  # the same next-token step on both: B moves (from 0 at first), identically
            actor.engine.train_step(batch, next_token_loss_fn(1.0), outputs=("logprobs",))
        expected, got = native.generate_sequences(prompts), vllm.generate_sequences(prompts)
        assert torch.equal(expected.batch["responses"], got.batch["responses"]), sync
        mask_BT = got.batch["response_mask"].bool()
        torch.testing.assert_close(got.batch["logprobs"][mask_BT], expected.batch["logprobs"][mask_BT],
                                   rtol=1e-4, atol=1e-4)
        generated.append(got.batch["logprobs"])
        stats = vllm.transition_stats()
        merged, adapter = stats["lora_sync_bytes_merged"], stats["lora_sync_bytes_adapter"]
        assert merged > 10 * adapter > 0
        if vllm_sync == "merged":
            assert stats["vllm_bytes_loaded"] == merged
        elif sync == 0:  # the base weights (as many bytes as the merged ones) and the adapter
            assert stats["vllm_bytes_loaded"] == merged + adapter
        else:  # no transition, no gather: only A and B went to vLLM
            assert stats["vllm_bytes_loaded"] == adapter and stats["bytes_received"] == 0
    assert not torch.equal(generated[0], generated[1])  # the second sync reached vLLM


@pytest.mark.slow
def test_grpo_with_a_lora_actor_on_vllm_syncs_only_the_adapter_after_the_first_step(data_dir, tmp_path):
    from test_lora import _grpo_config

    from hybridflow.trainers.rl import run_rl

    config = _grpo_config(data_dir, tmp_path / "run", "actor.generation.backend=vllm",
                          "actor.generation.vllm_kv_cache_gib=0.0625", "trainer.total_steps=2",
                          "actor.loss.old_log_probs=recompute")  # the forward the mismatch is measured against
    assert config.actor.lora.vllm_sync == "adapter"
    history = run_rl(config, mode="local", tensorboard=False)
    assert len(history) == 2
    first, second = history
    assert first["rollout/vllm_bytes_loaded"] == (first["rollout/lora_sync_bytes_merged"]
                                                  + first["rollout/lora_sync_bytes_adapter"])
    assert second["rollout/vllm_bytes_loaded"] == second["rollout/lora_sync_bytes_adapter"] > 0
    assert second["rollout/bytes_received"] == 0 and second["time/rollout_weight_sync_s"] > 0
    for step in history:  # fp32 on both sides: vLLM's LoRA log-probs are the training engine's to rounding
        assert step["rollout/logprob_abs_diff_max"] < 1e-4


def test_a_mixture_of_experts_lora_actor_on_vllm_is_refused_naming_the_merged_sync(tmp_path):
    """vLLM's LoRA swaps the fused-MoE experts for its Triton kernels (absent on CPU): refused before an engine is
    built, so vLLM's process-wide groups stay as they were."""
    init_local_process_group()
    model_dir = family_model_dir("qwen3_moe", tmp_path / "moe", **VLLM_FAMILIES["qwen3_moe"])
    vllm = _actor(ModelConfig(path=model_dir), "vllm", LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match=r"vllm_sync='adapter' on a mixture-of-experts model.*vllm_sync=merged"):
        vllm.generate_sequences(_prompts(2))


def test_a_lora_target_vllm_cannot_adapt_is_refused_naming_the_merged_sync():
    from hybridflow.engine.vllm_lora import check_lora_targets

    names = [f"model.layers.0.{module}.{factor}.weight" for module in ("self_attn.q_proj", "mlp.gate")
             for factor in ("lora_A", "lora_B")]
    check_lora_targets(names[:2], {"q_proj", "k_proj"})
    with pytest.raises(ValueError, match=r"adapts \['gate'\], which vLLM's LoRA cannot carry.*vllm_sync=merged"):
        check_lora_targets(names, {"q_proj", "k_proj"})


def _lora_rollouts_under_tp2(rank: int, world_size: int) -> dict:
    """A tp = 2 LoRA actor on both backends (vLLM tg = 2, adapter sync), two training steps each followed by a
    rollout of common prompts: the outputs and vLLM's sync stats on this rank."""
    from hybridflow.controller.worker import WorkerContext, set_worker_context
    from hybridflow.engine.hybrid_engine_config import HybridEngineConfig

    set_worker_context(WorkerContext(rank=rank, world_size=world_size, local_rank=rank, node_id="local"))
    lora = LoraConfig(rank=4, alpha=8.0)

    def actor(backend: str) -> ActorWorker:
        engine = EngineSpec(model=model_config_of(ModelConfig(builtin="arithmetic")), head="lm", seed=0, lora=lora,
                            engine=EngineConfig(dtype="float32", layout="3d", tp_size=2, optim=OptimConfig(lr=1e-2)))
        generation = GenerationConfig(backend=backend, max_new_tokens=6, greedy=True, vllm_kv_cache_gib=0.0625)
        tokens = GenerationTokens(eos_token_ids=(TOKENIZER.eos_token_id,), pad_token_id=TOKENIZER.pad_token_id)
        return ActorWorker(ActorSpec(engine=engine, hybrid_engine=HybridEngineConfig(tp_size=2),
                                     generation=generation, tokens=tokens))

    native, vllm = actor("native"), actor("vllm")
    prompts = _prompts(4)
    batch = tensors_of(native.generate_sequences(prompts), SEQUENCE_KEYS)
    syncs = []
    for _ in range(2):
        for worker in (native, vllm):
            worker.engine.train_step(batch, next_token_loss_fn(1.0), outputs=("logprobs",))
        expected, got = native.generate_sequences(prompts), vllm.generate_sequences(prompts)
        syncs.append({"expected": {key: expected.batch[key] for key in ("responses", "logprobs", "response_mask")},
                      "got": {key: got.batch[key] for key in ("responses", "logprobs")},
                      "stats": vllm.transition_stats()})
    return syncs


@pytest.mark.slow
def test_vllm_tg2_applies_the_whole_adapter_each_rank_slicing_it_as_the_native_engine_merges_its_shard():
    """t = tg = 2: each rank's vLLM engine takes the whole adapter (gathered from the DTensor shards) and slices it
    for its TP rank; generation equals the native decoder's on the merged tensor-parallel shards."""
    from hybridflow.parallel.launch import run_distributed

    results = run_distributed(_lora_rollouts_under_tp2, 2, timeout_s=900)
    for rank, syncs in enumerate(results):
        for index, sync in enumerate(syncs):
            expected, got, stats = sync["expected"], sync["got"], sync["stats"]
            assert torch.equal(expected["responses"], got["responses"]), (rank, index)
            mask_BT = expected["response_mask"].bool()
            torch.testing.assert_close(got["logprobs"][mask_BT], expected["logprobs"][mask_BT], rtol=1e-4, atol=1e-4)
        # the whole adapter in fp32 on every rank after the first sync: nothing else moved
        assert syncs[1]["stats"]["vllm_bytes_loaded"] == syncs[1]["stats"]["lora_sync_bytes_adapter"] > 0
        assert syncs[1]["stats"]["bytes_received"] == 0


def test_vllms_lora_slots_take_the_smallest_rank_it_offers_that_holds_the_adapter():
    from hybridflow.engine.vllm_lora import vllm_lora_options
    from hybridflow.models import build_tiny_model

    hf_config = build_tiny_model().config
    assert vllm_lora_options(LoraConfig(rank=4), hf_config) == {"enable_lora": True, "max_lora_rank": 8,
                                                               "max_loras": 1, "max_cpu_loras": 1}
    assert vllm_lora_options(LoraConfig(rank=16), hf_config)["max_lora_rank"] == 16
    with pytest.raises(ValueError, match=r"lora.rank=600: vLLM's LoRA supports ranks up to 512.*vllm_sync=merged"):
        vllm_lora_options(LoraConfig(rank=600), hf_config)
