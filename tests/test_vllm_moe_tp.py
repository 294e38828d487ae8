"""vLLM tensor-parallel generation (tg = 2) of a mixture-of-experts model (Qwen3-MoE): vLLM splits every expert's
intermediate dim over its TP ranks, and the weight sync writes each rank its slice of every expert (the gate and up
halves of ``w13_weight`` sliced alone, the columns of ``w2_weight``), padded and prepacked for that rank's kernel.

One spawned gloo world of two ranks, each with a native actor and a vLLM actor (one vLLM engine per process):
greedy tokens, fp32 log-probs and the experts routing replay records equal the native decoder's, before and after
one identical training step.
Skipped where vLLM is not installed; slow (two vLLM engines start on a loaded 2-core machine).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from test_families import family_model_dir  # noqa: E402
from test_vllm_tp import assert_same_rollout  # noqa: E402

from hybridflow.engine.vllm_rollout import expert_tp_slice, pad_intermediate  # noqa: E402
from hybridflow.models.moe import ROUTED_EXPERTS, ROUTING_PAD  # noqa: E402
from hybridflow.parallel.launch import run_distributed  # noqa: E402

# vLLM's CPU attention needs head_dim >= 32 and its MoE kernel a hidden size that is a multiple of 32. Each rank
# holds 48 / 2 = 24 of every expert's intermediate rows, which vLLM's CPU kernel pads to its alignment: the
# rollout's per-rank padding before prepacking is exercised.
MOE_SIZES = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256, "moe_intermediate_size": 48}
NEW_TOKENS = 6


def test_each_tp_rank_gets_its_rows_of_the_gate_and_up_halves_and_its_columns_of_down():
    E, I, H, t = 3, 8, 4, 2
    gate, up = torch.randn(E, I, H), torch.randn(E, I, H)
    w13, w2 = torch.cat([gate, up], dim=1), torch.randn(E, H, I)
    for rank in range(t):
        rows = slice(rank * I // t, (rank + 1) * I // t)
        assert torch.equal(expert_tp_slice(w13, "w13_weight", rank, t), torch.cat([gate[:, rows], up[:, rows]], 1))
        assert torch.equal(expert_tp_slice(w2, "w2_weight", rank, t), w2[:, :, rows])
    assert expert_tp_slice(w13, "w13_weight", 0, 1) is w13
    # padded to a width P per rank: gate rows [0, I/t), up rows [P, P + I/t), zeros elsewhere
    part = expert_tp_slice(w13, "w13_weight", 1, t)
    padded = pad_intermediate(part, torch.Size((E, 2 * 6, H)), "w13_weight")
    assert torch.equal(padded[:, :4], gate[:, 4:]) and torch.equal(padded[:, 6:10], up[:, 4:])
    assert not padded[:, 4:6].any() and not padded[:, 10:].any()


def _actor(model_dir: str, backend: str):
    from hybridflow.data.builtin import builtin_tokenizer
    from hybridflow.engine import EngineConfig, OptimConfig
    from hybridflow.engine.generation import GenerationConfig
    from hybridflow.engine.generation_config import GenerationTokens
    from hybridflow.engine.hybrid_engine_config import HybridEngineConfig
    from hybridflow.models.config import ModelConfig
    from hybridflow.trainers.build import model_config_of
    from hybridflow.workers import ActorSpec, ActorWorker, EngineSpec

    tokenizer = builtin_tokenizer()
    engine = EngineSpec(model=model_config_of(ModelConfig(path=model_dir)), head="lm", seed=0,
                        engine=EngineConfig(dtype="float32", layout="3d", tp_size=2, optim=OptimConfig(lr=1e-2)))
    generation = GenerationConfig(backend=backend, max_new_tokens=NEW_TOKENS, greedy=True, vllm_kv_cache_gib=0.0625)
    tokens = GenerationTokens(eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    return ActorWorker(ActorSpec(engine=engine, hybrid_engine=HybridEngineConfig(tp_size=2),
                                 generation=generation, tokens=tokens, routing_replay=True))


def _prompts(count: int, seed: int):
    from hybridflow.data import PromptDataset
    from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows

    rows = prompt_rows(count, split="train", seed=seed, config=ArithmeticTaskConfig(max_digits=2))
    return PromptDataset(rows, builtin_tokenizer(), max_prompt_tokens=16).batch(range(count))


def _outputs(output) -> dict:
    return {key: output.batch[key].numpy() for key in ("responses", "response_mask", "logprobs", ROUTED_EXPERTS)}


def _rollouts_of_moe_under_tg2(rank: int, world_size: int, model_dir: str) -> dict:
    """Both backends on the same prompts, before and after one identical training step (t = tg = 2)."""
    import vllm.distributed.parallel_state as parallel_state

    from hybridflow.controller.worker import WorkerContext, set_worker_context
    from hybridflow.workers.actor import next_token_loss_fn
    from hybridflow.workers.base import SEQUENCE_KEYS, tensors_of

    set_worker_context(WorkerContext(rank=rank, world_size=world_size, local_rank=rank, node_id="local"))
    native, vllm = _actor(model_dir, "native"), _actor(model_dir, "vllm")
    prompts = _prompts(6, seed=0)
    result = dict(before=(_outputs(native.generate_sequences(prompts)), _outputs(vllm.generate_sequences(prompts))))
    writers = vllm.rollout.expert_writers
    result.update(vllm_stats=vllm.transition_stats(), vllm_tp_group=list(parallel_state.get_tp_group().ranks),
                  expert_ranks=sorted({(w.tp_rank, w.tp_size) for w in writers.values()}),
                  expert_shapes={name.rpartition(".")[2]: tuple(vllm.rollout.params[name].shape)
                                 for name in writers if ".layers.0." in name},
                  shard_bytes=_generation_shard_bytes(vllm.engine.hf_config, 2))
    batch = tensors_of(native.generate_sequences(_prompts(4, seed=99)), SEQUENCE_KEYS)
    for actor in (native, vllm):  # the same batch and step on both: identical new weights
        actor.engine.train_step(batch, next_token_loss_fn(1.0), outputs=("logprobs",))
    result["after"] = (_outputs(native.generate_sequences(prompts)), _outputs(vllm.generate_sequences(prompts)))
    return result


def _generation_shard_bytes(hf_config, gen_tp_size: int) -> int:
    """fp32 bytes one generation TP rank loads into vLLM: tensor-parallel parameters and the experts split tg ways,
    the rest whole."""
    from hybridflow.engine.hybrid_engine import parameter_shapes
    from hybridflow.parallel.sharding import tp_shard_dim

    def split(name: str) -> bool:
        return tp_shard_dim(name) is not None or ".mlp.experts." in name

    return sum(math.prod(shape) // (gen_tp_size if split(name) else 1) * 4
               for name, shape in parameter_shapes(hf_config).items())


@pytest.mark.slow
def test_vllm_tg2_generates_qwen3_moe_like_the_native_decoder_before_and_after_a_training_step(tmp_path):
    model_dir = family_model_dir("qwen3_moe", tmp_path / "qwen3_moe", **MOE_SIZES)
    results = run_distributed(_rollouts_of_moe_under_tg2, 2, model_dir, timeout_s=900)
    for rank, result in enumerate(results):
        assert result["vllm_tp_group"] == [0, 1]
        # vLLM split every expert over the two ranks; each rank's kernel width is its half, padded (24 -> P)
        assert result["expert_ranks"] == [(rank, 2)]
        experts, hidden, width = result["expert_shapes"]["w2_weight"]
        assert (experts, hidden) == (8, 128) and 24 <= width < 48
        assert result["expert_shapes"]["w13_weight"] == (8, 2 * width, 128)
        assert result["vllm_stats"]["vllm_bytes_loaded"] == result["shard_bytes"]
        for phase in ("before", "after"):
            native, vllm = result[phase]
            assert_same_rollout(native, vllm, (rank, phase))
            # routing replay records the same experts per token on every rank (vLLM's top-k comes unsorted)
            native_BSLK, vllm_BSLK = (torch.from_numpy(out[ROUTED_EXPERTS]) for out in (native, vllm))
            assert torch.equal(vllm_BSLK.sort(-1).values, native_BSLK.sort(-1).values), (rank, phase)
            assert int((vllm_BSLK != ROUTING_PAD).sum()) > 0
        # the step changed the model, and vLLM generated with the new weights
        assert not (result["before"][1]["logprobs"][:, 0] == result["after"][1]["logprobs"][:, 0]).any()
    assert (results[0]["before"][1]["responses"] == results[1]["before"][1]["responses"]).all()
