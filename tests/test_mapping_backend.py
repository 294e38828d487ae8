"""The planner's model of the actor's rollout backend (actor.generation.backend: native or vllm)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.mapping import Cluster, Plan, RoleStrategy, Workload, load_hardware, model_spec, plan, simulate_plan
from hybridflow.mapping.cli import plan_main
from hybridflow.mapping.dataflow import dataflow
from hybridflow.mapping.hardware import HardwareProfile
from hybridflow.mapping.rollout import NATIVE, ROLLOUT_BACKENDS, VLLM, rollout_backend
from hybridflow.mapping.search import Planner, resolve_models
from hybridflow.mapping.simulator import Simulator

PPO_ROLES = ("actor", "critic", "reference", "reward")
TP1 = RoleStrategy(layout="3d", tp_size=2, generation_pp_size=1, generation_tp_size=1)


def a100_cluster(num_devices: int, per_node: int = 8, **changes) -> Cluster:
    hardware = load_hardware("a100-80g")
    if changes:
        hardware = HardwareProfile(**(hardware.to_dict() | changes))
    return Cluster(num_devices=num_devices, devices_per_node=per_node, hardware=hardware)


def simulators(workload: Workload, cluster: Cluster) -> tuple[Simulator, Simulator]:
    return (Simulator(workload=workload, cluster=cluster, backend=NATIVE),
            Simulator(workload=workload, cluster=cluster, backend=VLLM))


def test_the_planner_knows_exactly_the_backends_the_generation_config_accepts():
    from hybridflow.engine.generation_config import BACKENDS

    assert tuple(ROLLOUT_BACKENDS) == BACKENDS
    assert rollout_backend("vllm") is VLLM and rollout_backend(NATIVE) is NATIVE


def test_a_paged_cache_fits_more_sequences_per_wave_so_long_responses_generate_faster():
    # 128-token prompts, 896-token responses: a preallocated row holds 1024 positions, a paged one 576 on average
    workload = Workload(prompts_per_step=64, prompt_length=128, response_length=896)
    native, vllm = simulators(workload, a100_cluster(2, 2))
    spec = model_spec("llama-7b")
    per_sequence = 2 * 32 * 4096 * 1024 * 2  # keys and values of a whole sequence, every layer, bf16
    assert native.kv_bytes_per_sequence(spec, TP1) == vllm.kv_bytes_per_sequence(spec, TP1) == per_sequence
    budget = 10.5 * per_sequence
    native_seconds, native_details = native.generation_seconds(spec, TP1, 2, budget)
    vllm_seconds, vllm_details = vllm.generation_seconds(spec, TP1, 2, budget)
    # 2 replicas of 32 sequences: native 10 rows at once -> 4 waves of 8; paged 10.5 * 1024 / 576 = 18 -> 2 of 16
    assert (native_details["generation_waves"], native_details["generation_batch"]) == (4.0, 8.0)
    assert (vllm_details["generation_waves"], vllm_details["generation_batch"]) == (2.0, 16.0)
    assert vllm_seconds < 0.6 * native_seconds
    # both need room for one whole sequence (vLLM refuses to start with less)
    assert native.generation_seconds(spec, TP1, 2, 0.9 * per_sequence) is None
    assert vllm.generation_seconds(spec, TP1, 2, 0.9 * per_sequence) is None


def test_with_room_for_every_sequence_vllm_costs_exactly_its_weight_load_more():
    workload = Workload(prompts_per_step=8, prompt_length=64, response_length=64)
    native, vllm = simulators(workload, a100_cluster(2, 2))
    spec = model_spec("llama-7b")
    native_seconds, native_details = native.generation_seconds(spec, TP1, 2, 40e9)
    vllm_seconds, vllm_details = vllm.generation_seconds(spec, TP1, 2, 40e9)
    assert native_details["generation_waves"] == vllm_details["generation_waves"] == 1.0
    # one read and one write of the bf16 generation shard (the whole model at tg = 1) at 80% of 2039 GB/s
    load = 2 * spec.num_params(head="lm") * 2 / (2.039e12 * 0.8)
    assert vllm_details["weight_load_seconds"] == pytest.approx(load)
    assert native_details["weight_load_seconds"] == 0.0
    assert vllm_seconds == pytest.approx(native_seconds + load)


def test_vllms_own_weight_copy_leaves_less_room_for_the_kv_cache():
    spec = model_spec("llama-7b")
    workload = Workload(prompts_per_step=64, prompt_length=128, response_length=896)
    strategy = RoleStrategy(layout="3d", tp_size=4, generation_pp_size=1, generation_tp_size=2)
    shard = spec.num_params(head="lm") * 2 / 2  # bf16 generation shard at tg = 2
    native, vllm = simulators(workload, a100_cluster(4, 4))
    assert native.generation_extra_bytes(spec, strategy) == pytest.approx(shard)  # the cast generation shard
    assert vllm.generation_extra_bytes(spec, strategy) == pytest.approx(2 * shard)  # + vLLM's copy, loaded into
    # fp32: the native engine uses the training shard in place (only the gathered half is extra); vLLM still
    # holds a whole copy of its own
    fp32 = a100_cluster(4, 4, compute_dtype="fp32")
    native32, vllm32 = simulators(workload, fp32)
    shard32 = spec.num_params(head="lm") * 4 / 2
    assert native32.generation_extra_bytes(spec, strategy) == pytest.approx(shard32 / 2)
    assert vllm32.generation_extra_bytes(spec, strategy) == pytest.approx(shard32 / 2 + shard32)
    # the actor's cost next to colocated roles: the KV budget is what the two copies leave
    others = 30e9
    native_cost = native.role_cost(kind="actor", spec=spec, head="lm", strategy=strategy, num_devices=4,
                                   other_resident_bytes=others)
    vllm_cost = vllm.role_cost(kind="actor", spec=spec, head="lm", strategy=strategy, num_devices=4,
                               other_resident_bytes=others)
    kv_native = native.budget_bytes - others - native_cost.resident_bytes - shard
    kv_vllm = kv_native - shard
    per_sequence = native.kv_bytes_per_sequence(spec, strategy)
    replicas_sequences = 64 // 2
    assert native_cost.details["generation_batch"] == pytest.approx(
        replicas_sequences / -(-replicas_sequences // int(kv_native // per_sequence)))
    assert vllm_cost.details["generation_batch"] == pytest.approx(
        replicas_sequences / -(-replicas_sequences // int(kv_vllm // (per_sequence * (128 + 448) / 1024))))


def test_the_native_engines_own_decode_bandwidth_slows_only_the_native_backend():
    workload = Workload(prompts_per_step=8, prompt_length=64, response_length=64)
    spec = model_spec("llama-7b")
    plain_native, plain_vllm = simulators(workload, a100_cluster(2, 2))
    slow_native, slow_vllm = simulators(workload, a100_cluster(2, 2, native_decode_bandwidth_fraction=0.2))
    assert slow_native.generation_seconds(spec, TP1, 2, 40e9)[0] > 3 * plain_native.generation_seconds(spec, TP1, 2,
                                                                                                     40e9)[0]
    assert slow_vllm.generation_seconds(spec, TP1, 2, 40e9) == plain_vllm.generation_seconds(spec, TP1, 2, 40e9)
    with pytest.raises(ValueError, match=r"HardwareProfile.native_decode_bandwidth_fraction must be in \(0, 1\] "
                                         r"or null .* got 1.5"):
        a100_cluster(2, 2, native_decode_bandwidth_fraction=1.5)


def test_with_vllm_the_actor_generates_with_tg_and_pg_one_and_the_plan_records_the_backend():
    workload = Workload(prompts_per_step=1024, prompt_length=1024, response_length=1024, mini_batch_size=128)
    models = {role: "llama-7b" for role in PPO_ROLES}
    planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(models), workload=workload,
                      cluster=a100_cluster(16), backend="vllm")
    generation_sizes = {(s.generation_pp_size, s.generation_tp_size) for s in planner._strategies("actor", 16)}
    assert generation_sizes == {(1, 1)}
    chosen = plan("ppo", models, workload, a100_cluster(16), backend="vllm", top=3)
    assert chosen.backend == "vllm" and all(alternative.backend == "vllm" for alternative in chosen.alternatives)
    actor = chosen.strategies["actor"]
    assert (actor.generation_pp_size, actor.generation_tp_size) == (1, 1)
    fragment = chosen.to_config_fragment()
    assert fragment["actor"]["generation"] == {"backend": "vllm"}
    assert Plan.from_config_fragment(fragment) == chosen.without_prediction()
    # the native plan generates tensor-parallel (tg = 2, docs/mapping.md) and records native
    native = plan("ppo", models, workload, a100_cluster(16), top=1)
    assert native.backend == "native" and native.strategies["actor"].generation_tp_size > 1
    # the same layout simulated for vllm is refused, naming the backend and the sizes
    with pytest.raises(ValueError, match=r"actor.generation.backend='vllm' generates with hybrid_engine pp_size = "
                                         r"tp_size = 1 only, got pp_size=1, tp_size=2"):
        simulate_plan(native, "ppo", models, workload, a100_cluster(16), backend="vllm")
    # a plan read back from its fragment is simulated for the backend it names
    again = simulate_plan(Plan.from_config_fragment(chosen.to_config_fragment()), "ppo", models, workload,
                          a100_cluster(16))
    assert again.backend == "vllm" and again.total_seconds == pytest.approx(chosen.total_seconds)


def test_a_backend_the_project_does_not_have_is_refused_naming_the_field_and_the_choices(tmp_path, capsys):
    workload = Workload(prompts_per_step=16, prompt_length=32, response_length=32)
    models = {role: "tiny" for role in PPO_ROLES}
    message = r"actor.generation.backend must be one of \('native', 'vllm'\), got 'sglang'"
    with pytest.raises(ValueError, match=message):
        plan("ppo", models, workload, a100_cluster(4, 4), backend="sglang")
    with pytest.raises(ValueError, match=message):
        Plan.from_config_fragment({"placement": {"pools": {"all": [1]}, "roles": {"actor": "all"}},
                                   "actor": {"hybrid_engine": {"tp_size": 1}, "generation": {"backend": "sglang"}}})
    argv = ["--actor", "tiny", "--critic", "tiny", "--devices", "4", "--per-node", "4", "--prompt-len", "32",
            "--response-len", "32", "--batch", "16", "--backend", "sglang"]
    assert plan_main(argv) == 2
    assert "--backend (actor.generation.backend) must be one of native, vllm, got 'sglang'" in capsys.readouterr().err


def test_plan_with_the_vllm_flag_writes_the_backend_into_the_fragment_and_its_header(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    argv = ["--actor", "tiny", "--critic", "tiny", "--devices", "4", "--per-node", "4", "--prompt-len", "32",
            "--response-len", "32", "--batch", "16", "--backend", "vllm", "--write", str(out)]
    assert plan_main(argv) == 0
    assert "vllm rollout" in capsys.readouterr().out
    text = out.read_text()
    assert ", rollout backend vllm\n" in text.splitlines(keepends=True)[1]
    assert Plan.from_config_fragment(__import__("yaml").safe_load(text)).backend == "vllm"


def test_the_trainer_refuses_a_plan_made_for_another_rollout_backend():
    from hybridflow.trainers.auto_mapping import apply_plan, workload_of
    from hybridflow.trainers.config.rl import load_rl_config

    config = load_rl_config(None, ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic",
                                   "reward.model.builtin=arithmetic", "placement.pools={cluster: [4]}",
                                   "batch.prompts_per_step=16", "batch.mini_batch_size=16"])
    assert config.actor.generation.backend == "native"
    chosen = replace(plan("ppo", {role: "tiny" for role in PPO_ROLES}, workload_of(config),
                          Cluster(num_devices=4, devices_per_node=4, hardware=load_hardware("a100-80g")),
                          backend="vllm"), workload=workload_of(config))
    with pytest.raises(ValueError, match="the plan was made for actor.generation.backend='vllm', not this run's "
                                         "'native'"):
        apply_plan(config, chosen)
    assert apply_plan(config, replace(chosen, backend="native")).placement.mapping == "manual"


def test_a_model_too_large_for_one_gpu_has_no_vllm_plan_and_the_error_says_why():
    workload = Workload(prompts_per_step=1024, prompt_length=1024, response_length=1024, mini_batch_size=128)
    models = {role: "llama-34b" for role in PPO_ROLES}
    with pytest.raises(ValueError, match=r"role 'actor' \(llama-34b.*does not fit on 64 devices.*"
                                         r"actor.generation.backend='vllm' generates with tg = pg = 1"):
        plan("ppo", models, workload, a100_cluster(64), backend="vllm")
    assert plan("ppo", models, workload, a100_cluster(64), top=1).backend == "native"


def test_a_fixed_kv_cache_size_bounds_the_batch_and_must_fit_in_the_memory_left():
    workload = Workload(prompts_per_step=64, prompt_length=128, response_length=896)
    models = {role: "llama-7b" for role in PPO_ROLES}
    cluster = a100_cluster(8)
    sets, allocation = [("actor", "critic", "reference", "reward")], (8,)

    def actor_details(kv_cache_gib):
        planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(models), workload=workload,
                          cluster=cluster, backend="vllm", kv_cache_gib=kv_cache_gib)
        result = planner.set_result(sets[0], allocation[0])
        return None if result is None else result.costs["actor"].details

    unbounded = actor_details(None)
    # 1 GiB (the config's default) holds 1 GiB / (0.5 MiB per token x 576 tokens on average) = 3 sequences at tg 1
    one_gib = actor_details(1.0)
    per_token = 2 * 32 * 4096 * 2  # keys and values of one token, every layer, bf16, tg = 1
    assert int(2**30 // (per_token * 576)) == 3
    # 8 replicas of 8 sequences, 3 at once: 3 waves of 3
    assert (one_gib["generation_waves"], one_gib["generation_batch"]) == (3.0, 3.0)
    assert one_gib["generation_waves"] > unbounded["generation_waves"]
    # more than the colocated roles leave: the pool does not fit (vLLM would run out of memory)
    assert actor_details(70.0) is None
    with pytest.raises(ValueError, match=r"kv_cache_gib \(actor.generation.vllm_kv_cache_gib\) must be a number > 0 "
                                         r"or None \(all memory left\), got -1"):
        plan("ppo", models, workload, cluster, backend="vllm", kv_cache_gib=-1)


def test_auto_mapping_plans_for_the_configs_backend_and_its_vllm_kv_cache(monkeypatch):
    import importlib.util

    from hybridflow.trainers import auto_mapping
    from hybridflow.trainers.config.rl import load_rl_config

    # the config refuses backend=vllm where vLLM is not installed; the planner itself does not need it
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "vllm" else real_find_spec(name, *args))
    calls = []
    import hybridflow.mapping

    def recording_plan(*args, **kwargs):
        calls.append(kwargs)
        return hybridflow.mapping.search.plan(*args, **kwargs)

    monkeypatch.setattr(hybridflow.mapping, "plan", recording_plan)  # auto_mapping imports it when it runs
    base = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.model.builtin=arithmetic",
            "placement.pools={cluster: [4]}", "placement.mapping=auto", "placement.hardware=a100-80g",
            "batch.prompts_per_step=16", "batch.mini_batch_size=16"]
    resolved, chosen = auto_mapping.resolve_auto_mapping(load_rl_config(None, [
        *base, "actor.generation.backend=vllm", "actor.generation.vllm_kv_cache_gib=0.5"]))
    assert calls[-1]["backend"] == "vllm" and calls[-1]["kv_cache_gib"] == 0.5
    assert chosen.backend == "vllm"
    assert (resolved.actor.hybrid_engine.pp_size, resolved.actor.hybrid_engine.tp_size) == (1, 1)
    _, native = auto_mapping.resolve_auto_mapping(load_rl_config(None, base))
    assert calls[-1]["backend"] == "native" and calls[-1]["kv_cache_gib"] is None
    assert native.backend == "native"


def test_the_backend_registry_says_which_kv_cache_the_planner_is_given():
    from hybridflow.engine.generation_config import GenerationConfig
    from hybridflow.engine.rollout import rollout_backend as engine_backend

    generation = GenerationConfig(vllm_kv_cache_gib=3.5)
    assert engine_backend("vllm").kv_cache_gib(generation) == 3.5  # vLLM allocates exactly this
    assert engine_backend("native").kv_cache_gib(generation) is None  # the native cache takes what is left
