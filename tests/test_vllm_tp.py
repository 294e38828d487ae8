"""vLLM tensor-parallel generation (tg > 1) over the 3D-HybridEngine's own generation TP groups.

Every rank of a spawned gloo world builds a native actor and a vLLM actor with the same model, layout and
seed; each generation replica generates its own prompts with both, before and after one training step.
SmolLM2 runs under tg = 3, and GRPO on Ray with a tg = 2 rollout. Skipped where vLLM is not installed.
Starting vLLM engines on every rank takes minutes on a loaded 2-core machine, so these tests are slow and
each starts one world (a vLLM engine per process, built once).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from hybridflow.parallel.launch import run_distributed  # noqa: E402

NEW_TOKENS = 6


def _actor(backend: str, tp_size: int, gen_tp_size: int):
    from hybridflow.data.builtin import builtin_tokenizer
    from hybridflow.engine import EngineConfig, OptimConfig
    from hybridflow.engine.generation import GenerationConfig
    from hybridflow.engine.generation_config import GenerationTokens
    from hybridflow.engine.hybrid_engine_config import HybridEngineConfig
    from hybridflow.models.config import ModelConfig
    from hybridflow.trainers.build import model_config_of
    from hybridflow.workers import ActorSpec, ActorWorker, EngineSpec

    tokenizer = builtin_tokenizer()
    engine = EngineSpec(model=model_config_of(ModelConfig(builtin="arithmetic")), head="lm", seed=0,
                        engine=EngineConfig(dtype="float32", layout="3d", tp_size=tp_size, optim=OptimConfig(lr=1e-2)))
    generation = GenerationConfig(backend=backend, max_new_tokens=NEW_TOKENS, greedy=True, vllm_kv_cache_gib=0.0625)
    tokens = GenerationTokens(eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    return ActorWorker(ActorSpec(engine=engine, hybrid_engine=HybridEngineConfig(tp_size=gen_tp_size),
                                 generation=generation, tokens=tokens))


def _prompts(count: int, seed: int):
    from hybridflow.data import PromptDataset
    from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows

    rows = prompt_rows(count, split="train", seed=seed, config=ArithmeticTaskConfig(max_digits=2))
    return PromptDataset(rows, builtin_tokenizer(), max_prompt_tokens=16).batch(range(count))


def _outputs(output) -> dict:
    return {key: output.batch[key].numpy() for key in ("responses", "response_mask", "logprobs")}


def _rollouts_under_tp(rank: int, world_size: int, tp_size: int, gen_tp_size: int) -> dict:
    """Both backends on this rank's replica's prompts, before and after one identical training step."""
    import vllm.distributed.parallel_state as parallel_state

    from hybridflow.workers.actor import next_token_loss_fn
    from hybridflow.workers.base import SEQUENCE_KEYS, tensors_of

    from hybridflow.controller.worker import WorkerContext, set_worker_context

    set_worker_context(WorkerContext(rank=rank, world_size=world_size, local_rank=rank, node_id="local"))
    native, vllm = _actor("native", tp_size, gen_tp_size), _actor("vllm", tp_size, gen_tp_size)
    replica = vllm.hybrid.replica
    prompts = _prompts(4, seed=replica)  # each replica its own prompts
    result = dict(replica=replica, before=(_outputs(native.generate_sequences(prompts)),
                                           _outputs(vllm.generate_sequences(prompts))))
    result.update(native_stats=native.transition_stats(), vllm_stats=vllm.transition_stats(),
                  vllm_tp_group=list(parallel_state.get_tp_group().ranks),
                  vllm_rows={name: tuple(param.shape) for name, param in vllm.rollout.params.items()
                             if name.startswith(("model.embed_tokens", "model.layers.0.", "lm_head"))},
                  resident_after_rollout=vllm.rollout.resident_bytes(),
                  shared_memory=_shared_memory_of(parallel_state.get_tp_group()),
                  shard_bytes=_generation_shard_bytes(vllm.engine.hf_config, gen_tp_size))
    # the same batch on every rank of the training TP group: the native rollout of common prompts
    batch = tensors_of(native.generate_sequences(_prompts(4, seed=99)), SEQUENCE_KEYS)
    for actor in (native, vllm):
        actor.engine.train_step(batch, next_token_loss_fn(1.0), outputs=("logprobs",))
    result["after"] = (_outputs(native.generate_sequences(prompts)), _outputs(vllm.generate_sequences(prompts)))
    return result


def _shared_memory_of(group) -> dict:
    """The /dev/shm names vLLM's TP group uses on CPU (its communicator's segments, one per rank, and its
    message queue's ring buffer) and which of them are still linked."""
    import os

    segments = getattr(group.device_communicator, "dist_module", None)
    group_name = getattr(segments, "group_name", "")
    names = [f"{group_name}_{rank}".lstrip("/") for rank in range(group.world_size)] if group_name else []
    if group.mq_broadcaster is not None and group.mq_broadcaster.buffer is not None:
        names.append(group.mq_broadcaster.buffer.shared_memory.name.lstrip("/"))
    import torch

    # vLLM's CPU build has its shared-memory ops only on some ISAs (none on an AVX2-only host): without them
    # its TP group falls back to torch.distributed and creates no segment
    return dict(group_name=group_name, names=names, shm_ops=hasattr(torch.ops._C, "init_shm_manager"),
                linked=[name for name in names if os.path.exists(os.path.join("/dev/shm", name))])


def _generation_shard_bytes(hf_config, gen_tp_size: int) -> int:
    """fp32 bytes of one generation TP rank's shard of the model (vocabulary-, column- and row-parallel
    parameters split tg ways, norms whole)."""
    from hybridflow.engine.hybrid_engine import parameter_shapes
    from hybridflow.parallel.sharding import tp_shard_dim

    return sum(math.prod(shape) // (gen_tp_size if tp_shard_dim(name) is not None else 1) * 4
               for name, shape in parameter_shapes(hf_config).items())


def assert_same_rollout(native: dict, vllm: dict, where) -> None:
    """vLLM's responses equal the native decoder's, and their log-probs agree to 1e-4 (fp32)."""
    assert (native["responses"] == vllm["responses"]).all(), where
    assert (native["response_mask"] == vllm["response_mask"]).all(), where
    mask = native["response_mask"].astype(bool)
    torch.testing.assert_close(torch.from_numpy(vllm["logprobs"][mask]),
                               torch.from_numpy(native["logprobs"][mask]), rtol=1e-4, atol=1e-4)


def _check(results: list[dict], gen_tp_size: int, expected_groups: list[list[int]]) -> None:
    groups = sorted({tuple(r["vllm_tp_group"]) for r in results})
    assert [list(g) for g in groups] == expected_groups  # vLLM's TP groups are the hybrid engine's
    for rank, result in enumerate(results):
        for phase in ("before", "after"):
            native, vllm = result[phase]
            assert_same_rollout(native, vllm, (rank, phase))
        # the step changed the model: the first response token's log-prob moved in every row
        assert not (result["before"][1]["logprobs"][:, 0] == result["after"][1]["logprobs"][:, 0]).any()
        stats, native_stats = result["vllm_stats"], result["native_stats"]
        # the same micro-DP all-gather as the native engine, and only this rank's tg-shard loaded into vLLM
        assert stats["bytes_received"] == native_stats["bytes_received"]
        assert stats["vllm_bytes_loaded"] == result["shard_bytes"]
        assert result["resident_after_rollout"] == 0
        # vLLM's shared memory on CPU: named for this engine alone, and unlinked once every rank mapped it
        # (nothing for a killed run to leave behind in /dev/shm, nothing a stale segment can collide with)
        shared_memory = result["shared_memory"]
        if shared_memory["shm_ops"]:
            assert shared_memory["group_name"].startswith("hybridflow-"), shared_memory
            assert len(shared_memory["names"]) == gen_tp_size + 1, shared_memory
        else:  # torch.distributed carries vLLM's TP group here: no segment of its communicator
            assert shared_memory["group_name"] == "", shared_memory
        assert shared_memory["linked"] == [], shared_memory
        # vocabulary split into equal chunks (padded to tg, not to 64), q/k/v and gate/up heads split tg ways
        vocab = 24
        assert result["vllm_rows"]["model.embed_tokens.weight"] == (vocab // gen_tp_size, 128)
        assert result["vllm_rows"]["lm_head.weight"] == (vocab // gen_tp_size, 128)
        assert result["vllm_rows"]["model.layers.0.self_attn.qkv_proj.weight"] == (3 * 128 // gen_tp_size, 128)
        assert result["vllm_rows"]["model.layers.0.self_attn.o_proj.weight"] == (128, 128 // gen_tp_size)
    # ranks of one replica generate the same tokens; replicas had different prompts
    for a in results:
        for b in results:
            if a["replica"] == b["replica"]:
                assert (a["before"][1]["responses"] == b["before"][1]["responses"]).all()


def test_vllms_group_lists_go_through_the_hybrid_order_and_its_vocabulary_pads_to_tg_only_while_building(
        monkeypatch):
    import inspect

    import vllm.distributed.parallel_state as parallel_state
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from hybridflow.engine.vllm_rollout import vllm_tp_groups, vocab_padding

    calls = []
    monkeypatch.setattr(parallel_state, "init_model_parallel_group",
                        lambda group_ranks, *args, **kwargs: calls.append(group_ranks))
    with vllm_tp_groups([[0, 2], [1, 3]]):  # t = 4, tg = 2: the hybrid grouping's strided TP groups
        parallel_state.init_model_parallel_group([[0, 1], [2, 3]], 0, "gloo", group_name="tp")
        parallel_state.init_model_parallel_group([[0], [1], [2], [3]], 0, "gloo", group_name="pp")
    parallel_state.init_model_parallel_group([[0, 1], [2, 3]], 0, "gloo", group_name="tp")  # restored
    assert calls == [[[0, 2], [1, 3]], [[0], [2], [1], [3]], [[0, 1], [2, 3]]]

    def padding(cls):
        return inspect.signature(cls.__init__).parameters["padding_size"].default

    with vocab_padding(2):
        assert padding(VocabParallelEmbedding) == padding(ParallelLMHead) == 2
    assert padding(VocabParallelEmbedding) == padding(ParallelLMHead) == 64


@pytest.mark.slow
def test_vllm_tg2_over_strided_generation_groups_of_a_tp4_actor_equals_the_native_engine():
    """t = 4 -> tg = 2: generation TP groups {0, 2} and {1, 3} (stride t/tg), micro-DP groups {0, 1} and
    {2, 3}; two replicas, each generating its own prompts."""
    results = run_distributed(_rollouts_under_tp, 4, 4, 2, timeout_s=900)
    assert sorted({r["replica"] for r in results}) == [0, 1]
    _check(results, 2, expected_groups=[[0, 2], [1, 3]])


@pytest.mark.slow
def test_vllm_tg2_of_a_tp2_actor_loads_each_ranks_training_shard_and_equals_the_native_engine():
    """t = 2 -> tg = 2: the generation shard is the training shard (nothing gathered)."""
    results = run_distributed(_rollouts_under_tp, 2, 2, 2, timeout_s=600)
    assert [r["vllm_stats"]["bytes_received"] for r in results] == [0, 0]
    _check(results, 2, expected_groups=[[0, 1]])


@pytest.mark.slow
def test_grpo_on_ray_with_a_tp2_actor_rolls_out_on_vllm_tg2_with_rollout_logprobs_matching_training(
        ray_session, tmp_path):
    """The driver, protocols and workers unchanged: two Ray actor ranks, one vLLM replica of tg = 2."""
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1)))
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        "placement.pools={all: [2]}", "actor.engine.layout=3d", "actor.engine.tp_size=2",
        "actor.hybrid_engine.tp_size=2", "actor.generation.backend=vllm", "actor.generation.vllm_kv_cache_gib=0.0625",
        "actor.loss.old_log_probs=recompute",  # the training forward that the mismatch below is measured against
        "actor.generation.max_new_tokens=4", "algorithm.advantage_estimator=grpo", "batch.prompts_per_step=2",
        "batch.samples_per_prompt=2", "batch.mini_batch_size=4", "trainer.total_steps=2",
        "trainer.progress_bar=false", "trainer.resume=false", f"trainer.output_dir={tmp_path / 'run'}"])
    trainer = RLTrainer(config, mode="ray", tensorboard=False)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    from hybridflow.engine.hybrid_engine import parameter_shapes
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.loader import hf_config_of
    from hybridflow.trainers.build import model_config_of

    hf_config = hf_config_of(model_config_of(ModelConfig(builtin="arithmetic")), head="lm")
    assert set(parameter_shapes(hf_config))  # the shard formula below covers every parameter
    for step in history:
        assert step["rollout/vllm_bytes_loaded"] == _generation_shard_bytes(hf_config, 2)
        assert step["rollout/bytes_received"] == 0  # t = tg: the training shard is the generation shard
        # fp32 on both sides: vLLM's sampled log-probs are the training engine's to rounding
        assert step["rollout/logprob_abs_diff_max"] < 1e-4 and step["rollout/sequence_kl"] < 1e-6


def _smollm2_under_tg3(rank: int, world_size: int) -> dict:
    """SmolLM2-135M cut into t = 3 training shards; the hybrid engine's tg = 3 shard generates natively and in vLLM."""
    from transformers import AutoModelForCausalLM

    from hybridflow.engine.generation import GenerationConfig
    from hybridflow.engine.generation_config import GenerationTokens
    from hybridflow.engine.hybrid_engine import HybridEngine, HybridEngineConfig, cut_training_shards
    from hybridflow.engine.native_rollout import NativeRollout
    from hybridflow.engine.vllm_rollout import VllmRollout
    from hybridflow.models import load_tokenizer
    from hybridflow.models.smollm2 import smollm2_path
    from hybridflow.parallel.layout import ParallelLayout

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    hf_config, state = model.config, model.state_dict()
    layout = ParallelLayout.for_world(world_size, tp_size=world_size)
    shards = cut_training_shards(state, hf_config, layout, rank)
    del model, state
    tokenizer = load_tokenizer(smollm2_path())  # left padding
    texts = ["The capital of France is", "Question: what is 12 + 30? Answer:",
             "def fibonacci(n):", "Once upon a time, in a small village,"]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    prompts_BP, mask_BP = encoded["input_ids"], encoded["attention_mask"]
    config = GenerationConfig(backend="vllm", max_new_tokens=8, greedy=True, vllm_kv_cache_gib=0.125).for_call()
    hybrid = HybridEngine(hf_config, layout, HybridEngineConfig(tp_size=world_size))
    hybrid.to_generation(shards)
    native_rollout = NativeRollout(hf_config, dtype=torch.float32, config=config)
    native_rollout.load(hybrid.shard, version=0)
    native = native_rollout.generate(prompts_BP, mask_BP, config)
    native_rollout.release()
    rollout = VllmRollout.for_shard(hf_config, hybrid.shard, dtype=torch.float32, config=config)
    load = rollout.load(hybrid.shard, version=0)
    hybrid.to_training()
    got = rollout.generate(prompts_BP, mask_BP, config)
    rollout.release()
    return {"native": {k: native[k].numpy() for k in ("responses", "logprobs")},
            "vllm": {k: got[k].numpy() for k in ("responses", "logprobs")},
            "loaded": load.bytes_loaded, "shard": sum(s.numel() * 4 for s in shards.values())}


@pytest.mark.slow
@pytest.mark.needs_smollm2
def test_vllm_tg3_on_smollm2_equals_the_native_engine_in_fp32():
    """SmolLM2's 9 heads and 3 key/value heads split 3 ways (tg = 2 does not divide them)."""
    from hybridflow.models.smollm2 import smollm2_path

    if smollm2_path() is None:
        pytest.skip("SmolLM2-135M not converted; run `python scripts/get_smollm2.py`")
    results = run_distributed(_smollm2_under_tg3, 3, timeout_s=1200)
    for result in results:
        assert (result["vllm"]["responses"] == result["native"]["responses"]).all()
        torch.testing.assert_close(torch.from_numpy(result["vllm"]["logprobs"]),
                                   torch.from_numpy(result["native"]["logprobs"]), rtol=1e-3, atol=1e-3)
        assert result["loaded"] == result["shard"]  # t = tg: each rank loads exactly its training shard
    assert (results[0]["vllm"]["responses"] == results[1]["vllm"]["responses"]).all()
