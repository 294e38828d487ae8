"""The vLLM rollout backend on tiny random models of the newer families: Qwen3 (q/k head norms), Qwen3-MoE (vLLM's
fused-MoE experts, a dense layer among them) and Gemma 3 (sliding-window and full layers, the embedding scale, tied
embeddings, q/k norms, the final logit soft-cap): greedy tokens and log-probs equal the native decoder's, before and
after a training step (skipped where vLLM is not installed; one vLLM engine start per family)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from test_families import family_model_dir  # noqa: E402

from hybridflow.controller.local import init_local_process_group  # noqa: E402
from hybridflow.data import PromptDataset  # noqa: E402
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows  # noqa: E402
from hybridflow.engine import EngineConfig, OptimConfig  # noqa: E402
from hybridflow.engine.generation import GenerationConfig  # noqa: E402
from hybridflow.engine.generation_config import GenerationTokens  # noqa: E402
from hybridflow.models.config import ModelConfig  # noqa: E402
from hybridflow.trainers.build import model_config_of  # noqa: E402
from hybridflow.workers import ActorSpec, ActorWorker, EngineSpec  # noqa: E402
from hybridflow.workers.actor import next_token_loss_fn  # noqa: E402
from hybridflow.workers.base import SEQUENCE_KEYS, tensors_of  # noqa: E402

TOKENIZER = builtin_tokenizer()
# vLLM's CPU attention needs a head size of 32 or more. Its CPU MoE kernel pads the experts' width to a multiple of
# 32: 48 is padded to 64, so the rollout's padding before prepacking is exercised. Gemma 3 ties its embeddings like
# the real models.
VLLM_SIZES = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}
# Qwen3 first: the Qwen3-MoE engine is then built in a process whose vLLM groups a dense engine made (see
# ensure_expert_parallel_group)
VLLM_FAMILIES = {"qwen3": VLLM_SIZES, "qwen3_moe": {**VLLM_SIZES, "moe_intermediate_size": 48},
                 "gemma3_text": {**VLLM_SIZES, "query_pre_attn_scalar": 32, "tie_word_embeddings": True}}


def _actor(model_dir: str, backend: str) -> ActorWorker:
    engine = EngineSpec(model=model_config_of(ModelConfig(path=model_dir)), head="lm", seed=0,
                        engine=EngineConfig(dtype="float32", optim=OptimConfig(lr=1e-2)))
    generation = GenerationConfig(backend=backend, max_new_tokens=6, greedy=True, vllm_kv_cache_gib=0.0625)
    tokens = GenerationTokens(eos_token_ids=(TOKENIZER.eos_token_id,), pad_token_id=TOKENIZER.pad_token_id)
    return ActorWorker(ActorSpec(engine=engine, generation=generation, tokens=tokens))


def _assert_same_generations(native: ActorWorker, vllm: ActorWorker, prompts) -> torch.Tensor:
    """Both backends' greedy rollouts agree; vLLM's log-probs [B, T]."""
    expected, got = native.generate_sequences(prompts), vllm.generate_sequences(prompts)
    assert torch.equal(expected.batch["responses"], got.batch["responses"])
    mask_BT = got.batch["response_mask"].bool()
    torch.testing.assert_close(got.batch["logprobs"][mask_BT], expected.batch["logprobs"][mask_BT],
                               rtol=1e-4, atol=1e-4)
    return got.batch["logprobs"]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(VLLM_FAMILIES))
def test_vllm_generates_a_model_of_the_family_like_the_native_decoder_before_and_after_a_training_step(family,
                                                                                                    tmp_path):
    init_local_process_group()
    model_dir = family_model_dir(family, tmp_path / family, **VLLM_FAMILIES[family])
    native, vllm = _actor(model_dir, "native"), _actor(model_dir, "vllm")
    rows = prompt_rows(6, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=2))
    prompts = PromptDataset(rows, TOKENIZER, max_prompt_tokens=16).batch(range(6))
    before_BT = _assert_same_generations(native, vllm, prompts)
    batch = tensors_of(native.generate_sequences(prompts), SEQUENCE_KEYS)
    for actor in (native, vllm):  # the same next-token step on both: identical new weights
        actor.engine.train_step(batch, next_token_loss_fn(1.0), outputs=("logprobs",))
    after_BT = _assert_same_generations(native, vllm, prompts)
    assert (before_BT[:, 0] != after_BT[:, 0]).all()  # vLLM generated with the new weights


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3_text"])
def test_grpo_with_backend_vllm_on_a_model_of_the_family_rolls_out_with_the_training_engines_logprobs(family,
                                                                                                      tmp_path):
    """The driver and workers unchanged: the hybrid engine syncs every step's weights into vLLM (a new engine)."""
    from hybridflow.data import write_jsonl
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import run_rl

    model_dir = family_model_dir(family, tmp_path / family, **VLLM_FAMILIES[family])
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0,
                                                      config=ArithmeticTaskConfig(max_digits=1)))
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", f"actor.model.path={model_dir}",
        "reward.function=arithmetic", "algorithm.advantage_estimator=grpo", "actor.generation.max_new_tokens=4",
        "actor.generation.backend=vllm", "actor.generation.vllm_kv_cache_gib=0.0625",
        "actor.loss.old_log_probs=recompute",  # the training forward that the mismatch below is measured against
        "batch.prompts_per_step=2", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
        "trainer.total_steps=2", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'run'}"])
    history = run_rl(config, mode="local", tensorboard=False)
    assert len(history) == 2
    for step in history:
        assert step["rollout/vllm_bytes_loaded"] > 0
        # fp32 on both sides: the rollout's sampled log-probs are the training engine's to rounding
        assert step["rollout/logprob_abs_diff_max"] < 1e-4
