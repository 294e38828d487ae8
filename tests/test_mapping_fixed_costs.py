"""The planner's fixed costs per call (hardware profile terms that `hybridflow calibrate` measures on CPU): each one
adds exactly what docs/mapping.md says, where it says, and nothing when it is 0 (every built-in GPU profile).

Each expected difference is computed here from the documented rule (per step, per call, per collective), against
the same simulation with the term at 0, so a change of where a term is charged fails the test."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hybridflow.calibrate import intercept
from hybridflow.data.builtin import ASSETS_DIR
from hybridflow.mapping import Cluster, Dataflow, Plan, Workload, load_hardware, model_spec, simulate_plan
from hybridflow.mapping.hardware import FIXED_COST_FIELDS, builtin_profile_names
from hybridflow.mapping.simulator import Simulator
from hybridflow.mapping.strategy import RoleStrategy

ROOT = Path(__file__).resolve().parents[1]
SPEC = model_spec(str(ASSETS_DIR))
WORKLOAD = Workload(prompts_per_step=16, prompt_length=16, response_length=24, samples_per_prompt=4)
CPU = load_hardware(str(ROOT / "benchmarks" / "mapping" / "cpu_run_k_fp32_only.json"))
GRPO = Dataflow(name="grpo", roles={"actor": "actor", "reference": "inference"})
MODELS = {"actor": str(ASSETS_DIR), "reference": str(ASSETS_DIR)}


def _simulator(workload: Workload = WORKLOAD, **changes) -> Simulator:
    cluster = Cluster(num_devices=2, devices_per_node=2, hardware=replace(CPU, **changes))
    return Simulator(workload=workload, cluster=cluster)


def _simulated(fragment: dict, **changes) -> Plan:
    cluster = Cluster(num_devices=2, devices_per_node=2, hardware=replace(CPU, **changes))
    return simulate_plan(Plan.from_config_fragment(fragment), GRPO, MODELS, WORKLOAD, cluster)


COLOCATED = {"placement": {"pools": {"cluster": [2]}, "roles": {"actor": "cluster", "reference": "cluster"}},
             "actor": {"engine": {"layout": "fsdp"}, "hybrid_engine": {"pp_size": 1, "tp_size": 1}},
             "reference": {"engine": {"layout": "fsdp"}}}
SPLIT = {"placement": {"pools": {"trainer": [1], "gen": [1]},
                       "roles": {"actor": "trainer", "reference": "trainer", "rollout": "gen"}},
         "async": {"max_staleness": 1}, "actor": {"engine": {"layout": "fsdp"}},
         "reference": {"engine": {"layout": "fsdp"}}}


def test_every_built_in_gpu_profile_has_no_fixed_costs_so_the_papers_predictions_are_unchanged():
    for name in builtin_profile_names():
        profile = load_hardware(name)
        assert all(getattr(profile, field) == 0.0 for field in FIXED_COST_FIELDS), name


def test_a_fixed_cost_must_be_a_non_negative_number_of_seconds():
    for field in FIXED_COST_FIELDS:
        with pytest.raises(ValueError, match=f"HardwareProfile.{field} must be >= 0 seconds, got -0.001"):
            replace(CPU, **{field: -0.001})


def test_the_decode_step_overhead_is_paid_by_the_prefill_and_by_every_decode_step():
    strategy = RoleStrategy(layout="fsdp", generation_pp_size=1, generation_tp_size=1)
    budget = 1e9  # one wave

    def seconds(**changes) -> float:
        return _simulator(**changes).generation_seconds(SPEC, strategy, 2, budget)[0]

    assert seconds(decode_step_overhead_s=0.002) - seconds() == pytest.approx((WORKLOAD.response_length + 1) * 0.002)


@pytest.mark.parametrize("mini_batch_size, updates", [(0, 1), (16, 4)])
def test_an_inference_call_pays_its_overhead_once_and_training_once_per_update(mini_batch_size, updates):
    strategy = RoleStrategy(layout="fsdp")
    workload = replace(WORKLOAD, mini_batch_size=mini_batch_size)
    assert workload.updates_per_step == updates
    base = _simulator(workload)
    loaded = _simulator(workload, inference_call_overhead_s=0.003, update_overhead_s=0.01)
    assert loaded.inference_seconds(SPEC, "lm", strategy, 1) - base.inference_seconds(SPEC, "lm", strategy, 1) \
        == pytest.approx(0.003)
    assert loaded.training_seconds(SPEC, "lm", strategy, 1) - base.training_seconds(SPEC, "lm", strategy, 1) \
        == pytest.approx(updates * 0.01)


def test_fsdp_pays_its_host_cost_per_unit_and_collective_on_two_ranks_and_nothing_on_one():
    strategy = RoleStrategy(layout="fsdp")
    units = SPEC.num_layers + 1
    # 16 sequences of 40 tokens per micro-batch: 32 per rank on 2 ranks make 2 micro-batches
    workload = replace(WORKLOAD, micro_batch_tokens=16 * WORKLOAD.sequence_length)
    base, loaded = _simulator(workload), _simulator(workload, fsdp_collective_overhead_s=0.001)
    # per micro-batch a gather per unit forward (two with backward), per update a reduce-scatter per unit
    for num_devices, forward, update in ((1, 0, 0), (2, 2 * units, 2 * 2 * units + units)):
        assert loaded.inference_seconds(SPEC, "lm", strategy, num_devices) \
            - base.inference_seconds(SPEC, "lm", strategy, num_devices) == pytest.approx(forward * 0.001)
        assert loaded.training_seconds(SPEC, "lm", strategy, num_devices) \
            - base.training_seconds(SPEC, "lm", strategy, num_devices) == pytest.approx(update * 0.001)


def test_every_stage_call_of_a_role_and_every_call_of_a_split_pays_the_controllers_cost():
    call = {"controller_call_overhead_s": 0.005}
    colocated, colocated_calls = _simulated(COLOCATED), _simulated(COLOCATED, **call)
    # generation: the actor; preparation: the actor's and the reference's log-probs; training: the actor
    expected = {"generation": 0.005, "preparation": 0.010, "training": 0.005}
    for stage, added in expected.items():
        assert colocated_calls.stage_seconds[stage] - colocated.stage_seconds[stage] == pytest.approx(added), stage
    split, split_calls = _simulated(SPLIT), _simulated(SPLIT, **call)
    for part, added in (("send", 0.005), ("receive", 0.005), ("generation", 0.005), ("preparation", 0.010),
                        ("training", 0.005)):
        assert getattr(split_calls.overlap, part) - getattr(split.overlap, part) == pytest.approx(added), part


def test_calibrate_takes_the_fixed_cost_as_the_line_through_two_sizes_at_zero():
    assert intercept(0.03, 0.1, 2, 16) == pytest.approx(0.02)
    assert intercept(0.05, 0.05, 2, 16) == pytest.approx(0.05)
