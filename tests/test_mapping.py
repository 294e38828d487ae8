"""Auto-mapping: partitions, model sizes, memory feasibility, cost formulas and composition, search."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hybridflow.mapping import (Cluster, Plan, PoolPlan, RoleStrategy, Workload, load_hardware, model_spec, plan,
                                set_partitions, simulate_plan)
from hybridflow.mapping.dataflow import dataflow
from hybridflow.mapping.hardware import GIB, HardwareProfile
from hybridflow.mapping.search import Planner, SetResult, resolve_models
from hybridflow.mapping.simulator import RoleCost, Simulator

PPO_ROLES = ("actor", "critic", "reference", "reward")
PAPER_WORKLOAD = Workload(prompts_per_step=1024, prompt_length=1024, response_length=1024)
# the command: 8 PPO updates per step (1024 samples, mini-batch 128), as in the paper's runs
PAPER_PPO = Workload(prompts_per_step=1024, prompt_length=1024, response_length=1024, mini_batch_size=128)


def a100_cluster(num_devices: int, per_node: int = 8) -> Cluster:
    return Cluster(num_devices=num_devices, devices_per_node=per_node, hardware=load_hardware("a100-80g"))


def same_model(name: str, roles=PPO_ROLES) -> dict[str, str]:
    return {role: name for role in roles}


# ---- placements ------------------------------------------------------------------------------
@pytest.mark.parametrize("count, bell", [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52)])
def test_set_partitions_count_the_bell_numbers_and_cover_every_item_once(count, bell):
    items = list("abcde"[:count])
    partitions = list(set_partitions(items))
    assert len(partitions) == bell
    canonical = {frozenset(frozenset(block) for block in partition) for partition in partitions}
    assert len(canonical) == bell  # no placement twice
    for partition in partitions:
        assert sorted(item for block in partition for item in block) == items


# ---- model specs -----------------------------------------------------------------------------
def test_known_llama_shapes_have_their_published_parameter_counts():
    # Llama-2 7B/13B/70B model cards (exact counts of the Hugging Face checkpoints)
    assert model_spec("llama-7b").num_params() == 6_738_415_616
    assert model_spec("llama-13b").num_params() == 13_015_864_320
    assert model_spec("llama-70b").num_params() == 68_976_648_192


def test_parameter_counts_equal_those_of_the_transformers_models():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.models.tiny import TINY_DEFAULTS

    with torch.device("meta"):
        tiny = LlamaForCausalLM(LlamaConfig(**TINY_DEFAULTS))
        big = LlamaForCausalLM(LlamaConfig(hidden_size=8192, num_hidden_layers=48, num_attention_heads=64,
                                           num_key_value_heads=8, intermediate_size=22016, vocab_size=32000))
    assert model_spec("tiny").num_params() == sum(p.numel() for p in tiny.parameters())
    assert model_spec("llama-34b").num_params() == sum(p.numel() for p in big.parameters())


def test_model_spec_reads_a_hugging_face_config_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 1000, "tie_word_embeddings": True}))
    spec = model_spec(str(tmp_path))
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (128, 3, 8, 2)
    # tied head: embedding once, 3 layers of (2*128*128 + 2*128*32 + 3*128*256 + 2*128), final norm
    assert spec.num_params() == 1000 * 128 + 3 * (32768 + 8192 + 98304 + 256) + 128


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: tiny, llama-7b, llama-13b, llama-34b, llama-70b"):
        model_spec("llama-8b")


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_devices, per_node, message", [
    (0, 8, "num_devices must be a positive integer"),
    (16, 0, "devices_per_node must be a positive integer"),
    (12, 8, "must be a multiple of devices_per_node 8"),
])
def test_bad_device_counts_are_rejected(num_devices, per_node, message):
    with pytest.raises(ValueError, match=message):
        a100_cluster(num_devices, per_node)


def test_a_model_that_fits_nowhere_reports_what_it_needs_and_what_a_device_has():
    # a 70B reward model (inference only) on one A100: 3d p1 t1 holds bf16 weights plus one
    # layer's activations of a 2048-token micro-batch (17 elements per token per hidden unit)
    spec = model_spec("llama-70b")
    value_params = spec.num_params(head="value")
    need = 2 * value_params + 17 * 2 * 2048 * 8192
    models = same_model("tiny") | {"reward": "llama-70b"}
    with pytest.raises(ValueError) as caught:
        plan("ppo", models, PAPER_WORKLOAD, a100_cluster(1, 1))
    message = str(caught.value)
    assert "role 'reward' (llama-70b, 68.71B parameters, inference)" in message
    assert f"needs {need / GIB:.1f} GiB per device" in message
    assert "72.0 GiB usable each (80 GiB x 0.9, a100-80g)" in message


def test_models_must_match_the_roles_of_the_dataflow():
    with pytest.raises(ValueError, match=r"missing \['critic'\]"):
        plan("ppo", {"actor": "tiny", "reference": "tiny", "reward": "tiny"}, PAPER_WORKLOAD, a100_cluster(8))


# ---- memory ----------------------------------------------------------------------------------
def test_trained_memory_follows_the_engine_fp32_master_and_adam_resident_fp32_gradients_only_while_training():
    simulator = Simulator(workload=PAPER_WORKLOAD, cluster=a100_cluster(16))
    spec = model_spec("llama-7b")
    params = spec.num_params()
    strategy = RoleStrategy(layout="3d", pp_size=2, tp_size=4)
    # 3d: fp32 master weights and Adam moments per t p shard (every data-parallel replica holds its own)
    trained = simulator.resident_bytes(spec, "lm", strategy, 16, trained=True)
    assert trained == pytest.approx(params / 8 * (4 + 4 + 4))
    assert simulator.resident_bytes(spec, "lm", strategy, 16, trained=False) == pytest.approx(params / 8 * 2)
    fsdp = simulator.resident_bytes(spec, "lm", RoleStrategy(layout="fsdp"), 16, trained=True)
    assert fsdp == pytest.approx(params * 12 / 16)
    # the fp32 gradients are training's working memory (freed after each optimizer step), not resident
    # (one 2048-token micro-batch: 17 x 2 bytes per token and hidden unit over t = 4 for all 32 layers,
    # fp32 logits over t twice with backward)
    activations = 17 * 2 * 2048 * 4096 / 4 * 32 + 2048 * 32000 * 4 / 4 * 2
    assert simulator.transient_bytes(spec, "lm", strategy, trained=True, num_devices=16) == pytest.approx(
        activations + params / 8 * 4)
    # bf16 generation from fp32 master weights needs its own bf16 generation shard beside them
    actor = RoleStrategy(layout="3d", pp_size=2, tp_size=4, generation_pp_size=1, generation_tp_size=2)
    assert simulator.generation_extra_bytes(spec, actor) == pytest.approx(spec.num_params(head="lm") * 2 / 2)


def test_minimum_devices_grow_with_the_models_colocated_on_them():
    flow = dataflow("ppo")
    planner = Planner(dataflow=flow, models=resolve_models(same_model("llama-13b")),
                      workload=PAPER_WORKLOAD, cluster=a100_cluster(64))
    alone = planner.min_devices(("reference",))
    together = planner.min_devices(PPO_ROLES)
    # 13B bf16 weights (26 GB) fit one 72 GiB (77.3 GB) device. Together on 8 devices (t*p = 8, d = 1):
    # actor and critic 16 bytes/param / 8 = 26 GB each, reference and reward 2 bytes/param / 8 = 3.3 GB
    # each: 58.6 GB plus activations fits; on 4 devices the two trained models alone need 104 GB
    assert alone == 1
    assert together == 8
    assert planner.set_result(PPO_ROLES, 4) is None


def test_colocated_models_leave_less_kv_cache_so_the_actor_generates_in_more_waves():
    flow = dataflow("ppo")
    planner = Planner(dataflow=flow, models=resolve_models(same_model("llama-7b")),
                      workload=PAPER_WORKLOAD, cluster=a100_cluster(8))
    alone = planner.best_actor(8)
    crowded = planner.best_actor(8, other_resident=40 * GIB)
    assert crowded.stage_seconds["generation"] > alone.stage_seconds["generation"]


# ---- cost formulas ---------------------------------------------------------------------------
def test_single_device_training_is_model_flops_over_achievable_flops():
    cluster = a100_cluster(1, 1)
    workload = Workload(prompts_per_step=8, prompt_length=96, response_length=32, mini_batch_size=4, ppo_epochs=2)
    simulator = Simulator(workload=workload, cluster=cluster)
    spec = model_spec("llama-7b")
    strategy = RoleStrategy(layout="3d")
    flops = 312e12 * 0.5
    tokens_per_pass = 4 * 128
    per_token = spec.matmul_params() + 32 * 4096 * 128
    assert simulator.training_seconds(spec, "lm", strategy, 1) == pytest.approx(
        4 * tokens_per_pass * 6 * per_token / flops)  # 2 mini-batches x 2 epochs, no communication
    assert simulator.inference_seconds(spec, "lm", strategy, 1) == pytest.approx(8 * 128 * 2 * per_token / flops)


def test_a_bf16_cpu_costs_wide_models_at_its_bf16_rate_with_bf16_elements_and_narrow_ones_in_fp32():
    fp32_cpu = HardwareProfile(**(load_hardware("a100-80g").to_dict()
                                  | {"compute_dtype": "fp32", "peak_flops": 1e11, "compute_units_per_node": 2}))
    bf16_cpu = replace(fp32_cpu, cpu_bf16_peak_flops=3e11, cpu_bf16_min_hidden=256)
    workload = Workload(prompts_per_step=8, prompt_length=16, response_length=16)
    wide, narrow = model_spec("llama-7b"), model_spec("tiny")  # 4096 and 64 wide
    strategy = RoleStrategy(layout="3d", generation_pp_size=1, generation_tp_size=1)
    plain = Simulator(workload=workload, cluster=Cluster(num_devices=1, devices_per_node=1, hardware=fp32_cpu))
    bf16 = Simulator(workload=workload, cluster=Cluster(num_devices=1, devices_per_node=1, hardware=bf16_cpu))
    assert bf16_cpu.for_model(256).peak_flops == 3e11 and bf16_cpu.for_model(256).compute_dtype == "bf16"
    assert bf16_cpu.for_model(255) is bf16_cpu and fp32_cpu.for_model(4096) is fp32_cpu
    # the wide model: 3x the matmul rate (compute-bound here) and half the bytes per generation weight
    assert bf16.inference_seconds(wide, "lm", strategy, 1) < plain.inference_seconds(wide, "lm", strategy, 1) / 2
    assert bf16.generation_weight_bytes(wide, strategy) == plain.generation_weight_bytes(wide, strategy) / 2
    # the narrow one computes in fp32 (engine.dtype auto): costed exactly as on the fp32 profile
    assert bf16.inference_seconds(narrow, "lm", strategy, 1) == plain.inference_seconds(narrow, "lm", strategy, 1)
    assert bf16.generation_weight_bytes(narrow, strategy) == plain.generation_weight_bytes(narrow, strategy)
    with pytest.raises(ValueError, match=r"cpu_bf16_peak_flops must be a positive number or null .*got 0"):
        replace(fp32_cpu, cpu_bf16_peak_flops=0)


def test_ring_all_reduce_moves_twice_the_shard_fraction_of_the_bytes_and_pays_every_ring_step():
    simulator = Simulator(workload=PAPER_WORKLOAD, cluster=a100_cluster(16))
    # a100-80g: NVLink 300 GB/s, 200 Gb/s per node shared by its 8 GPUs; 80% of either; 2.5 / 10 us per step
    intra, inter = 300e9 * 0.8, 25e9 / 8 * 0.8
    assert simulator.all_reduce_seconds(1e9, 4, 4) == pytest.approx(6 * 2.5e-6 + 2 * 3 / 4 * 1e9 / intra)
    assert simulator.all_reduce_seconds(1e9, 2, 16) == pytest.approx(2 * 1e-5 + 1e9 / inter)
    assert simulator.all_gather_seconds(1e9, 8, 8, num_collectives=3) == pytest.approx(3 * 7 * 2.5e-6
                                                                                        + 7 / 8 * 1e9 / intra)
    assert simulator.all_reduce_seconds(1e9, 1, 1) == 0.0


def test_hybrid_engine_transition_moves_the_paper_volume_inside_micro_dp_groups():
    simulator = Simulator(workload=PAPER_WORKLOAD, cluster=a100_cluster(16))
    spec = model_spec("llama-7b")
    model_bytes = spec.num_params() * 2
    strategy = RoleStrategy(layout="3d", pp_size=2, tp_size=4, generation_pp_size=1, generation_tp_size=2)
    # (t p - tg pg) / (tg pg t p) = (8 - 2) / 16 of the model per rank; micro-DP groups of 4 ranks
    # ({0, 1, 4, 5}, ...) lie inside a node: NVLink, 3 ring steps
    assert simulator.transition_seconds(spec, strategy, 16) == pytest.approx(3 * 2.5e-6 + 6 / 16 * model_bytes / 240e9)
    same = RoleStrategy(layout="3d", pp_size=2, tp_size=4, generation_pp_size=2, generation_tp_size=4)
    assert simulator.transition_seconds(spec, same, 16) == 0.0


def test_transition_groups_that_span_pipeline_stages_on_other_nodes_use_the_inter_node_links():
    from hybridflow.parallel.layout import GenerationLayout, ParallelLayout

    simulator = Simulator(workload=PAPER_WORKLOAD, cluster=a100_cluster(32))
    spec = model_spec("llama-13b")
    model_bytes = spec.num_params() * 2
    strategy = RoleStrategy(layout="3d", pp_size=4, tp_size=8, generation_pp_size=1, generation_tp_size=8)
    # the project's rank order puts the 4 training stages on 4 nodes; the generation stage gathers them
    groups = GenerationLayout(train=ParallelLayout.for_world(32, pp_size=4, tp_size=8), pp_size=1,
                              tp_size=8).micro_dp_groups()
    assert groups[0] == [0, 8, 16, 24]
    received = (32 - 8) / (8 * 32) * model_bytes
    assert simulator.transition_seconds(spec, strategy, 32) == pytest.approx(3 * 1e-5 + received / (25e9 / 8 * 0.8))
    # the same volume over NVLink when tg shrinks inside each node's TP group instead
    inside = RoleStrategy(layout="3d", pp_size=4, tp_size=8, generation_pp_size=4, generation_tp_size=2)
    assert simulator.transition_seconds(spec, inside, 32) == pytest.approx(3 * 2.5e-6 + received / 240e9)


def test_the_slowest_pipeline_stage_holds_the_extra_layers_or_the_output_head():
    from hybridflow.mapping.simulator import slowest_stage

    spec = model_spec("llama-13b")  # 40 layers, 32000 x 5120 output head
    layer, head = spec.params_per_layer, 32000 * 5120
    assert slowest_stage(spec, "lm", 1) == (spec.matmul_params(), 40)
    assert slowest_stage(spec, "lm", 8) == (5 * layer + head, 5)  # 5 layers each, the head on the last
    assert slowest_stage(spec, "lm", 16) == (3 * layer, 3)  # 3,3,...,2 + head: the first stages are slower
    assert slowest_stage(spec, "value", 8) == (5 * layer + 5121, 5)


def test_generation_runs_in_as_many_waves_as_the_kv_budget_requires():
    workload = Workload(prompts_per_step=64, prompt_length=100, response_length=28)
    simulator = Simulator(workload=workload, cluster=a100_cluster(2, 2))
    spec = model_spec("llama-7b")
    strategy = RoleStrategy(layout="3d", tp_size=2, generation_pp_size=1, generation_tp_size=1)
    per_sequence = 2 * 32 * 4096 * 128 * 2  # keys and values, every layer, 128 tokens, bf16
    assert simulator.kv_bytes_per_sequence(spec, strategy) == per_sequence
    # 2 replicas of 32 sequences; room for 10 at once -> 4 waves of 8
    seconds, details = simulator.generation_seconds(spec, strategy, 2, 10.5 * per_sequence)
    assert details == {"generation_waves": 4.0, "generation_batch": 8.0, "weight_load_seconds": 0.0}
    assert simulator.generation_seconds(spec, strategy, 2, 0.5 * per_sequence) is None
    # decoding streams the weights every step: it is memory-bound, so it beats compute-bound time
    decode_floor = 4 * 28 * spec.matmul_params() * 2 / (2.039e12 * 0.8)
    assert seconds > decode_floor


def test_generation_with_more_tensor_parallelism_is_faster_per_replica_when_memory_bound():
    workload = Workload(prompts_per_step=8, prompt_length=128, response_length=128)
    simulator = Simulator(workload=workload, cluster=a100_cluster(8))
    spec = model_spec("llama-13b")

    def seconds(tg: int) -> float:
        strategy = RoleStrategy(layout="3d", tp_size=8, generation_pp_size=1, generation_tp_size=tg)
        return simulator.generation_seconds(spec, strategy, tg, 60 * GIB)[0]

    assert seconds(8) < seconds(4) < seconds(2) < seconds(1)


# ---- composition and search ------------------------------------------------------------------
def _fake_cost(**stages: float) -> RoleCost:
    return RoleCost(strategy=RoleStrategy(layout="fsdp"), stage_seconds=stages, resident_bytes=0.0,
                    transient_bytes=0.0)


def test_iteration_time_sums_within_a_pool_maxes_across_pools_and_sums_stages():
    pools = (PoolPlan(name="a", roles=("actor", "reference"), devices_per_node=(4,)),
             PoolPlan(name="b", roles=("critic", "reward"), devices_per_node=(4,)))
    results = [
        SetResult(costs={"actor": _fake_cost(generation=10.0, preparation=3.0, training=5.0),
                         "reference": _fake_cost(preparation=2.0)}),
        SetResult(costs={"critic": _fake_cost(preparation=4.0, training=6.0), "reward": _fake_cost(preparation=1.5)}),
    ]
    combined = Planner._assemble(pools, results)
    assert combined.stage_seconds == {"generation": 10.0, "preparation": 5.5, "training": 6.0}
    assert combined.total_seconds == 21.5
    assert combined.pool_stage_seconds["a"] == {"generation": 10.0, "preparation": 5.0, "training": 5.0}


def test_search_returns_the_fastest_of_every_placement_and_allocation_it_enumerates():
    flow = dataflow("ppo")
    cluster = a100_cluster(16)
    planner = Planner(dataflow=flow, models=resolve_models(same_model("llama-7b")), workload=PAPER_WORKLOAD,
                      cluster=cluster)
    every = []
    for partition in set_partitions(list(PPO_ROLES)):
        sets = [tuple(block) for block in partition]
        minimums = [planner.min_devices(block) for block in sets]
        for allocation in planner.allocations(minimums):
            candidate = planner.plan_for(sets, allocation)
            if candidate is not None:
                every.append(candidate.total_seconds)
    best = plan("ppo", same_model("llama-7b"), PAPER_WORKLOAD, cluster, top=15)
    assert best.total_seconds == min(every)
    ranked = [best, *best.alternatives]
    assert len(ranked) == 15  # every placement of 4 models fits 16 A100s for 7B
    assert [p.total_seconds for p in ranked] == sorted(p.total_seconds for p in ranked)
    assert len({p.placement_label for p in ranked}) == 15


def test_allocations_use_every_device_and_respect_node_boundaries():
    flow = dataflow("ppo")
    planner = Planner(dataflow=flow, models=resolve_models(same_model("tiny")), workload=PAPER_WORKLOAD,
                      cluster=a100_cluster(16))
    allocations = list(planner.allocations([1, 1, 1]))
    assert all(sum(allocation) == 16 for allocation in allocations)
    assert (8, 4, 4) in allocations and (4, 8, 4) in allocations
    assert (6, 6, 4) not in allocations  # 6 is not a node-aligned pool size
    assert all(count in (1, 2, 4, 8, 16) for allocation in allocations for count in allocation)


@pytest.mark.parametrize("model, num_devices", [("llama-7b", 16), ("llama-13b", 32), ("llama-34b", 64)])
def test_planner_colocates_all_models_up_to_64_gpus_like_the_paper(model, num_devices):
    best = plan("ppo", same_model(model), PAPER_WORKLOAD, a100_cluster(num_devices), top=1)
    assert best.placement_label == "actor+critic+reference+reward"
    assert best.allocation_label == str(num_devices)


def test_actor_generation_sizes_divide_its_training_sizes_in_every_plan():
    best = plan("ppo", same_model("llama-13b"), PAPER_WORKLOAD, a100_cluster(32), top=15)
    for candidate in [best, *best.alternatives]:
        actor = candidate.strategies["actor"]
        assert actor.pp_size % actor.generation_pp_size == 0 and actor.tp_size % actor.generation_tp_size == 0
        for role, strategy in candidate.strategies.items():
            pool = candidate.pool_of(role)
            assert pool.num_devices % strategy.model_parallel_size == 0 and strategy.tp_size <= 8


# ---- plan <-> config ---------------------------------------------------------------------------
def test_plan_survives_a_round_trip_through_the_config_fragment():
    models = same_model("llama-7b")
    cluster = a100_cluster(32)
    best = plan("ppo", models, PAPER_WORKLOAD, cluster, top=15)
    for candidate in [best, *best.alternatives]:
        fragment = candidate.to_config_fragment()
        restored = Plan.from_config_fragment(json.loads(json.dumps(fragment)))
        assert restored == candidate.without_prediction()
        assert restored.to_config_fragment() == fragment
        assert simulate_plan(restored, "ppo", models, PAPER_WORKLOAD, cluster).stage_seconds == candidate.stage_seconds


def test_config_fragment_uses_the_shared_placement_and_engine_keys():
    fragment = Plan(
        pools=(PoolPlan(name="actor_reference", roles=("actor", "reference"), devices_per_node=(8, 8)),
               PoolPlan(name="critic_reward", roles=("critic", "reward"), devices_per_node=(8,))),
        strategies={"actor": RoleStrategy(layout="3d", pp_size=2, tp_size=4, generation_pp_size=1,
                                          generation_tp_size=2),
                    "reference": RoleStrategy(layout="fsdp"), "critic": RoleStrategy(layout="3d", tp_size=2),
                    "reward": RoleStrategy(layout="fsdp")},
    ).to_config_fragment()
    assert fragment == {
        "placement": {"pools": {"actor_reference": [8, 8], "critic_reward": [8]},
                      "roles": {"actor": "actor_reference", "reference": "actor_reference",
                                "critic": "critic_reward", "reward": "critic_reward"}},
        "actor": {"engine": {"layout": "3d", "pp_size": 2, "tp_size": 4}, "hybrid_engine": {"pp_size": 1, "tp_size": 2}},
        "reference": {"engine": {"layout": "fsdp", "pp_size": 1, "tp_size": 1}},
        "critic": {"engine": {"layout": "3d", "pp_size": 1, "tp_size": 2}},
        "reward": {"engine": {"layout": "fsdp", "pp_size": 1, "tp_size": 1}},
    }


def test_config_fragment_with_bad_values_is_rejected():
    with pytest.raises(ValueError, match="needs placement.pools and placement.roles"):
        Plan.from_config_fragment({"actor": {}})
    with pytest.raises(ValueError, match="generation tp_size 3 must divide"):
        Plan.from_config_fragment({"placement": {"pools": {"p": [4]}, "roles": {"actor": "p"}},
                                   "actor": {"engine": {"layout": "3d", "tp_size": 4},
                                             "hybrid_engine": {"tp_size": 3}}})
    with pytest.raises(ValueError, match=r"missing from placement.pools \['p'\]"):
        Plan.from_config_fragment({"placement": {"pools": {"p": [4]}, "roles": {"actor": "q"}}})


def test_simulating_a_layout_that_does_not_fit_its_pool_is_rejected():
    layout = Plan.from_config_fragment({
        "placement": {"pools": {"all": [8]}, "roles": {role: "all" for role in PPO_ROLES}},
        "actor": {"engine": {"layout": "3d", "tp_size": 2}, "hybrid_engine": {"tp_size": 2}}})
    with pytest.raises(ValueError, match="does not fit in 8 devices"):
        simulate_plan(layout, "ppo", same_model("llama-13b"), PAPER_WORKLOAD, a100_cluster(8))


# ---- hardware profiles -----------------------------------------------------------------------
def test_builtin_hardware_profiles_load_and_unknown_ones_are_listed():
    assert load_hardware("h100-80g").peak_flops == 989e12
    assert load_hardware("h200").device_memory_gib == 140
    with pytest.raises(ValueError, match="known: a100-80g, h100-80g, h200, cpu-local"):
        load_hardware("tpu-v5")


def test_profile_files_with_unknown_fields_or_bad_values_are_rejected(tmp_path):
    data = load_hardware("a100-80g").to_dict()
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data | {"tflops": 1}))
    with pytest.raises(ValueError, match=r"unknown hardware profile fields \['tflops'\]"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match=r"flops_fraction must be in \(0, 1\], got 1.5"):
        HardwareProfile(**(data | {"flops_fraction": 1.5}))
    path.write_text(json.dumps(data | {"flops_fraction": 1.5}))
    with pytest.raises(ValueError, match=rf"{path}: HardwareProfile.flops_fraction must be in"):
        load_hardware(str(path))


def test_profile_files_missing_fields_or_not_json_name_the_file_and_the_fields(tmp_path):
    data = load_hardware("a100-80g").to_dict()
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({key: value for key, value in data.items() if key not in ("peak_flops", "name")}))
    missing = r"hardware profile lacks the required fields \['name', 'peak_flops'\]"
    with pytest.raises(ValueError, match=rf"{path}: {missing}"):
        load_hardware(str(path))
    path.write_text('{"name": "gpu", "peak_flops": 1e15,}')
    with pytest.raises(ValueError, match=rf"hardware profile {path} is not valid JSON: .* at line 1 column"):
        load_hardware(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{path}: a hardware profile must be a JSON object of fields, got list"):
        load_hardware(str(path))
    # fields added later have defaults, so profiles written before them still load
    older = {key: value for key, value in data.items() if key != "decode_host_seconds_per_sequence"}
    path.write_text(json.dumps(older))
    assert load_hardware(str(path)).decode_host_seconds_per_sequence == 0.0


def test_cpu_local_profile_asks_for_calibration_until_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="run `hybridflow calibrate` on a machine without a GPU first"):
        load_hardware("cpu-local")


def test_oversubscribed_cpu_processes_share_the_cores():
    profile = HardwareProfile(**(load_hardware("a100-80g").to_dict() | {"compute_units_per_node": 2}))
    cpu = Cluster(num_devices=4, devices_per_node=4, hardware=profile)
    assert (cpu.compute_share(4), cpu.compute_share(2), cpu.compute_share(1)) == (0.5, 1.0, 1.0)
    assert a100_cluster(16).compute_share(16) == 1.0
    assert math.isclose(Simulator(workload=PAPER_WORKLOAD, cluster=cpu, compute_share=0.5).flops, 312e12 * 0.5 * 0.5)


def test_only_the_processes_busy_in_a_stage_compete_for_the_cores():
    profile = HardwareProfile(**(load_hardware("a100-80g").to_dict() | {"compute_units_per_node": 2}))
    cluster = Cluster(num_devices=4, devices_per_node=4, hardware=profile)
    flow = dataflow("ppo")
    planner = Planner(dataflow=flow, models=resolve_models(same_model("tiny")), workload=PAPER_WORKLOAD,
                      cluster=cluster)
    standalone = [("actor",), ("critic",), ("reference",), ("reward",)]
    # generation: the actor's 1 process; preparation: all 4 on 2 cores; training: actor + critic
    assert planner.stage_shares(standalone, [1, 1, 1, 1]) == (1.0, 0.5, 1.0)
    assert planner.stage_shares([PPO_ROLES], [4]) == (0.5, 0.5, 0.5)
    alone = planner.plan_for(standalone, [1, 1, 1, 1])
    crowded = Simulator(workload=PAPER_WORKLOAD, cluster=cluster, compute_share=0.5)
    spec, strategy = model_spec("tiny"), alone.strategies["reference"]
    assert alone.role_stage_seconds["reference"]["preparation"] == crowded.inference_seconds(spec, "lm", strategy, 1)
    full = Simulator(workload=PAPER_WORKLOAD, cluster=cluster)
    critic_strategy = alone.strategies["critic"]
    assert alone.role_stage_seconds["critic"]["training"] == full.training_seconds(spec, "value", critic_strategy, 1)


# ---- predicted vs measured ranking -----------------------------------------------------------
def test_spearman_correlation_matches_hand_computed_values():
    from hybridflow.mapping import spearman_correlation

    assert spearman_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair in each half: 1 - 6 * (1+1+1+1) / (5 * 24) = 0.8
    assert spearman_correlation([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # ties share ranks: [1.5, 1.5, 3] vs [1, 2, 3] -> 1.5 / sqrt(1.5 * 2)
    assert spearman_correlation([7, 7, 9], [1, 2, 3]) == pytest.approx(1.5 / math.sqrt(3.0))
    with pytest.raises(ValueError, match="need equal lengths"):
        spearman_correlation([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="undefined when all predicted or all measured values are equal"):
        spearman_correlation([1, 1, 1], [1, 2, 3])


def test_measured_validation_ranks_the_benchmark_layouts_against_their_predictions(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_mapping.py"
    loader = importlib.util.spec_from_file_location("bench_mapping", script)
    bench = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(bench)
    path = tmp_path / "measured.json"
    bench.write_template(str(path), "a100-80g")
    spec = json.loads(path.read_text())
    assert len(spec["runs"]) >= 4
    predicted = bench.predict(spec)
    assert [round(value, 6) for value in predicted] == [run["predicted_seconds"] for run in spec["runs"]]
    for run, value in zip(spec["runs"], predicted):
        run["measured_seconds"] = 1000.0 - value  # the exact reverse order
    path.write_text(json.dumps(spec))
    assert bench.validate_measured(str(path)) == pytest.approx(-1.0)
    for run, value in zip(spec["runs"], predicted):
        run["measured_seconds"] = 3 * value + 1
    path.write_text(json.dumps(spec))
    assert bench.validate_measured(str(path)) == pytest.approx(1.0)
    assert f"Spearman rank correlation over {len(predicted)} runs: 1.000" in capsys.readouterr().out


def test_the_stored_measurements_of_this_machine_still_rank_as_docs_mapping_md_says(capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the runs file names its profile and model by paths from the repository root
    loader = importlib.util.spec_from_file_location("bench_mapping", root / "benchmarks" / "bench_mapping.py")
    bench = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(bench)
    # replicate d (7 tiny-PPO layouts on 1-4 CPU processes) against the cpu-local profile of calibration run c
    rho = bench.validate_measured(str(root / "benchmarks" / "mapping" / "tiny_ppo_runs_d.json"))
    assert round(rho, 3) == 0.883
    printed = capsys.readouterr().out
    assert "standalone-1-1-1-1                 0.1426       0.454" in printed  # the predicted and measured best
    # replicate g: the same layouts after worker threads became a share of the node's cores over all pools
    rho = bench.validate_measured(str(root / "benchmarks" / "mapping" / "tiny_ppo_runs_g.json"))
    assert round(rho, 3) == 0.883
    assert "standalone-1-1-1-1                 0.1426       0.286" in capsys.readouterr().out
    # replicates h (the small model) and j (the built-in one), 12 layouts on 1-8 processes, against calibration i
    rho = bench.validate_measured(str(root / "benchmarks" / "mapping" / "small_ppo_runs_h.json"),
                                  "benchmarks/mapping/cpu_run_i.json")
    assert round(rho, 3) == 0.930
    assert "standalone-1-1-1-1                 0.2190       0.328" in capsys.readouterr().out
    rho = bench.validate_measured(str(root / "benchmarks" / "mapping" / "tiny_ppo_runs_j.json"))
    assert round(rho, 3) == 0.968
    assert "standalone-1-1-1-1                 0.0816       0.159" in capsys.readouterr().out
    # replicate k: the small model in bf16 on a bf16 host, against its calibration with and without the bf16 rate
    rho = bench.validate_measured(str(root / "benchmarks" / "mapping" / "small_ppo_runs_k.json"),
                                  "benchmarks/mapping/cpu_run_k.json")
    assert round(rho, 3) == 0.909
    assert "standalone-1-1-1-1                 0.1026       0.334" in capsys.readouterr().out
    rho = bench.validate_measured(str(root / "benchmarks" / "mapping" / "small_ppo_runs_k.json"),
                                  "benchmarks/mapping/cpu_run_k_fp32_only.json")
    assert round(rho, 3) == 0.853


def test_safe_rlhf_searches_the_52_placements_of_its_five_models():
    models = same_model("llama-7b", roles=("actor", "critic", "reference", "reward", "cost"))
    best = plan("safe-rlhf", models, PAPER_WORKLOAD, a100_cluster(32), top=60)
    ranked = [best, *best.alternatives]
    assert len({candidate.placement_label for candidate in ranked}) == len(ranked) == 52
    assert set(best.to_config_fragment()["placement"]["roles"]) == {"actor", "critic", "reference", "reward", "cost"}


def test_layouts_split_the_batch_evenly_or_the_planner_says_why():
    best = plan("ppo", same_model("llama-7b"), Workload(prompts_per_step=96, prompt_length=512, response_length=512,
                                                        mini_batch_size=32), a100_cluster(32), top=15)
    for candidate in [best, *best.alternatives]:
        for role, strategy in candidate.strategies.items():
            dp_size = strategy.dp_size(candidate.pool_of(role).num_devices)
            assert 96 % dp_size == 0
            if role in ("actor", "critic"):
                assert 32 % dp_size == 0
        actor = candidate.strategies["actor"]
        replicas = candidate.pool_of("actor").num_devices // (actor.generation_pp_size * actor.generation_tp_size)
        assert 96 % replicas == 0
    with pytest.raises(ValueError, match="role 'actor' \\(tiny\\) has no layout on 128 devices that splits the batch"):
        plan("ppo", same_model("tiny"), Workload(prompts_per_step=4, prompt_length=8, response_length=8),
             a100_cluster(128))


# ---- the paper's findings (section 8.3, figures 12, 13 and 15; docs/mapping.md has the table) ----
@pytest.mark.parametrize("model, num_devices", [("llama-13b", 16), ("llama-13b", 32), ("llama-13b", 64),
                                                ("llama-34b", 32), ("llama-34b", 64)])
def test_with_eight_ppo_updates_the_planner_colocates_everything_up_to_64_gpus_like_the_paper(model, num_devices):
    best = plan("ppo", same_model(model), PAPER_PPO, a100_cluster(num_devices), top=2)
    assert best.placement_label == "actor+critic+reference+reward"
    # the split runner-up loses in generation: the actor gets half the devices
    runner_up = best.alternatives[0]
    assert runner_up.stage_seconds["generation"] > best.stage_seconds["generation"]


def test_13b_on_96_gpus_colocates_with_padded_generation_and_splits_only_when_replicas_must_divide_the_prompts():
    # the trainer pads the prompts over the generation replicas (the default): colocating all 96 GPUs
    # generates with 96 / 4 = 24 replicas, 43 prompts each (8 padding prompts in all), and wins, against the paper
    best = plan("ppo", same_model("llama-13b"), PAPER_PPO, a100_cluster(96), top=15)
    assert best.placement_label == "actor+critic+reference+reward"
    actor = best.strategies["actor"]
    assert 1024 % (96 // (actor.generation_pp_size * actor.generation_tp_size)) != 0
    paper = next(p for p in best.alternatives if p.placement_label == "actor+reference | critic+reward")
    assert paper.allocation_label == "48|48" and paper.strategies["actor"].generation_pp_size == 1
    # with replicas dividing the 1024 prompts (the planner before the trainer padded), a 96-GPU pool
    # generates pipelined or with fewer replicas, and actor and critic go to separate devices, as in the paper
    even = plan("ppo", same_model("llama-13b"), replace(PAPER_PPO, pad_generation=False), a100_cluster(96), top=1)
    assert even.pool_of("actor") != even.pool_of("critic")


def test_34b_on_128_gpus_splits_actor_and_critic_over_two_halves_like_the_paper():
    best = plan("ppo", same_model("llama-34b"), PAPER_PPO, a100_cluster(128), top=15)
    assert best.allocation_label == "64|64"
    assert best.pool_of("actor") != best.pool_of("critic")
    # each half takes one of the two inference models; the paper's pairing (actor+reference) is within 0.2%
    assert {len(pool.roles) for pool in best.pools} == {2}
    paper = next(p for p in best.alternatives if p.placement_label == "actor+reference | critic+reward")
    assert paper.allocation_label == "64|64" and paper.total_seconds < 1.002 * best.total_seconds
    colocated = next(p for p in best.alternatives if len(p.pools) == 1)
    # it wins in training, where actor and critic update side by side instead of one after the other
    assert best.stage_seconds["training"] < colocated.stage_seconds["training"]


def _generation_seconds_with_tg(model: str, tg: int) -> float:
    """Figure 15's setting: 16 GPUs, all four models colocated, each 3d 1-8-2, the actor generating with tg."""
    strategies = {role: RoleStrategy(layout="3d", pp_size=1, tp_size=8) for role in PPO_ROLES}
    strategies["actor"] = RoleStrategy(layout="3d", pp_size=1, tp_size=8, generation_pp_size=1,
                                       generation_tp_size=tg)
    layout = Plan(pools=(PoolPlan(name="all", roles=PPO_ROLES, devices_per_node=(8, 8)),), strategies=strategies)
    simulated = simulate_plan(layout, "ppo", same_model(model), PAPER_PPO, a100_cluster(16))
    return simulated.stage_seconds["generation"]


def test_generation_tp_sweep_of_figure_15_is_fastest_at_tg_2_for_7b_and_tg_4_for_13b_slower_on_both_sides():
    seconds_7b = {tg: _generation_seconds_with_tg("llama-7b", tg) for tg in (1, 2, 4, 8)}
    seconds_13b = {tg: _generation_seconds_with_tg("llama-13b", tg) for tg in (1, 2, 4, 8)}
    assert min(seconds_7b, key=seconds_7b.get) == 2
    assert min(seconds_13b, key=seconds_13b.get) == 4
    assert max(seconds_7b, key=seconds_7b.get) == 8  # one replica's host work per step grows with its batch
    assert seconds_13b[8] > seconds_13b[4]
    # below the best tg nothing is gained: each GPU needs a larger share of the KV cache
    assert seconds_13b[1] > seconds_13b[2] > seconds_13b[4]


def test_decode_pays_the_host_time_of_every_sequence_of_a_replica_per_generated_token():
    workload = Workload(prompts_per_step=64, prompt_length=100, response_length=28)
    spec = model_spec("llama-7b")
    strategy = RoleStrategy(layout="3d", tp_size=2, generation_pp_size=1, generation_tp_size=1)
    per_sequence = 2 * 32 * 4096 * 128 * 2
    hardware = load_hardware("a100-80g")
    seconds = {}
    for host in (0.0, 1e-4):
        cluster = Cluster(num_devices=2, devices_per_node=2,
                          hardware=HardwareProfile(**(hardware.to_dict() | {"decode_host_seconds_per_sequence": host})))
        seconds[host] = Simulator(workload=workload, cluster=cluster).generation_seconds(
            spec, strategy, 2, 10.5 * per_sequence)[0]
    # 4 waves of 8 sequences, 28 decode steps each
    assert seconds[1e-4] - seconds[0.0] == pytest.approx(4 * 28 * 8 * 1e-4)


def test_plans_may_generate_with_less_tensor_parallelism_than_they_train_with():
    best = plan("ppo", same_model("llama-13b"), PAPER_PPO, a100_cluster(128), top=1)
    actor = best.strategies["actor"]
    assert actor.generation_tp_size < actor.tp_size


def test_colocated_layouts_are_chosen_jointly_so_the_actor_keeps_room_for_its_kv_cache():
    planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(same_model("llama-13b")),
                      workload=PAPER_PPO, cluster=a100_cluster(32))
    joint = planner.set_result(PPO_ROLES, 32)
    joint_seconds = sum(cost.total_seconds for cost in joint.costs.values())
    # greedy: every other role takes its fastest layout, the actor the memory that is left
    fastest = [planner.candidates(role, 32)[0] for role in PPO_ROLES[1:]]
    greedy_actor = planner.best_actor(32, sum(c.resident_bytes for c in fastest), max(c.transient_bytes
                                                                                        for c in fastest))
    greedy_seconds = greedy_actor.total_seconds + sum(cost.total_seconds for cost in fastest)
    assert joint_seconds < 0.95 * greedy_seconds
    assert joint.costs["actor"].stage_seconds["generation"] < greedy_actor.stage_seconds["generation"]
    # and no combination of the roles' candidate layouts that fits does better
    import itertools

    for combo in itertools.product(*(planner.candidates(role, 32) for role in PPO_ROLES[1:])):
        actor = planner.best_actor(32, sum(c.resident_bytes for c in combo), max(c.transient_bytes for c in combo))
        if actor is not None:
            assert actor.total_seconds + sum(c.total_seconds for c in combo) >= joint_seconds - 1e-9


def test_small_micro_batches_lose_efficiency_to_streaming_the_weight_shard():
    # 16-token sequences, one per micro-batch: 2 x 16 FLOPs per weight element read, below the A100's
    # 156e12 / 1.63e12 = 96 FLOPs per byte, so each pass is bound by reading the shard (twice more backward)
    workload = Workload(prompts_per_step=8, prompt_length=8, response_length=8)
    simulator = Simulator(workload=workload, cluster=a100_cluster(1, 1))
    spec = model_spec("llama-7b")
    shard_bytes = spec.matmul_params() * 2
    bandwidth = 2.039e12 * 0.8
    strategy = RoleStrategy(layout="3d")
    assert simulator.inference_seconds(spec, "lm", strategy, 1) == pytest.approx(8 * shard_bytes / bandwidth)
    assert simulator.training_seconds(spec, "lm", strategy, 1) == pytest.approx(8 * 3 * shard_bytes / bandwidth)
    # long sequences are compute-bound again (the existing single-device test): efficiency recovers
    long = Simulator(workload=PAPER_WORKLOAD, cluster=a100_cluster(1, 1))
    per_token = 2 * (spec.matmul_params() + 32 * 4096 * 2048)
    assert long.inference_seconds(spec, "lm", strategy, 1) == pytest.approx(1024 * 2048 * per_token / 156e12)


def test_a_replica_given_a_padded_share_of_prompts_generates_all_samples_of_each_of_its_prompts():
    # 3 prompts x 2 samples on 2 replicas: the dispatch pads the prompts to 4 and each replica samples its
    # 2 prompts twice, 4 sequences (not ceil(6 / 2) = 3): as long as 4 prompts x 2 samples
    spec = model_spec("llama-7b")
    strategy = RoleStrategy(layout="3d", tp_size=2, generation_pp_size=1, generation_tp_size=1)
    per_sequence = 2 * 32 * 4096 * 128 * 2

    def generation(prompts: int, samples: int) -> dict[str, float]:
        workload = Workload(prompts_per_step=prompts, samples_per_prompt=samples, prompt_length=100,
                            response_length=28)
        return Simulator(workload=workload, cluster=a100_cluster(2, 2)).generation_seconds(
            spec, strategy, 2, 10.5 * per_sequence)

    assert generation(3, 2) == generation(4, 2)
    assert generation(3, 2)[1]["generation_batch"] == 4.0
    assert generation(6, 1)[1]["generation_batch"] == 3.0


def test_padded_batches_let_a_48_gpu_pool_generate_without_pipeline_stages():
    # 1024 prompts on 48 GPUs: generation replicas 48 / (pg tg) divide 1024 only with pg tg a multiple of 3
    # (pg = 3, pipelined decoding); padding the batch (the paper's system had to) allows pg = 1
    sets, allocation = [("actor", "reference"), ("critic", "reward")], (48, 48)
    for pad_uneven, pipelined in ((False, True), (True, False)):
        workload = replace(PAPER_PPO, pad_uneven=pad_uneven, pad_generation=False)
        planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(same_model("llama-13b")),
                          workload=workload, cluster=a100_cluster(96))
        actor = planner.plan_for(sets, allocation).strategies["actor"]
        replicas = 48 // (actor.generation_pp_size * actor.generation_tp_size)
        assert (actor.generation_pp_size > 1) == pipelined
        assert (1024 % replicas == 0) == (not pad_uneven)
    with pytest.raises(ValueError, match="Workload.pad_uneven must be True or False, got 'yes'"):
        replace(PAPER_PPO, pad_uneven="yes")


def test_the_trainer_refuses_a_plan_with_padded_training_splits_and_accepts_padded_or_even_generation():
    from hybridflow.trainers.auto_mapping import apply_plan, workload_of
    from hybridflow.trainers.config.rl import load_rl_config

    config = load_rl_config(None, ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic",
                                   "reward.model.builtin=arithmetic", "placement.pools={cluster: [4]}",
                                   "batch.prompts_per_step=16", "batch.mini_batch_size=16"])
    padded = replace(workload_of(config), pad_uneven=True)
    chosen = plan("ppo", same_model("tiny"), padded, Cluster(num_devices=4, devices_per_node=4,
                                                             hardware=load_hardware("a100-80g")))
    with pytest.raises(ValueError, match="the plan was made for .*pad_uneven=True"):
        apply_plan(config, replace(chosen, workload=padded))
    assert workload_of(config).pad_generation  # the trainer pads the prompts over the generation replicas
    for pad_generation in (True, False):
        workload = replace(workload_of(config), pad_generation=pad_generation)
        assert apply_plan(config, replace(chosen, workload=workload)).placement.mapping == "manual"


def test_the_trainer_builds_the_96_gpu_plan_whose_generation_replicas_do_not_divide_the_prompts():
    from hybridflow.trainers.auto_mapping import apply_plan
    from hybridflow.trainers.config.rl import load_rl_config

    config = load_rl_config(None, ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic",
                                   "reward.model.builtin=arithmetic", "placement.pools={cluster: [8]}",
                                   "batch.prompts_per_step=1024", "batch.mini_batch_size=128"])
    best = plan("ppo", same_model("llama-13b"), PAPER_PPO, a100_cluster(96))
    placed = apply_plan(config, replace(best, workload=None))  # its 96 devices; validated as a whole RLConfig
    assert placed.placement.pool_size("actor_critic_reference_reward") == 96
    derived = placed.derived()
    assert derived.generation_replicas == 24 and -1024 % derived.generation_replicas == 8  # 8 padding prompts
    assert all(derived.samples_per_step % size == 0 for size in derived.dp_sizes.values())


def test_padding_only_the_prompts_lets_a_48_gpu_pool_generate_unpipelined_while_training_splits_stay_even():
    # the controller's generation dispatch pads the prompts over the replicas (repeated rows, dropped
    # again); Workload.pad_generation plans for that while every data-parallel split stays even
    sets, allocation = [("actor", "reference"), ("critic", "reward")], (48, 48)
    generation = {}
    for pad_generation in (False, True):
        workload = replace(PAPER_PPO, pad_generation=pad_generation)
        planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(same_model("llama-13b")),
                          workload=workload, cluster=a100_cluster(96))
        chosen = planner.plan_for(sets, allocation)
        actor = chosen.strategies["actor"]
        replicas = 48 // (actor.generation_pp_size * actor.generation_tp_size)
        assert (actor.generation_pp_size == 1) == pad_generation
        assert (1024 % replicas == 0) == (not pad_generation)
        for role, strategy in chosen.strategies.items():
            assert 1024 % strategy.dp_size(48) == 0
            if role in ("actor", "critic"):
                assert 128 % strategy.dp_size(48) == 0
        generation[pad_generation] = chosen.stage_seconds["generation"]
    assert generation[True] < 0.5 * generation[False]  # no token crosses three pipeline stages one after another
    with pytest.raises(ValueError, match="Workload.pad_generation must be True or False, got 1"):
        replace(PAPER_PPO, pad_generation=1)


def test_an_eager_decode_step_takes_at_least_the_hosts_launches_of_every_layer():
    workload = Workload(prompts_per_step=64, prompt_length=100, response_length=28)
    spec = model_spec("llama-7b")
    strategy = RoleStrategy(layout="3d", tp_size=2, generation_pp_size=1, generation_tp_size=1)
    hardware = load_hardware("a100-80g").to_dict() | {"decode_host_seconds_per_sequence": 0.0}
    per_sequence = 2 * 32 * 4096 * 128 * 2

    def generation(dispatch: float) -> tuple[float, dict]:
        profile = HardwareProfile(**(hardware | {"decode_dispatch_seconds_per_layer": dispatch}))
        cluster = Cluster(num_devices=2, devices_per_node=2, hardware=profile)
        return Simulator(workload=workload, cluster=cluster).generation_seconds(spec, strategy, 2, 10.5 * per_sequence)

    device_bound, details = generation(0.0)
    assert generation(1e-9)[0] == pytest.approx(device_bound)  # a floor below the device time changes nothing
    # 10 ms per layer: every pass (the prefill and each of the 28 decode steps) takes 32 layers x 10 ms
    assert generation(0.01)[0] == pytest.approx(details["generation_waves"] * 29 * 32 * 0.01)
    with pytest.raises(ValueError, match="decode_dispatch_seconds_per_layer must be >= 0 seconds"):
        HardwareProfile(**(hardware | {"decode_dispatch_seconds_per_layer": -1.0}))


# ---- allocation granularity: whole nodes plus part of one ------------------------------------
def test_divisor_granularity_adds_pools_of_whole_nodes_plus_a_divisor_of_a_node_packed_first_fit():
    cluster = a100_cluster(16)
    assert cluster.device_counts("node") == [1, 2, 4, 8, 16]
    assert cluster.device_counts("divisor") == [1, 2, 4, 8, 9, 10, 12, 16]
    assert cluster.pool_nodes(12) == [8, 4] and cluster.pool_nodes(16) == [8, 8] and cluster.pool_nodes(4) == [4]
    planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(same_model("llama-13b")), workload=PAPER_PPO,
                      cluster=cluster, granularity="divisor")
    allocations = list(planner.allocations([1, 1]))
    assert (12, 4) in allocations and (4, 12) in allocations and (10, 6) not in allocations  # 6: no divisor of 8
    assert (8, 8) in allocations and all(sum(allocation) == 16 for allocation in allocations)
    # 12 GPUs: a node of its own and half of another, whose other half holds the 4-GPU pool
    split = planner.plan_for([("actor", "critic", "reference"), ("reward",)], (12, 4))
    assert [pool.devices_per_node for pool in split.pools] == [(8, 4), (4,)]
    assert split.allocation_label == "12|4"
    # each pool's whole nodes are its own; the parts share nodes, largest first
    wide = a100_cluster(24)
    assert wide.fits_nodes([12, 12]) and wide.fits_nodes([12, 4, 4, 4]) and wide.fits_nodes([20, 2, 2])
    assert not wide.fits_nodes([12, 6, 6])  # 4 + 6 + 6 parts need three nodes; one is left
    assert not wide.fits_nodes([12, 8])  # 4 devices unused


def test_node_granularity_keeps_pools_above_a_node_to_whole_nodes():
    planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(same_model("llama-13b")), workload=PAPER_PPO,
                      cluster=a100_cluster(16))
    assert planner.granularity == "node"
    assert all(count in (1, 2, 4, 8, 16) for allocation in planner.allocations([1, 1]) for count in allocation)


@pytest.mark.parametrize("num_devices", [12, 20, 48])
def test_the_link_model_sees_a_group_leave_its_node_exactly_when_the_rank_layout_puts_it_on_two(num_devices):
    from hybridflow.mapping.strategy import training_strategies
    from hybridflow.parallel.layout import ParallelLayout

    cluster = a100_cluster(48)
    simulator = Simulator(workload=PAPER_PPO, cluster=cluster)
    node_of = {rank: node for node, count in enumerate(cluster.pool_nodes(num_devices))
               for rank in range(8 * node, 8 * node + count)}
    assert sorted(node_of) == list(range(num_devices))  # whole nodes first, then the part: rank // 8

    def crosses(groups: list[list[int]]) -> bool:
        return any(len({node_of[rank] for rank in group}) > 1 for group in groups)

    spans = set()
    for strategy in training_strategies(model_spec("llama-7b"), num_devices=num_devices, node_size=8):
        if strategy.layout == "fsdp":
            continue
        layout = ParallelLayout.for_world(num_devices, pp_size=strategy.pp_size, tp_size=strategy.tp_size)
        assert simulator.crosses_nodes(strategy.tp_size, num_devices) is crosses(layout.tp_groups()) is False
        assert simulator.crosses_nodes(strategy.model_parallel_size, num_devices) == crosses(layout.pp_groups())
        if strategy.dp_size(num_devices) > 1:
            assert simulator.crosses_nodes(num_devices, num_devices) is crosses(layout.dp_groups()) is True
        spans.add((strategy.model_parallel_size, crosses(layout.pp_groups())))
    # a pipeline shorter than a node whose span does not divide it (6 ranks on 12 and 48, 5 on 20) crosses
    # between ranks 7 and 8; one of 4 ranks never does
    assert any(span < 8 and 8 % span and crossed for span, crossed in spans) and (4, False) in spans


def test_a_pipeline_across_the_shared_node_sends_over_the_inter_node_link():
    simulator = Simulator(workload=PAPER_PPO, cluster=a100_cluster(16))
    intra, inter = 300e9 * 0.8, 25e9 / 8 * 0.8
    assert simulator.send_seconds(1e6, 6, 12) == pytest.approx(1e-5 + 1e6 / inter)  # ranks 6-11 of [8, 4]
    assert simulator.send_seconds(1e6, 4, 12) == pytest.approx(2.5e-6 + 1e6 / intra)  # ranks 8-11: the part
    assert simulator.send_seconds(1e6, 6, 6) == pytest.approx(2.5e-6 + 1e6 / intra)  # a 6-GPU pool: one node
    assert simulator.all_reduce_seconds(1e9, 3, 12, num_devices=12) == pytest.approx(4 * 1e-5 + 4 / 3 * 1e9 / inter)


@pytest.mark.parametrize("model, num_devices, granularity", [("llama-7b", 16, "divisor"), ("llama-13b", 40, "divisor"),
                                                              ("llama-34b", 48, "node"), ("tiny", 8, "divisor")])
def test_branch_and_bound_picks_the_allocation_the_exhaustive_enumeration_picks(model, num_devices, granularity):
    cluster = a100_cluster(num_devices)
    if model == "tiny":  # CPU processes sharing 2 cores: the bound ignores sharing, which only slows a stage
        profile = HardwareProfile(**(load_hardware("a100-80g").to_dict() | {"compute_units_per_node": 2}))
        cluster = Cluster(num_devices=8, devices_per_node=4, hardware=profile)
    planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(same_model(model)), workload=PAPER_PPO,
                      cluster=cluster, granularity=granularity)
    compared = 0
    for partition in set_partitions(list(PPO_ROLES)):
        sets = [tuple(block) for block in partition]
        minimums = [planner.min_devices(block) for block in sets]
        if None in minimums:
            continue
        timed = [(seconds, allocation) for allocation in planner.allocations(minimums)
                 for seconds in [planner.total_seconds_of(sets, allocation)] if seconds is not None]
        assert planner.best_allocation(sets, minimums) == (min(timed)[1] if timed else None)
        compared += bool(timed)
    assert compared >= 10


def test_plan_granularity_option_searches_the_finer_pools_and_refuses_an_unknown_value(capsys):
    from hybridflow.mapping.cli import plan_main

    argv = ["--actor", "llama-13b", "--critic", "llama-13b", "--devices", "16", "--prompt-len", "1024",
            "--response-len", "1024", "--batch", "1024", "--mini-batch", "128", "--top", "15"]
    assert plan_main(argv) == 0
    assert "12|4" not in capsys.readouterr().out
    assert plan_main(argv + ["--granularity", "divisor"]) == 0
    printed = capsys.readouterr().out
    assert any("actor+critic+reference | reward" in line and " 12|4 " in line for line in printed.splitlines())
    assert plan_main(argv + ["--granularity", "gpu"]) == 2
    error = capsys.readouterr().err
    assert "--granularity" in error and "node, divisor" in error and "'gpu'" in error
    with pytest.raises(ValueError, match="granularity .* must be one of node, divisor, got 'nodes'"):
        plan("ppo", same_model("llama-13b"), PAPER_PPO, a100_cluster(16), granularity="nodes")


def test_the_trainer_builds_a_plan_with_a_pool_of_a_node_and_half_of_another():
    from hybridflow.trainers.auto_mapping import apply_plan
    from hybridflow.trainers.config.rl import load_rl_config

    config = load_rl_config(None, ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic",
                                   "reward.model.builtin=arithmetic", "placement.pools={cluster: [8, 8]}",
                                   "batch.prompts_per_step=1024", "batch.mini_batch_size=128"])
    planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(same_model("llama-13b")), workload=PAPER_PPO,
                      cluster=a100_cluster(16), granularity="divisor")
    split = planner.plan_for([("actor", "critic", "reference"), ("reward",)], (12, 4))
    placed = apply_plan(config, split)
    assert placed.placement.pools == {"actor_critic_reference": [8, 4], "reward": [4]}
    derived = placed.derived()  # validated as a whole RLConfig: the 12-GPU pool's layouts split the batch
    assert all(derived.samples_per_step % size == 0 for size in derived.dp_sizes.values())
    assert split.strategies["actor"].tp_size in (1, 2, 4)  # t divides the part of a node: TP stays in a node


def test_the_planner_costs_the_actors_old_log_prob_forward_only_where_the_trainer_runs_it():
    from hybridflow.trainers.auto_mapping import workload_of
    from hybridflow.trainers.config.rl import load_rl_config

    base = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score",
            "algorithm.advantage_estimator=grpo", "placement.pools={cluster: [2]}", "batch.prompts_per_step=8",
            "batch.samples_per_prompt=4"]
    one_update = workload_of(load_rl_config(None, base + ["batch.mini_batch_size=32", "algorithm.kl_mode=loss"]))
    assert not one_update.actor_log_prob_pass  # one epoch of one mini-batch, the KL in the loss: skipped
    for kept in (["batch.mini_batch_size=16"], ["batch.mini_batch_size=32", "algorithm.kl_mode=reward"],
                 ["batch.mini_batch_size=32", "actor.loss.old_log_probs=recompute"]):
        assert workload_of(load_rl_config(None, base + kept)).actor_log_prob_pass, kept
    assert not workload_of(load_rl_config(None, base + ["batch.mini_batch_size=16",
                                                        "actor.loss.old_log_probs=rollout"])).actor_log_prob_pass
    cluster = Cluster(num_devices=2, devices_per_node=2, hardware=load_hardware("a100-80g"))
    models = same_model("tiny", roles=("actor", "reference", "reward"))
    layout = replace(plan("grpo", models, one_update, cluster), alternatives=())
    runs, skips = (simulate_plan(layout, "grpo", models, replace(one_update, actor_log_prob_pass=flag), cluster)
                   for flag in (True, False))
    assert skips.role_stage_seconds["actor"]["preparation"] == 0.0
    assert runs.role_stage_seconds["actor"]["preparation"] > 0.0
    assert skips.role_stage_seconds["reference"]["preparation"] == runs.role_stage_seconds["reference"]["preparation"]
    assert skips.total_seconds < runs.total_seconds
