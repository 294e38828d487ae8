"""Routing replay (R3) on the vLLM backend, tiny random Qwen3-MoE (a dense layer among the MoE ones): the experts
vLLM's routers chose for a greedy fp32 rollout equal the native decoder's recording in layout and expert sets (prompt
tokens the prefix cache served included), and a GRPO run with ``actor.routing_replay`` trains on vLLM's routing
(skipped where vLLM is not installed; one vLLM engine per test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from test_families import family_model_dir  # noqa: E402
from test_families_vllm import TOKENIZER, VLLM_FAMILIES  # noqa: E402

from hybridflow.controller.local import init_local_process_group  # noqa: E402
from hybridflow.engine import EngineConfig, OptimConfig  # noqa: E402
from hybridflow.engine.generation import GenerationConfig  # noqa: E402
from hybridflow.engine.generation_config import GenerationTokens  # noqa: E402
from hybridflow.models.config import ModelConfig  # noqa: E402
from hybridflow.models.moe import ROUTED_EXPERTS, ROUTING_PAD  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.trainers.build import model_config_of  # noqa: E402
from hybridflow.workers import ActorSpec, ActorWorker, EngineSpec  # noqa: E402

# three layers, the middle one dense: routed_experts holds the two MoE layers; eight experts, two per token
MOE = {**VLLM_FAMILIES["qwen3_moe"], "num_hidden_layers": 3, "mlp_only_layers": [1], "initializer_range": 0.2}


def _routing_actor(model_dir: str, backend: str) -> ActorWorker:
    engine = EngineSpec(model=model_config_of(ModelConfig(path=model_dir)), head="lm", seed=0,
                        engine=EngineConfig(dtype="float32", optim=OptimConfig(lr=1e-2)))
    generation = GenerationConfig(backend=backend, max_new_tokens=6, greedy=True, vllm_kv_cache_gib=0.0625)
    tokens = GenerationTokens(eos_token_ids=(TOKENIZER.eos_token_id,), pad_token_id=TOKENIZER.pad_token_id)
    return ActorWorker(ActorSpec(engine=engine, generation=generation, tokens=tokens, routing_replay=True))


def _long_prompts(vocab_size: int) -> DataProto:
    """Three left-padded prompts longer than vLLM's 128-token KV block, sharing their first 130 tokens (a system
    prompt): the prefix cache serves the shared block, and each prompt's second sample."""
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab_size, (130,), generator=generator)
    lengths = (150, 141, 160)
    ids_BP = torch.full((3, max(lengths)), TOKENIZER.pad_token_id)
    mask_BP = torch.zeros_like(ids_BP)
    for row, length in enumerate(lengths):
        suffix = torch.randint(3, vocab_size, (length - 130,), generator=generator)
        ids_BP[row, -length:] = torch.cat([shared, suffix])
        mask_BP[row, -length:] = 1
    return DataProto.from_dict(tensors={"input_ids": ids_BP, "attention_mask": mask_BP},
                               meta_info={"samples_per_prompt": 2})


@pytest.mark.slow
def test_vllm_records_the_same_experts_as_the_native_decoder_for_a_greedy_fp32_rollout(tmp_path):
    init_local_process_group()
    model_dir = family_model_dir("qwen3_moe", tmp_path / "model", **MOE)
    prompts = _long_prompts(24)  # family_model_dir sizes the vocabulary to the built-in tokenizer
    native, vllm = _routing_actor(model_dir, "native"), _routing_actor(model_dir, "vllm")
    expected, got = native.generate_sequences(prompts), vllm.generate_sequences(prompts)
    assert torch.equal(expected.batch["responses"], got.batch["responses"])
    expected_BSLK, got_BSLK = expected.batch[ROUTED_EXPERTS], got.batch[ROUTED_EXPERTS]
    assert got_BSLK.shape == expected_BSLK.shape == (6, 160 + 6, 2, 2)
    assert got_BSLK.dtype == expected_BSLK.dtype == torch.int8
    # the same tokens recorded (the native decoder leaves padding and each response's last token -1) ...
    assert torch.equal(got_BSLK[..., 0] == ROUTING_PAD, expected_BSLK[..., 0] == ROUTING_PAD)
    assert int((got_BSLK[..., 0] != ROUTING_PAD).sum()) >= 6 * 141
    # ... with the same experts: vLLM's CPU router returns its top-k unsorted, so compare the sets
    assert torch.equal(got_BSLK.sort(-1).values, expected_BSLK.sort(-1).values)
    # the prefix cache served whole blocks of prompts, whose routing came from the requests that computed them
    assert vllm.rollout._routing.cached_tokens >= 128
    # a call that does not record returns no routing
    plain = dataclasses.replace(vllm._call_config({}), record_routing=False)
    output, _ = vllm._offloaded_rollout(prompts, plain, lambda rollout: rollout.generate(
        prompts["input_ids"], prompts["attention_mask"], plain))
    assert ROUTED_EXPERTS not in output


@pytest.mark.slow
def test_two_grpo_steps_with_routing_replay_on_vllm_train_with_the_routing_vllm_recorded(tmp_path):
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import run_rl

    model_dir = family_model_dir("qwen3_moe", tmp_path / "model", **MOE)
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0,
                                                      config=ArithmeticTaskConfig(max_digits=1)))
    # recompute: the old log-probs come from a replaying forward (auto would take the fp32 rollout's own)
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", f"actor.model.path={model_dir}", "actor.routing_replay=true",
        "actor.loss.old_log_probs=recompute", "reward.function=arithmetic", "algorithm.advantage_estimator=grpo",
        "actor.generation.max_new_tokens=4", "actor.generation.backend=vllm",
        "actor.generation.vllm_kv_cache_gib=0.0625", "batch.prompts_per_step=2", "batch.samples_per_prompt=2",
        "batch.mini_batch_size=4", "trainer.total_steps=2", "trainer.progress_bar=false",
        f"trainer.output_dir={tmp_path / 'run'}"])
    history = run_rl(config, mode="local", tensorboard=False)
    assert len(history) == 2
    for step in history:
        assert step["rollout/vllm_bytes_loaded"] > 0
        assert step["rollout/logprob_abs_diff_max"] < 1e-4
        # vLLM's fp32 routing is the training forward's but for near-ties its kernels break the other way
        assert 0.0 <= step["actor/routing_replay_overridden"] < 0.05
