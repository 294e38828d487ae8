"""The planner's overlap model (docs/async.md, "Placement"): splits with a rollout pool of their own, pipelined with
staleness k, against the synchronous placements; and ``placement.mapping=auto`` turning the choice into a config.

The choice is tested on constructed stage costs (the simulator's stage functions replaced by simple formulas), so
each expected step time is computed here from the model's composition rules, not copied from a run."""

from __future__ import annotations

import pytest

from hybridflow.data.builtin import ASSETS_DIR
from hybridflow.mapping import Cluster, Dataflow, Plan, Workload, load_hardware, model_spec, plan, simulate_plan
from hybridflow.mapping import overlap
from hybridflow.mapping.hardware import HardwareProfile
from hybridflow.mapping.plan import ROLLOUT_ROLE, OverlapSeconds
from hybridflow.mapping.simulator import Simulator
from hybridflow.trainers.config.rl import ROLLOUT_ROLE as CONFIG_ROLLOUT_ROLE, load_rl_config

ACTOR_ONLY = Dataflow(name="grpo", roles={"actor": "actor"})
MODELS = {"actor": str(ASSETS_DIR)}
WORKLOAD = Workload(prompts_per_step=16, prompt_length=32, response_length=24, samples_per_prompt=4)


def _cluster(num_devices: int = 2, **profile_changes) -> Cluster:
    hardware = HardwareProfile(**(load_hardware("a100-80g").to_dict() | profile_changes))
    return Cluster(num_devices=num_devices, devices_per_node=num_devices, hardware=hardware)


def _constructed_costs(monkeypatch, *, floor: float, generation: float, preparation: float, training: float,
                       send: float = 0.0, receive: float = 0.0) -> None:
    """Generation takes ``floor`` plus ``generation`` split over the replicas; scoring and training split over the
    data-parallel ranks; no resharding; a weight sync costs ``send`` on the trainer and ``receive`` on a replica."""
    def generation_seconds(self, spec, strategy, num_devices, kv_budget_bytes):
        replicas = num_devices // (strategy.generation_pp_size * strategy.generation_tp_size)
        return floor + generation / replicas, {}

    monkeypatch.setattr(Simulator, "generation_seconds", generation_seconds)
    monkeypatch.setattr(Simulator, "inference_seconds", lambda self, spec, head, strategy, n: preparation
                        / strategy.dp_size(n))
    monkeypatch.setattr(Simulator, "training_seconds", lambda self, spec, head, strategy, n: training
                        / strategy.dp_size(n))
    monkeypatch.setattr(Simulator, "transition_seconds", lambda self, spec, strategy, n: 0.0)
    monkeypatch.setattr(overlap, "weight_sync_seconds", lambda simulator, spec, **sizes: (send, receive))


def _by_mode(best: Plan) -> dict[str, Plan]:
    found: dict[str, Plan] = {}
    for candidate in (best, *best.alternatives):
        found.setdefault(candidate.mode, candidate)
    return found


def test_an_overlapped_step_takes_the_slower_side_and_a_turn_taking_step_the_sum():
    parts = OverlapSeconds(receive=0.1, generation=2.0, send=0.2, preparation=0.5, training=1.0)
    assert parts.rollout == pytest.approx(2.1) and parts.trainer == pytest.approx(1.7)
    assert parts.step(1) == parts.step(3) == pytest.approx(2.1)
    assert parts.step(0) == pytest.approx(3.8)


def test_with_generation_and_training_balanced_the_planner_splits_off_a_rollout_pool_generating_ahead(monkeypatch):
    costs = dict(floor=0.6, generation=0.4, preparation=0.2, training=0.8, send=0.05, receive=0.05)
    _constructed_costs(monkeypatch, **costs)
    best = plan(ACTOR_ONLY, MODELS, WORKLOAD, _cluster(2), max_staleness=1)
    # colocated on 2 devices: every stage on both, one after another (generation by 2 replicas)
    colocated = costs["floor"] + costs["generation"] / 2 + costs["preparation"] / 2 + costs["training"] / 2
    # split 1 | 1: one replica generates while one process scores and trains
    rollout_side = costs["receive"] + costs["floor"] + costs["generation"]
    trainer_side = costs["send"] + costs["preparation"] + costs["training"]
    modes = _by_mode(best)
    assert best.mode == "split async k=1"
    assert max(rollout_side, trainer_side) < colocated
    assert best.total_seconds == pytest.approx(max(rollout_side, trainer_side))
    assert modes["colocated"].total_seconds == pytest.approx(colocated)
    assert modes["split sync rollout"].total_seconds == pytest.approx(rollout_side + trainer_side)
    assert best.allocation_label == "1|1" and best.rollout_pool.num_devices == 1
    assert best.overlap == OverlapSeconds(receive=0.05, generation=1.0, send=0.05, preparation=0.2, training=0.8)
    assert "chosen: split async k=1" in best.describe() and "colocated" in best.reason()
    fragment = best.to_config_fragment()
    assert fragment["placement"]["roles"] == {"actor": "actor", "rollout": "rollout"}
    assert fragment["async"] == {"max_staleness": 1} and "hybrid_engine" not in fragment["actor"]


def test_when_generation_dominates_the_planner_keeps_the_colocated_synchronous_step(monkeypatch):
    costs = dict(floor=0.1, generation=4.0, preparation=0.1, training=0.2)
    _constructed_costs(monkeypatch, **costs)
    best = plan(ACTOR_ONLY, MODELS, WORKLOAD, _cluster(2), max_staleness=1)
    colocated = costs["floor"] + costs["generation"] / 2 + costs["preparation"] / 2 + costs["training"] / 2
    overlapped = max(costs["floor"] + costs["generation"], costs["preparation"] + costs["training"])
    assert colocated < overlapped
    assert best.mode == "colocated" and best.total_seconds == pytest.approx(colocated)
    assert _by_mode(best)["split async k=1"].total_seconds == pytest.approx(overlapped)
    assert "async" not in best.to_config_fragment()


def test_without_a_staleness_bound_the_planner_never_proposes_a_rollout_pool(monkeypatch):
    _constructed_costs(monkeypatch, floor=0.6, generation=0.4, preparation=0.2, training=0.8)
    best = plan(ACTOR_ONLY, MODELS, WORKLOAD, _cluster(2))
    assert all(candidate.rollout_pool is None for candidate in (best, *best.alternatives))
    assert best.reason() == ""  # the synchronous search prints what it printed before


def test_the_plan_keeps_the_users_staleness_bound_and_the_pipeline_pace_does_not_depend_on_it(monkeypatch):
    _constructed_costs(monkeypatch, floor=0.6, generation=0.4, preparation=0.2, training=0.8)
    one = plan(ACTOR_ONLY, MODELS, WORKLOAD, _cluster(2), max_staleness=1)
    three = plan(ACTOR_ONLY, MODELS, WORKLOAD, _cluster(2), max_staleness=3)
    assert (one.max_staleness, three.max_staleness) == (1, 3)
    assert three.total_seconds == pytest.approx(one.total_seconds)


def test_on_a_cpu_node_the_overlapping_pools_share_its_cores():
    """Two processes on one core: while the loops overlap each runs at half speed; taking turns, at full speed."""
    def replica_seconds(cores: int, max_staleness: int) -> float:
        best = plan(ACTOR_ONLY, MODELS, WORKLOAD, _cluster(2, compute_units_per_node=cores),
                    max_staleness=max(max_staleness, 1))
        chosen = next(candidate for candidate in (best, *best.alternatives)
                      if candidate.rollout_pool is not None and candidate.max_staleness == max_staleness)
        return chosen.overlap.generation

    assert replica_seconds(1, 1) == pytest.approx(2 * replica_seconds(2, 1))
    assert replica_seconds(1, 0) == pytest.approx(replica_seconds(2, 1))


def test_a_plan_with_a_rollout_pool_round_trips_through_its_config_fragment_with_the_same_prediction():
    best = plan(ACTOR_ONLY, MODELS, WORKLOAD, _cluster(4), max_staleness=1)
    for candidate in (best, *best.alternatives):
        if candidate.rollout_pool is None:
            continue
        layout = Plan.from_config_fragment(candidate.to_config_fragment())
        assert (layout.rollout_pool, layout.max_staleness) == (candidate.rollout_pool, candidate.max_staleness)
        again = simulate_plan(layout, ACTOR_ONLY, MODELS, WORKLOAD, _cluster(4))
        assert again.total_seconds == pytest.approx(candidate.total_seconds)
        assert again.overlap == candidate.overlap


def test_the_weight_sync_crosses_once_to_every_node_of_the_rollout_pool_and_not_at_all_inside_one():
    simulator = Simulator(workload=WORKLOAD, cluster=_cluster(8))
    spec = model_spec("llama-7b")
    send, local = overlap.weight_sync_seconds(simulator, spec, actor_devices=4, remote_nodes=0)
    _, two_nodes = overlap.weight_sync_seconds(simulator, spec, actor_devices=4, remote_nodes=2)
    payload = spec.num_params(head="lm") * 2  # bf16
    bandwidth, latency = simulator.link(True)
    assert local == pytest.approx(overlap.PAYLOAD_PASSES * payload / simulator.memory_bandwidth)
    assert two_nodes - local == pytest.approx(2 * (latency + payload / (8 * bandwidth)))
    assert send > local  # the same passes, after the gather over the actor's 4 devices


# ---- the trainer's config ------------------------------------------------------------------------------
BASE = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score",
        "algorithm.advantage_estimator=grpo", "batch.samples_per_prompt=4", "batch.prompts_per_step=8",
        "batch.mini_batch_size=32", "placement.pools={cluster: [2]}", "placement.mapping=auto",
        "placement.hardware=a100-80g"]


@pytest.mark.parametrize("staleness", [1, 2])
def test_auto_mapping_gives_the_trainer_a_rollout_pool_and_the_users_staleness_when_overlap_wins(
        monkeypatch, staleness):
    from hybridflow.trainers.auto_mapping import resolve_auto_mapping

    _constructed_costs(monkeypatch, floor=1.0, generation=0.2, preparation=0.1, training=0.4)
    config = load_rl_config(None, BASE + [f"async.max_staleness={staleness}"])
    resolved, chosen = resolve_auto_mapping(config)  # resolved is an RLConfig: built, hence validated
    assert ROLLOUT_ROLE == CONFIG_ROLLOUT_ROLE  # the planner sits below the config and names the role itself
    assert chosen.mode == f"split async k={staleness}"
    assert resolved.placement.mapping == "manual" and resolved.placement.rollout_pool == "rollout"
    assert resolved.asynchrony.max_staleness == staleness
    assert {role: resolved.placement.pool_of(role) for role in config.active_roles} == {
        role: pool.name for pool in chosen.pools for role in pool.roles}
    assert sum(resolved.placement.pool_size(pool) for pool in resolved.placement.pools) == 2


def test_auto_mapping_runs_synchronously_when_the_colocated_step_wins_whatever_bound_was_allowed(monkeypatch):
    from hybridflow.trainers.auto_mapping import resolve_auto_mapping

    _constructed_costs(monkeypatch, floor=0.1, generation=4.0, preparation=0.1, training=0.2)
    resolved, chosen = resolve_auto_mapping(load_rl_config(None, BASE + ["async.max_staleness=1"]))
    assert chosen.rollout_pool is None
    assert resolved.placement.rollout_pool is None and resolved.asynchrony.max_staleness == 0


def test_auto_mapping_refuses_a_hand_placed_rollout_pool_and_async_options_a_rollout_pool_cannot_run():
    with pytest.raises(ValueError, match="placement.mapping got 'auto'.*leave roles.rollout out"):
        load_rl_config(None, BASE + ["placement.pools={a: [1], b: [1]}", "placement.roles={actor: a, rollout: b}"])
    with pytest.raises(ValueError, match="algorithm.dynamic_sampling got True"):
        load_rl_config(None, BASE + ["async.max_staleness=1", "algorithm.dynamic_sampling=true"])
    load_rl_config(None, BASE + ["algorithm.dynamic_sampling=true"])  # k = 0: the synchronous search only


def test_hybridflow_plan_weighs_rollout_pools_with_max_staleness_and_writes_the_async_keys(tmp_path, capsys):
    import yaml

    from hybridflow.mapping.cli import plan_main

    argv = ["--algorithm", "grpo", "--actor", "llama-7b", "--reward", "none", "--devices", "16", "--prompt-len",
            "1024", "--response-len", "1024", "--batch", "256", "--samples-per-prompt", "4", "--mini-batch", "256",
            "--hardware", "a100-80g"]
    assert plan_main(argv) == 0
    assert "(k=" not in capsys.readouterr().out  # without --max-staleness: the paper's search only
    path = tmp_path / "plan.yaml"
    assert plan_main(argv + ["--max-staleness", "1", "--write", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "chosen: " in printed and "(k=1)" in printed
    fragment = yaml.safe_load(path.read_text())
    written = Plan.from_config_fragment(fragment)
    assert written.max_staleness == (1 if written.rollout_pool is not None else 0)
    assert plan_main(argv + ["--max-staleness", "-1"]) == 2
    assert "max_staleness (async.max_staleness) must be an integer >= 0, got -1" in capsys.readouterr().err
