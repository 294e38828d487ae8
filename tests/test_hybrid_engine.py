"""3D-HybridEngine: generation under resharded layouts equals single-process generation, bytes match the paper."""

from __future__ import annotations

import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hybridflow.engine.generation import SamplingConfig
from hybridflow.engine.hybrid_engine import (HybridEngine, HybridEngineConfig, cut_training_shards,
                                             parameter_shapes, plan_buckets, storage_bytes, training_stage_of)
from hybridflow.engine.native_rollout import NativeRollout
from hybridflow.parallel.launch import run_distributed
from hybridflow.parallel.layout import GenerationLayout, ParallelLayout
from hybridflow.parallel.sharding import tp_shard_dim

WORLD = 4


def portable(value):
    """Tensors as numpy arrays, recursively: a tensor sent back through torch.multiprocessing shares its
    storage by file descriptor, which can vanish when the child exits before the parent reads it."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    return value


def tensors(value):
    """The inverse of ``portable``."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tensors(v) for v in value]
    return value
GREEDY = SamplingConfig(max_new_tokens=6, greedy=True)


def generate_on(hybrid: HybridEngine, prompts_BP, mask_BP, config: SamplingConfig) -> dict:
    """The native rollout backend on the hybrid engine's generation shard (between its two transitions)."""
    rollout = NativeRollout(hybrid.hf_config, dtype=hybrid.dtype, config=config)
    rollout.load(hybrid.shard, version=0)
    try:
        return rollout.generate(prompts_BP, mask_BP, config)
    finally:
        rollout.release()


def tiny_hf_config(family: str):
    # untied Llama: embedding and head the same size, so both training stages hold equal sharded bytes
    # and the paper's per-rank formulas hold exactly; tied Qwen2 (q/k/v biases) exercises the head
    # living on generation stage 0 with pipelined decoding.
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    return Qwen2Config(**common, tie_word_embeddings=True)


def tiny_model(family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_hf_config(family)).eval()


def prompts_and_mask(batch: int = 8):
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 256, (batch, 5), generator=generator)
    mask = torch.ones_like(prompts)
    mask[::3, :2] = 0  # left padding on some rows
    return prompts * mask, mask


# (family, p, t, pg, tg, strategy)
CASES = [
    ("llama", 1, 2, 1, 1, "hybrid"), ("llama", 1, 2, 1, 1, "vanilla"), ("llama", 1, 2, 1, 1, "full_gather"),
    ("llama", 1, 4, 1, 2, "hybrid"), ("llama", 1, 4, 1, 2, "vanilla"), ("llama", 1, 4, 1, 1, "full_gather"),
    ("llama", 2, 2, 1, 1, "hybrid"), ("llama", 2, 2, 2, 1, "hybrid"), ("llama", 2, 2, 1, 2, "hybrid"),
    ("llama", 2, 2, 2, 2, "hybrid"), ("llama", 2, 2, 1, 1, "vanilla"),
    ("qwen2", 2, 2, 2, 1, "hybrid"), ("qwen2", 2, 2, 1, 2, "hybrid"),
]


def _generate_under_cases(rank: int, world_size: int, cases) -> list[dict]:
    results = []
    prompts, mask = prompts_and_mask()
    for family, p, t, pg, tg, strategy in cases:
        config = tiny_hf_config(family)
        state_dict = tiny_model(family).state_dict()
        layout = ParallelLayout.for_world(world_size, pp_size=p, tp_size=t)
        shards = cut_training_shards(state_dict, config, layout, rank)
        pointers = {name: s.data_ptr() for name, s in shards.items()}
        engine = HybridEngine(config, layout, HybridEngineConfig(pp_size=pg, tp_size=tg, strategy=strategy))
        going = engine.to_generation(shards)
        in_place = all(any(piece.data_ptr() == shards[name].data_ptr() for piece in pieces)
                       for name, pieces in engine.shard.weights.items() if name in shards)
        rows = slice(engine.replica * len(prompts) // engine.num_replicas,
                     (engine.replica + 1) * len(prompts) // engine.num_replicas)
        out = generate_on(engine, prompts[rows], mask[rows], GREEDY)
        back = engine.to_training()
        results.append(dict(replica=engine.replica, rows=(rows.start, rows.stop), responses=out["responses"],
                            logprobs=out["logprobs"], to_generation=going, to_training=back, in_place=in_place,
                            training_bytes=storage_bytes(shards.values()),
                            unmoved=all(s.data_ptr() == pointers[n] for n, s in shards.items())))
    return portable(results)


@pytest.fixture(scope="module")
def case_results():
    return tensors(run_distributed(_generate_under_cases, WORLD, CASES, timeout_s=240))


@pytest.fixture(scope="module")
def reference_outputs():
    prompts, mask = prompts_and_mask()
    outputs = {}
    for family in ("llama", "qwen2"):
        model = tiny_model(family)
        with torch.no_grad():
            sequences = model.generate(prompts, attention_mask=mask, max_new_tokens=GREEDY.max_new_tokens,
                                       do_sample=False, pad_token_id=0, eos_token_id=None)
        outputs[family] = sequences[:, prompts.shape[1]:]
    return outputs


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_greedy_generation_under_each_layout_equals_single_process_hf_generation(case_results, reference_outputs, index):
    family = CASES[index][0]
    for rank_results in case_results:
        result = rank_results[index]
        start, stop = result["rows"]
        assert torch.equal(result["responses"], reference_outputs[family][start:stop]), f"case {CASES[index]}"


def _bytes(shape) -> int:
    return 4 * int(torch.Size(shape).numel())


def expected_transition(case, rank: int) -> tuple[int, int]:
    """(bytes received, parameter bytes during generation) from the paper's formulas, per rank."""
    family, p, t, pg, tg, strategy = case
    config = tiny_hf_config(family)
    shapes = parameter_shapes(config)
    layout = ParallelLayout.for_world(WORLD, pp_size=p, tp_size=t)
    d = layout.dp_size
    coords = layout.coords(rank)
    stage_of = {n: training_stage_of(n, num_layers=4, pp_size=p) for n in shapes}
    sharded = sum(_bytes(s) for n, s in shapes.items() if tp_shard_dim(n) is not None)
    replicated = {n: _bytes(s) for n, s in shapes.items() if tp_shard_dim(n) is None}
    model = sum(_bytes(s) for s in shapes.values())
    train = sum(_bytes(s) // (t if tp_shard_dim(n) is not None else 1)
                for n, s in shapes.items() if stage_of[n] == coords.pp_rank)
    if strategy == "full_gather":
        assert p == 1  # the formula is exact when every stage holds the same bytes
        return (t * p * d - 1) * model // (t * p * d), train + model
    gen = GenerationLayout(train=layout, pp_size=pg, tp_size=tg, grouping=strategy)
    gen_stage = gen.coords(rank).gen_pp_rank
    gen_layers = gen.stage_layers(4, gen_stage)
    def held(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in gen_layers
        return gen_stage == (0 if name.startswith("model.embed_tokens.") else pg - 1)

    in_gen_stage = [n for n in shapes if held(n)]
    other_stage_replicated = sum(replicated[n] for n in replicated
                                 if stage_of[n] != coords.pp_rank and n in in_gen_stage)
    gen_shard = sum(_bytes(shapes[n]) // (tg if tp_shard_dim(n) is not None else 1) for n in in_gen_stage)
    if strategy == "hybrid" and family == "qwen2":
        # tied embeddings: stage 0 holds more than the last, so per rank it is the zero-redundancy identity
        return gen_shard - train, gen_shard
    if strategy == "hybrid":
        return (t * p - tg * pg) * sharded // (tg * pg * t * p) + other_stage_replicated, gen_shard
    own_replicated_in_gen = sum(replicated.get(n, 0) for n in in_gen_stage if stage_of[n] == coords.pp_rank)
    all_other_replicated = sum(b for n, b in replicated.items() if stage_of[n] != coords.pp_rank)
    return (t * p - 1) * sharded // (t * p) + all_other_replicated, train + gen_shard - own_replicated_in_gen


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_bytes_received_and_generation_memory_per_rank_follow_the_papers_formulas(case_results, index):
    for rank, rank_results in enumerate(case_results):
        result = rank_results[index]
        received, generation_bytes = expected_transition(CASES[index], rank)
        assert result["to_generation"].bytes_received == received, f"rank {rank}"
        assert result["to_generation"].param_bytes == generation_bytes, f"rank {rank}"
        assert result["to_training"].bytes_received == 0 and result["to_training"].bytes_sent == 0
        assert result["to_training"].param_bytes == result["training_bytes"]
        assert result["unmoved"]


def test_hybrid_grouping_reuses_every_training_shard_in_place_and_holds_exactly_the_generation_shard(case_results):
    for index, case in enumerate(CASES):
        if case[-1] != "hybrid":
            continue
        for rank_results in case_results:
            result = rank_results[index]
            assert result["in_place"], f"case {case}"
            going = result["to_generation"]
            assert going.param_bytes == result["training_bytes"] + going.bytes_received


def test_hybrid_grouping_moves_less_than_vanilla_which_moves_less_than_full_gather(case_results):
    by_case = {case: [r[i]["to_generation"].bytes_received for r in case_results] for i, case in enumerate(CASES)}
    ours = by_case[("llama", 1, 4, 1, 2, "hybrid")]
    vanilla = by_case[("llama", 1, 4, 1, 2, "vanilla")]
    full = by_case[("llama", 1, 4, 1, 1, "full_gather")]
    assert all(a < b < c for a, b, c in zip(ours, vanilla, full))
    assert by_case[("llama", 2, 2, 2, 2, "hybrid")] == [0] * WORLD  # same layout: nothing moves


def test_invalid_hybrid_engine_configs_are_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="strategy"):
        HybridEngineConfig(strategy="gather_all")
    with pytest.raises(ValueError, match="tp_size"):
        HybridEngineConfig(tp_size=0)
    with pytest.raises(ValueError, match="full_gather"):
        HybridEngineConfig(tp_size=2, strategy="full_gather")


ROUND_TRIPS = 20


def _sgd_step(shards: dict[str, torch.Tensor], step: int, tp_rank: int) -> None:
    # a deterministic pseudo-gradient per (step, parameter, tp shard) stands in for backward(); a
    # replicated parameter gets the same update on every tp rank, as real training gives it
    for name, shard in shards.items():
        shard_index = tp_rank if tp_shard_dim(name) is not None else 0
        gen = torch.Generator().manual_seed(zlib.crc32(f"{step}/{name}/{shard_index}".encode()))
        shard.sub_(0.01 * torch.randn(shard.shape, generator=gen))


def _round_trips(rank: int, world_size: int) -> dict:
    config = tiny_hf_config("llama")
    layout = ParallelLayout.for_world(world_size, pp_size=2, tp_size=2)
    shards = cut_training_shards(tiny_model("llama").state_dict(), config, layout, rank)
    untouched = {n: s.clone() for n, s in shards.items()}
    pointers = {n: s.data_ptr() for n, s in shards.items()}
    engine = HybridEngine(config, layout, HybridEngineConfig(pp_size=2, tp_size=1))
    prompts, mask = prompts_and_mask(2)
    training_bytes = storage_bytes(shards.values())
    memory_after_each, peaks = [], []
    for step in range(ROUND_TRIPS):
        peaks.append(engine.to_generation(shards).param_bytes)
        generate_on(engine, prompts, mask, SamplingConfig(max_new_tokens=2, greedy=True))
        memory_after_each.append(engine.to_training().param_bytes)
        assert all(s.data_ptr() == pointers[n] for n, s in shards.items())
        tp_rank = layout.coords(rank).tp_rank
        _sgd_step(shards, step, tp_rank)
        _sgd_step(untouched, step, tp_rank)
    engine.to_generation(shards)
    rows = slice(engine.replica * 2, engine.replica * 2 + 2)
    prompts4, mask4 = prompts_and_mask(4)
    final = generate_on(engine, prompts4[rows], mask4[rows], GREEDY)["responses"]
    engine.to_training()
    return portable(dict(training_bytes=training_bytes, memory_after_each=memory_after_each, peaks=peaks,
                identical=all(torch.equal(shards[n], untouched[n]) for n in shards), shards=shards,
                rows=(rows.start, rows.stop), final=final))


def test_twenty_round_trips_restore_training_memory_and_leave_training_exactly_as_without_generation():
    results = tensors(run_distributed(_round_trips, WORLD, timeout_s=240))
    for result in results:
        assert result["identical"]
        assert result["memory_after_each"] == [result["training_bytes"]] * ROUND_TRIPS
        assert len(set(result["peaks"])) == 1 and result["peaks"][0] > result["training_bytes"]
    # the last generation ran on the trained weights: rebuild them whole and compare with HF
    layout = ParallelLayout.for_world(WORLD, pp_size=2, tp_size=2)
    model = tiny_model("llama")
    full = {}
    for name, param in model.named_parameters():
        holders = [r for r in range(WORLD) if name in results[r]["shards"] and layout.coords(r).dp_rank == 0]
        holders.sort(key=lambda r: layout.coords(r).tp_rank)
        dim = tp_shard_dim(name)
        full[name] = (results[holders[0]]["shards"][name] if dim is None
                      else torch.cat([results[r]["shards"][name] for r in holders], dim=dim))
    model.load_state_dict(full, strict=False)
    prompts, mask = prompts_and_mask(4)
    with torch.no_grad():
        expected = model.generate(prompts, attention_mask=mask, max_new_tokens=GREEDY.max_new_tokens,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)[:, prompts.shape[1]:]
    for result in results:
        start, stop = result["rows"]
        assert torch.equal(result["final"], expected[start:stop])


def _through_the_training_engine(rank: int, world_size: int) -> dict:
    from hybridflow.engine.config import EngineConfig, OptimConfig
    from hybridflow.engine.training import TrainingEngine
    from hybridflow.models.tiny import build_tiny_model

    trainer = TrainingEngine(EngineConfig(layout="3d", pp_size=2, tp_size=2, optim=OptimConfig(lr=1e-2)),
                             lambda: build_tiny_model())
    hybrid = HybridEngine(trainer.hf_config, trainer.layout, HybridEngineConfig(pp_size=2, tp_size=1))
    prompts, mask = prompts_and_mask(4)
    pointers = {n: s.data_ptr() for n, s in trainer.local_shards().items()}
    hybrid.to_generation(trainer.local_shards())
    # every replica generates the whole batch (same weights and seed: same samples) so that the one
    # training replica can recompute all of it
    sampled = generate_on(hybrid, prompts, mask, SamplingConfig(max_new_tokens=6, seed=3))
    hybrid.to_training()
    recomputed = trainer.forward(sampled, outputs=("logprobs",))["logprobs"]

    def loss_fn(outputs, micro):
        return -(outputs["logprobs"] * micro["response_mask"]).sum() / micro["num_tokens_global"], {}

    trainer.train_step(sampled, loss_fn, outputs=("logprobs",))
    hybrid.to_generation(trainer.local_shards())
    greedy = generate_on(hybrid, prompts, mask, GREEDY)["responses"]
    hybrid.to_training()
    return portable(dict(sampled=sampled, recomputed=recomputed, greedy=greedy, full=trainer.full_state_dict(),
                         unmoved=all(s.data_ptr() == pointers[n] for n, s in trainer.local_shards().items())))


def test_training_engine_shards_generate_with_logprobs_it_recomputes_and_after_a_step_generate_as_hf_does():
    results = tensors(run_distributed(_through_the_training_engine, WORLD, timeout_s=240))
    for result in results:
        sampled, mask = result["sampled"], result["sampled"]["response_mask"].bool()
        torch.testing.assert_close(sampled["logprobs"][mask], result["recomputed"][mask], atol=1e-5, rtol=0)
        assert result["unmoved"]
    from hybridflow.models.tiny import build_tiny_model

    model = build_tiny_model().eval()
    model.load_state_dict(results[0]["full"], strict=False)
    prompts, mask = prompts_and_mask(4)
    with torch.no_grad():
        expected = model.generate(prompts, attention_mask=mask, max_new_tokens=GREEDY.max_new_tokens,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)[:, prompts.shape[1]:]
    for result in results:
        assert torch.equal(result["greedy"], expected)


def _bf16_generation(rank: int, world_size: int) -> dict:
    from hybridflow.engine.config import EngineConfig
    from hybridflow.engine.training import TrainingEngine
    from hybridflow.models.tiny import build_tiny_model

    trainer = TrainingEngine(EngineConfig(layout="3d", tp_size=2), lambda: build_tiny_model())
    prompts, mask = prompts_and_mask(2)
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        hybrid = HybridEngine(trainer.hf_config, trainer.layout, HybridEngineConfig(tp_size=1), dtype=dtype)
        pointers = {n: s.data_ptr() for n, s in trainer.local_shards().items()}
        stats = hybrid.to_generation(trainer.local_shards())
        out = generate_on(hybrid, prompts, mask, GREEDY)
        stage_dtype = next(iter(hybrid.shard.weights.values()))[0].dtype
        report[str(dtype)] = dict(received=stats.bytes_received, stage_dtype=str(stage_dtype),
                                  finite=bool(torch.isfinite(out["logprobs"]).all()),
                                  responses=out["responses"].shape)
        hybrid.to_training()
        report[str(dtype)]["unmoved"] = all(s.data_ptr() == pointers[n] and s.dtype == torch.float32
                                            for n, s in trainer.local_shards().items())
    return report


def test_bf16_generation_from_fp32_masters_moves_half_the_bytes_and_leaves_the_training_shards_alone():
    for report in run_distributed(_bf16_generation, 2):
        fp32, bf16 = report["torch.float32"], report["torch.bfloat16"]
        assert fp32["stage_dtype"] == "torch.float32" and bf16["stage_dtype"] == "torch.bfloat16"
        assert bf16["received"] * 2 == fp32["received"] > 0
        assert fp32["finite"] and bf16["finite"] and fp32["unmoved"] and bf16["unmoved"]
        assert bf16["responses"] == fp32["responses"]


FSDP_BUCKET_MB = 0.05  # several buckets for the tiny model (its tensors are 8-64 KiB)


def _fsdp_actor_transition(rank: int, world_size: int) -> dict:
    import math

    from torch.distributed.tensor import DTensor

    from hybridflow.engine.config import EngineConfig
    from hybridflow.engine.training import TrainingEngine
    from hybridflow.models.tiny import build_tiny_model

    trainer = TrainingEngine(EngineConfig(layout="fsdp"), lambda: build_tiny_model())
    hybrid = HybridEngine.for_training(trainer, HybridEngineConfig(bucket_mb=FSDP_BUCKET_MB))
    prompts, mask = prompts_and_mask(4)
    shards = trainer.local_shards()
    going = hybrid.to_generation(shards)
    new = dict(sampled=generate_on(hybrid, prompts, mask, SamplingConfig(max_new_tokens=6, seed=3)),
               greedy=generate_on(hybrid, prompts, mask, GREEDY)["responses"])
    back = hybrid.to_training()
    # the path before the FSDP gather became a transition: FSDP2's own full_tensor() per parameter, then the
    # collective-free tg = pg = 1 transition of those whole tensors
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in trainer.model.named_parameters()}
    before = HybridEngine(trainer.hf_config, trainer.layout, HybridEngineConfig(), dtype=trainer.compute_dtype)
    before.to_generation(full)
    old = dict(sampled=generate_on(before, prompts, mask, SamplingConfig(max_new_tokens=6, seed=3)),
               greedy=generate_on(before, prompts, mask, GREEDY)["responses"])
    before.to_training()
    element = torch.empty(0, dtype=trainer.compute_dtype).element_size()
    slots = [math.ceil(shape[0] / world_size) * math.prod(shape[1:]) * element
             for shape in parameter_shapes(trainer.hf_config).values()]
    return portable(dict(going=going, back=back, new=new, old=old, replica=hybrid.replica,
                         num_replicas=hybrid.num_replicas, element=element,
                         own=sum(s.numel() for s in shards.values()) * element,
                         model=sum(t.numel() for t in full.values()) * element,
                         dim0=[s[0] for s in parameter_shapes(trainer.hf_config).values()],
                         buckets=len(plan_buckets(slots, int(FSDP_BUCKET_MB * 2**20)))))


def test_an_fsdp_actor_gathers_its_slices_as_a_counted_bucketed_transition_with_unchanged_tokens():
    results = tensors(run_distributed(_fsdp_actor_transition, 2, timeout_s=240))
    for rank, result in enumerate(results):
        going, model = result["going"], result["model"]
        assert all(rows % 2 == 0 for rows in result["dim0"])  # equal slices: the formula below is exact
        assert result["own"] == model // 2
        assert going.strategy == "fsdp_gather"
        assert going.bytes_received == model // 2 > 0  # (d-1)/d of the model, d = 2
        assert going.bytes_sent == result["own"]
        assert going.collectives == result["buckets"] > 1
        assert going.param_bytes == result["own"] + model  # its slices (training) and the whole model
        assert result["back"].param_bytes == result["own"] and result["back"].bytes_received == 0
        assert (result["replica"], result["num_replicas"]) == (rank, 2)  # every rank generates alone
        for key in ("responses", "response_mask", "logprobs"):
            assert torch.equal(result["new"]["sampled"][key], result["old"]["sampled"][key]), key
        assert torch.equal(result["new"]["greedy"], result["old"]["greedy"])
