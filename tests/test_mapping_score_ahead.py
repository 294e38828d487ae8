"""The planner's splits with frozen scorers on the rollout pool (docs/async.md, "Scoring ahead on the rollout pool"):
the plan's validation and config fragment, the overlap model moving the scorers' seconds from the trainer's side to
the rollout pool's, the search's choice between the plain split and scoring ahead, and ``placement.mapping=auto``.

The choice is tested on constructed stage costs (tests/test_mapping_async.py's ``_constructed_costs``), so each
expected step time is computed here from the model's composition rules; the moved seconds are compared with the
plain split's own numbers from the same planner."""

from __future__ import annotations

import pytest

from hybridflow.data.builtin import ASSETS_DIR
from hybridflow.mapping import Dataflow, Plan, PoolPlan, RoleStrategy, plan, simulate_plan
from hybridflow.mapping.dataflow import DATAFLOWS
from hybridflow.mapping.overlap import scoring_ahead_roles
from hybridflow.mapping.plan import ROLLOUT_ROLE, SCORING_AHEAD_ROLES
from hybridflow.trainers.config.rl import SCORING_AHEAD_ROLES as CONFIG_SCORING_AHEAD_ROLES, load_rl_config
from tests.test_mapping_async import BASE, WORKLOAD, _by_mode, _cluster, _constructed_costs

GRPO = Dataflow(name="grpo", roles={"actor": "actor", "reference": "inference"})
MODELS = {"actor": str(ASSETS_DIR), "reference": str(ASSETS_DIR)}
FSDP = RoleStrategy(layout="fsdp")


def _split(rollout_roles: tuple[str, ...], *, max_staleness: int = 1) -> Plan:
    """The actor on a pool of one device beside a rollout pool of one holding ``rollout_roles``."""
    trainer_roles = tuple(role for role in MODELS if role not in rollout_roles)
    return Plan(pools=(PoolPlan(name="trainer", roles=trainer_roles, devices_per_node=(1,)),),
                strategies={role: FSDP for role in MODELS},
                rollout_pool=PoolPlan(name="gen", roles=rollout_roles, devices_per_node=(1,)),
                max_staleness=max_staleness)


def _candidates(best: Plan) -> list[Plan]:
    return [best, *best.alternatives]


# ---- the plan ------------------------------------------------------------------------------------------
def test_the_planner_names_the_scorers_the_trainer_lets_score_ahead_and_only_frozen_ones_of_the_dataflow():
    assert SCORING_AHEAD_ROLES == CONFIG_SCORING_AHEAD_ROLES  # the planner sits below the config: it names them too
    assert scoring_ahead_roles(DATAFLOWS["ppo"]) == ("reference", "reward")
    assert scoring_ahead_roles(DATAFLOWS["safe-rlhf"]) == ("reference", "reward")  # not the cost model
    assert scoring_ahead_roles(GRPO) == ("reference",)


def test_a_rollout_pool_may_hold_the_reference_and_a_reward_model_with_k_at_least_one_and_nothing_else():
    layout = _split(("rollout", "reference"))
    assert layout.scoring_ahead == ("reference",) and layout.mode == "split async k=1 scoring ahead"
    assert layout.pool_of("reference") is layout.rollout_pool
    with pytest.raises(ValueError, match=r"Plan.rollout_pool.roles got \('rollout', 'critic'\); allowed: 'rollout' "
                                         r"with any of 'reference', 'reward'"):
        Plan(pools=(PoolPlan(name="trainer", roles=("actor",), devices_per_node=(1,)),),
             strategies={"actor": FSDP, "critic": FSDP},
             rollout_pool=PoolPlan(name="gen", roles=("rollout", "critic"), devices_per_node=(1,)), max_staleness=1)
    with pytest.raises(ValueError, match=r"Plan.rollout_pool.roles got \('reference',\)"):
        _split(("reference",))  # the replicas themselves are missing
    with pytest.raises(ValueError, match="Plan.max_staleness got 0 with reference on the rollout pool; allowed: an "
                                         "integer >= 1"):
        _split(("rollout", "reference"), max_staleness=0)
    with pytest.raises(ValueError, match="differ from roles with strategies"):
        Plan(pools=(PoolPlan(name="trainer", roles=("actor",), devices_per_node=(1,)),), strategies={"actor": FSDP},
             rollout_pool=PoolPlan(name="gen", roles=("rollout", "reference"), devices_per_node=(1,)), max_staleness=1)


def test_a_config_with_the_reference_on_the_rollout_pool_reads_as_a_plan_scoring_ahead_and_writes_back_the_same():
    # the key order of docs/async.md's example: the reference before the replicas
    fragment = {"placement": {"pools": {"trainer": [1], "gen": [1]},
                              "roles": {"actor": "trainer", "reference": "gen", "rollout": "gen"}},
                "async": {"max_staleness": 1}}
    layout = Plan.from_config_fragment(fragment)
    assert layout.rollout_pool == PoolPlan(name="gen", roles=("rollout", "reference"), devices_per_node=(1,))
    assert layout.strategies["reference"] == FSDP and layout.max_staleness == 1
    written = layout.to_config_fragment()
    assert written["placement"]["roles"] == {"actor": "trainer", "rollout": "gen", "reference": "gen"}
    assert written["async"] == {"max_staleness": 1} and written["reference"]["engine"]["layout"] == "fsdp"
    assert Plan.from_config_fragment(written) == layout
    with pytest.raises(ValueError, match="Plan.max_staleness got 0 with reference"):
        Plan.from_config_fragment(dict(fragment, **{"async": {"max_staleness": 0}}))


# ---- the overlap model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cores", [0, 1])  # 0: devices that do not share cores; 1: two processes on one core
def test_scoring_ahead_moves_the_references_seconds_from_the_trainers_side_to_the_rollout_pools(cores):
    """On 2 devices split 1 | 1 the plain split's trainer runs actor and reference on its one device; scoring
    ahead, the reference runs on the replica's device with the same layout and core share, so its seconds move
    whole from one side to the other."""
    best = plan(GRPO, MODELS, WORKLOAD, _cluster(2, compute_units_per_node=cores), max_staleness=1)
    modes = _by_mode(best)
    plain, scored = modes["split async k=1"], modes["split async k=1 scoring ahead"]
    assert scored.rollout_pool.roles == ("rollout", "reference") and plain.rollout_pool.roles == ("rollout",)
    reference = plain.role_stage_seconds["reference"]["preparation"]
    assert reference > 0
    assert plain.overlap.scoring_ahead == 0.0
    assert scored.role_stage_seconds["reference"] == pytest.approx({"preparation": reference})
    assert scored.overlap.scoring_ahead == pytest.approx(reference)
    assert scored.overlap.rollout == pytest.approx(
        scored.overlap.receive + scored.overlap.generation + reference)
    # the trainer's side: the same send and training, its preparation without the reference's
    assert plain.overlap.preparation == pytest.approx(reference + plain.role_stage_seconds["actor"]["preparation"])
    assert scored.overlap.preparation == pytest.approx(plain.overlap.preparation - reference)
    assert (scored.overlap.send, scored.overlap.training) == pytest.approx((plain.overlap.send,
                                                                           plain.overlap.training))
    # the reference's weights take memory the replica's KV cache had: generation is not faster
    assert scored.overlap.generation >= plain.overlap.generation
    assert scored.total_seconds == pytest.approx(max(scored.overlap.rollout, scored.overlap.trainer))
    # a synchronous turn-taking split never scores ahead (the scorers would not run ahead of anything)
    assert all(candidate.scoring_ahead == () for candidate in _candidates(best) if candidate.max_staleness == 0)


def test_on_a_cpu_node_the_scorer_on_the_rollout_pool_runs_at_the_core_share_of_both_pools():
    def reference_seconds(cores: int) -> float:
        best = plan(GRPO, MODELS, WORKLOAD, _cluster(2, compute_units_per_node=cores), max_staleness=1)
        return _by_mode(best)["split async k=1 scoring ahead"].overlap.scoring_ahead

    assert reference_seconds(1) == pytest.approx(2 * reference_seconds(2))


def test_a_hand_written_plan_scoring_ahead_is_predicted_as_the_search_predicts_it():
    cluster = _cluster(2)
    searched = _by_mode(plan(GRPO, MODELS, WORKLOAD, cluster, max_staleness=1))["split async k=1 scoring ahead"]
    layout = Plan.from_config_fragment(searched.to_config_fragment())
    assert (layout.rollout_pool, layout.strategies) == (searched.rollout_pool, searched.strategies)
    again = simulate_plan(layout, GRPO, MODELS, WORKLOAD, cluster)
    assert again.overlap == searched.overlap
    assert again.total_seconds == pytest.approx(searched.total_seconds)
    with pytest.raises(ValueError, match="the rollout pool holds reference, which 'grpo' does not score with a model"):
        simulate_plan(layout, Dataflow(name="grpo", roles={"actor": "actor", "reward": "inference"}),
                      {"actor": str(ASSETS_DIR), "reward": str(ASSETS_DIR)}, WORKLOAD, cluster)


# ---- the search ----------------------------------------------------------------------------------------
def test_the_planner_scores_ahead_when_the_trainer_is_the_slower_side_and_not_when_the_rollout_pool_would_be(
        monkeypatch):
    """Constructed costs on 2 devices (split 1 | 1): generation takes floor + rest / replicas; the actor's and the
    reference's scoring ``preparation`` / d each; training / d."""
    def steps(floor, generation, preparation, training):
        _constructed_costs(monkeypatch, floor=floor, generation=generation, preparation=preparation,
                           training=training)
        best = plan(GRPO, MODELS, WORKLOAD, _cluster(2), max_staleness=1)
        rollout = floor + generation  # one replica
        plain = max(rollout, 2 * preparation + training)
        scored = max(rollout + preparation, preparation + training)
        colocated = floor + generation / 2 + 2 * preparation / 2 + training / 2
        return best, plain, scored, colocated

    # the trainer's side is the slower: moving the reference to the replica's process balances the two
    best, plain, scored, colocated = steps(floor=0.3, generation=0.2, preparation=0.4, training=0.6)
    assert scored < min(plain, colocated)
    assert best.mode == "split async k=1 scoring ahead" and best.scoring_ahead == ("reference",)
    assert best.total_seconds == pytest.approx(scored)
    assert _by_mode(best)["split async k=1"].total_seconds == pytest.approx(plain)
    printed = best.describe()
    assert "scoring ahead (reference)" in printed and "scores ahead" in printed
    assert "chosen: split async k=1 scoring ahead" in printed and "split async k=1 actor+reference" in printed
    assert best.to_config_fragment()["placement"]["roles"] == {"actor": "actor", "rollout": "rollout",
                                                               "reference": "rollout"}

    # the rollout side is the slower already: the reference there would only lengthen it
    best, plain, scored, colocated = steps(floor=0.6, generation=0.2, preparation=0.4, training=0.3)
    assert plain < min(scored, colocated)
    assert best.mode == "split async k=1" and best.scoring_ahead == ()
    assert best.total_seconds == pytest.approx(plain)
    assert _by_mode(best)["split async k=1 scoring ahead"].total_seconds == pytest.approx(scored)

    # a run that cannot score ahead (async.mode: streaming) is planned without it
    _constructed_costs(monkeypatch, floor=0.3, generation=0.2, preparation=0.4, training=0.6)
    best = plan(GRPO, MODELS, WORKLOAD, _cluster(2), max_staleness=1, scoring_ahead=False)
    assert all(candidate.scoring_ahead == () for candidate in _candidates(best))


def test_the_planner_tries_every_subset_of_the_frozen_scorers_on_the_rollout_pool():
    flow = Dataflow(name="grpo", roles={"actor": "actor", "reference": "inference", "reward": "inference"})
    models = {role: str(ASSETS_DIR) for role in flow.roles}
    best = plan(flow, models, WORKLOAD, _cluster(4), max_staleness=1, top=1000)
    moved = {candidate.scoring_ahead for candidate in _candidates(best) if candidate.rollout_pool is not None}
    assert moved == {(), ("reference",), ("reward",), ("reference", "reward")}
    totals = [candidate.total_seconds for candidate in _candidates(best)]
    assert totals == sorted(totals)


# ---- placement.mapping=auto ----------------------------------------------------------------------------
def test_auto_mapping_puts_the_reference_on_the_rollout_pool_when_scoring_ahead_wins_and_the_config_validates(
        monkeypatch):
    from hybridflow.trainers.auto_mapping import resolve_auto_mapping

    # scoring ahead max(0.8 + 0.2, 0.2 + 0.8) = 1.0; the plain split max(0.8, 0.2 + 0.2 + 0.8) = 1.2; colocated
    # 0.8 + (0.2 + 0.2 + 0.8) / 2 = 1.4 (a streaming run, which refuses k = 0, must still get a rollout pool); two
    # mini-batches, so the actor's old-log-prob forward runs (with one it is skipped and costs nothing)
    _constructed_costs(monkeypatch, floor=0.8, generation=0.0, preparation=0.2, training=0.8)
    config = load_rl_config(None, BASE + ["async.max_staleness=1", "batch.mini_batch_size=16"])
    resolved, chosen = resolve_auto_mapping(config)  # an RLConfig: built, hence validated
    assert chosen.mode == "split async k=1 scoring ahead"
    assert resolved.placement.mapping == "manual" and resolved.placement.scoring_ahead == ("reference",)
    assert resolved.placement.pool_of("reference") == resolved.placement.rollout_pool == ROLLOUT_ROLE
    assert resolved.asynchrony.max_staleness == 1
    assert resolved.reference.engine.layout == chosen.strategies["reference"].layout

    streaming, chosen = resolve_auto_mapping(load_rl_config(None, BASE + ["async.max_staleness=1",
                                                                          "batch.mini_batch_size=16",
                                                                          "async.mode=streaming"]))
    assert chosen.mode == "split async k=1" and streaming.placement.scoring_ahead == ()


def test_a_streaming_run_whose_plan_is_synchronous_gets_the_pipelined_mode_that_allows_k_zero(monkeypatch):
    from hybridflow.trainers.auto_mapping import resolve_auto_mapping

    # colocated 2.0 / 2 + 0.2 / 2 = 1.1 against the split's max(2.0, 0.2) = 2.0: the synchronous step wins
    _constructed_costs(monkeypatch, floor=0.0, generation=2.0, preparation=0.0, training=0.2)
    resolved, chosen = resolve_auto_mapping(load_rl_config(None, BASE + ["async.max_staleness=1",
                                                                         "async.mode=streaming"]))
    assert chosen.rollout_pool is None and chosen.max_staleness == 0
    assert resolved.asynchrony.max_staleness == 0 and resolved.asynchrony.mode == "pipelined"
