"""Overlap: split placements with a rollout pool of their own, generating while the trainer trains.

The pipelined asynchronous step (``async.max_staleness`` k, docs/async.md) runs two loops on disjoint devices:
- the **rollout pool** (R devices, one generation replica each, pg = tg = 1, the whole policy in the
  generation dtype) receives the weights of the last update and generates the next batch; with k >= 1 it may
  also hold frozen scorers (``SCORING_AHEAD_ROLES``: the reference, a reward model) on the same R devices, in the
  replicas' processes, which score each batch there right after generating it (docs/async.md, "Scoring ahead");
- the **training pools** (the other N - R devices; any placement of the dataflow's other roles, searched like
  the synchronous one, with an actor that does not generate and so needs no KV cache nor resharding) gather and
  send the weights, score the batch (log-probs, and the reference, critic, reward not on the rollout pool) and
  train.

With k >= 1 the two loops overlap and a step takes, in steady state, the slower of the two:
``max(receive + generation + scoring ahead, send + preparation + training)``; with k = 0 they take turns (the
sum). A scorer on the rollout pool is costed by the Simulator as on a training pool (one forward over the step's
samples on the pool's R devices, its layout the fastest that fits beside a replica's weights), and its resident
memory leaves less for the replicas' KV cache.
The colocated synchronous step is the synchronous search's sum of stages (with the 3D-HybridEngine's
resharding). On CPU profiles, processes busy at once share the node's cores: while the loops overlap every
process of both pools is busy, so each stage is costed at the share of all N processes.

The weight sync (``ActorWorker.generation_weights`` then ``RolloutWorker.sync_weights``) is costed as the
trainer's all-gather of the policy over the actor's pool and ``PAYLOAD_PASSES`` over the payload on rank 0 (send:
on the trainer's timeline); the payload's transfer, through Ray's object store, once to each node of the rollout
pool other than the trainer's (in turn, each over one node's share of the inter-node links; the replicas of a
node read its one copy), and ``PAYLOAD_PASSES`` on each replica (receive: on the rollout pool's timeline).
Each of these calls (the sync's two, the replicas' generation) pays the single controller's per-call cost
(``controller_call_overhead_s``), as every stage's call of a role does in the simulator. Not modeled: the
driver's own work between calls (rewards, advantages; docs/mapping.md, "Limits").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Iterator, Mapping, Sequence

from hybridflow.mapping.cluster import Cluster
from hybridflow.mapping.dataflow import STAGES, Dataflow
from hybridflow.mapping.model_spec import ModelSpec
from hybridflow.mapping.plan import (ROLLOUT_ROLE, SCORING_AHEAD_ROLES, OverlapSeconds, Plan, PoolPlan,
                                     rollout_pool_roles)
from hybridflow.mapping.search import Planner
from hybridflow.mapping.simulator import RoleCost, Simulator
from hybridflow.mapping.strategy import RoleStrategy

REPLICA = RoleStrategy(layout="fsdp", generation_pp_size=1, generation_tp_size=1)
"""A rollout replica's layout: the whole model on one device (workers/rollout.py runs pg = tg = 1)."""
PAYLOAD_PASSES = 3
"""Memory passes over the payload on each side of a sync. Trainer: the cast-and-pack copy into buckets, the
checksums, the copy into the object store. Replica: the unpack copy, the verifying checksums, the load."""


class TrainingPoolPlanner(Planner):
    """The Planner of the training side of a split with a rollout pool: the actor scores and trains but does not
    generate, and on CPU the ``busy_elsewhere`` processes of the rollout pool compete for the node's cores (of
    ``full_cluster``) in every stage."""

    actor_generates = False

    def __init__(self, *, full_cluster: Cluster, busy_elsewhere: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.full_cluster = full_cluster
        self.busy_elsewhere = busy_elsewhere

    def _strategies(self, role: str, num_devices: int) -> Iterator[RoleStrategy]:
        seen = set()
        for strategy in super()._strategies(role, num_devices):
            plain = replace(strategy, generation_pp_size=0, generation_tp_size=0)
            if plain not in seen:
                seen.add(plain)
                yield plain

    def stage_shares(self, sets: Sequence[tuple[str, ...]], allocation: Sequence[int]) -> tuple[float, ...]:
        busy = self.stage_busy(sets, allocation)
        return tuple(self.full_cluster.compute_share(busy[stage] + self.busy_elsewhere) for stage in STAGES)


def scoring_ahead_roles(dataflow: Dataflow) -> tuple[str, ...]:
    """The dataflow's frozen scorers that may score ahead on the rollout pool (``SCORING_AHEAD_ROLES``)."""
    return tuple(role for role in SCORING_AHEAD_ROLES if dataflow.roles.get(role) == "inference")


def replica_generation_seconds(simulator: Simulator, spec: ModelSpec, num_devices: int,
                               other_resident_bytes: float = 0.0) -> float | None:
    """Seconds for ``num_devices`` replicas (one per device, the whole model each) to generate the step's samples,
    beside scorers holding ``other_resident_bytes`` per device; None if a replica cannot hold the model and one
    sequence of KV cache in what they leave."""
    kv_budget = simulator.budget_bytes - simulator.generation_weight_bytes(spec, REPLICA) - other_resident_bytes
    if simulator.kv_cache_bytes is not None:  # a fixed allocation: it fits whole or not at all
        if simulator.kv_cache_bytes > kv_budget:
            return None
        kv_budget = simulator.kv_cache_bytes
    generated = simulator.generation_seconds(spec, REPLICA, num_devices, kv_budget)
    # the driver's call of the replicas' generation method
    return None if generated is None else generated[0] + simulator.controller_call_s


def weight_sync_seconds(simulator: Simulator, spec: ModelSpec, *, actor_devices: int,
                        remote_nodes: int) -> tuple[float, float]:
    """(send, receive) seconds of one weight sync of ``spec`` in the generation dtype: the all-gather over the
    actor's ``actor_devices`` and ``PAYLOAD_PASSES`` over the payload on rank 0; its transfer to each of the
    rollout pool's ``remote_nodes`` nodes in turn (0: the pools share the trainer's node and its object store) and
    ``PAYLOAD_PASSES`` on every replica (in parallel)."""
    payload = spec.num_params(head="lm") * simulator.element_bytes_of(spec)
    passes = PAYLOAD_PASSES * payload / simulator.memory_bandwidth
    send = simulator.all_gather_seconds(payload, actor_devices, actor_devices) + passes
    bandwidth, latency = simulator.link(True)  # per device: a node's transfer has the links of its devices
    node_bandwidth = bandwidth * simulator.cluster.node_size
    receive = remote_nodes * (latency + payload / node_bandwidth) + passes
    # one call on each side: ActorWorker.generation_weights, then RolloutWorker.sync_weights
    return send + simulator.controller_call_s, receive + simulator.controller_call_s


def rollout_side(planner: Planner, num_devices: int, scorers: Sequence[str], max_staleness: int,
                 strategies: Mapping[str, RoleStrategy] | None = None) -> tuple[float, dict[str, RoleCost]] | None:
    """(generation seconds, scorer -> cost) of a rollout pool of ``num_devices`` replicas whose processes also run
    ``scorers`` (frozen, scoring ahead), each with its given ``strategies`` or, if None, the joint layouts with the
    least generation + scoring seconds among those that fit beside a replica's weights (the scorers' resident
    memory leaves less for the KV cache); None if nothing fits. While the loops overlap (k >= 1) all of the
    cluster's processes are busy: on CPU every stage runs at the core share of all of them."""
    cluster = planner.cluster
    share = cluster.compute_share(cluster.num_devices if max_staleness else num_devices)
    shares = (share,) * len(STAGES)
    simulator = planner.simulator_for(share)
    spec = planner.models[planner.dataflow.actor_role]
    if strategies is None:
        choices = planner.joint_choices(scorers, num_devices, shares)
    else:
        for role in scorers:
            planner.check_layout(role, strategies[role], num_devices)
        given = [planner.cost_of(role, strategies[role], num_devices, shares=shares) for role in scorers]
        choices = [] if None in given else [(math.fsum(cost.total_seconds for cost in given),
                                             sum(cost.resident_bytes for cost in given),
                                             max((cost.transient_bytes for cost in given), default=0.0), tuple(given))]
    weights = simulator.generation_weight_bytes(spec, REPLICA)
    best: tuple[float, float, dict[str, RoleCost]] | None = None  # (rollout seconds, generation, costs)
    for seconds, resident, transient, chosen in choices:
        if weights + resident + transient > simulator.budget_bytes:
            continue
        generation = replica_generation_seconds(simulator, spec, num_devices, other_resident_bytes=resident)
        if generation is not None and (best is None or generation + seconds < best[0]):
            best = (generation + seconds, generation, dict(zip(scorers, chosen)))
    return None if best is None else (best[1], best[2])


def training_planner(planner: Planner, *, training_devices: int, rollout_devices: int,
                     max_staleness: int, scoring_ahead: Sequence[str] = ()) -> TrainingPoolPlanner:
    """The planner of ``training_devices`` beside a rollout pool of ``rollout_devices`` on ``planner``'s cluster,
    for the dataflow's roles other than the ``scoring_ahead`` ones the rollout pool runs (ValueError if the
    devices do not form a cluster: more than a node and not whole nodes)."""
    cluster = planner.cluster
    dataflow = replace(planner.dataflow, roles={role: kind for role, kind in planner.dataflow.roles.items()
                                                if role not in scoring_ahead})
    return TrainingPoolPlanner(
        dataflow=dataflow, models={role: planner.models[role] for role in dataflow.roles}, workload=planner.workload,
        cluster=Cluster(num_devices=training_devices, devices_per_node=min(cluster.node_size, training_devices),
                        hardware=cluster.hardware),
        backend=planner.backend, kv_cache_gib=planner.kv_cache_gib, granularity=planner.granularity,
        full_cluster=cluster, busy_elsewhere=rollout_devices if max_staleness else 0)


def with_rollout_pool(planner: Planner, training: Plan, rollout_pool: PoolPlan, max_staleness: int,
                      strategies: Mapping[str, RoleStrategy] | None = None) -> Plan | None:
    """``training`` (a simulated plan of the training pools, the actor not generating, without the scorers on the
    rollout pool) beside ``rollout_pool`` (its replicas and scorers, those with the given ``strategies`` or, if
    None, the fastest that fit: ``rollout_side``), pipelined with staleness ``max_staleness``: the plan with both
    sides' predicted seconds (``OverlapSeconds``); None if the rollout pool's roles do not fit its devices."""
    cluster = planner.cluster
    scorers = [role for role in rollout_pool.roles if role != ROLLOUT_ROLE]
    side = rollout_side(planner, rollout_pool.num_devices, scorers, max_staleness, strategies)
    if side is None:
        return None
    generation, costs = side
    actor = planner.dataflow.actor_role
    spec = planner.models[actor]
    total = cluster.num_devices
    simulator = planner.simulator_for(cluster.compute_share(total if max_staleness else rollout_pool.num_devices))
    remote_nodes = 0 if total <= cluster.node_size else len(rollout_pool.devices_per_node)
    send, receive = weight_sync_seconds(simulator, spec, actor_devices=training.pool_of(actor).num_devices,
                                        remote_nodes=remote_nodes)
    assert training.stage_seconds is not None and training.pool_stage_seconds is not None
    assert training.role_stage_seconds is not None
    # the scorers run one after another in the replicas' processes, after the generation
    scoring = math.fsum(cost.total_seconds for cost in costs.values())
    overlap = OverlapSeconds(receive=receive, generation=generation, scoring_ahead=scoring, send=send,
                             preparation=training.stage_seconds["preparation"],
                             training=training.stage_seconds["training"])
    pool_stage_seconds = dict(training.pool_stage_seconds, **{
        rollout_pool.name: {"generation": generation, "preparation": scoring, "training": 0.0}})
    stage_seconds = dict(training.stage_seconds, generation=generation,
                         preparation=max(training.stage_seconds["preparation"], scoring))
    return replace(training, rollout_pool=rollout_pool, max_staleness=max_staleness, overlap=overlap,
                   strategies=dict(training.strategies, **{role: cost.strategy for role, cost in costs.items()}),
                   role_stage_seconds=dict(training.role_stage_seconds,
                                           **{role: dict(cost.stage_seconds) for role, cost in costs.items()}),
                   stage_seconds=stage_seconds, pool_stage_seconds=pool_stage_seconds, backend=planner.backend.name)


def rollout_pool_plans(planner: Planner, staleness_values: Sequence[int], *, scoring_ahead: bool = True) -> list[Plan]:
    """For every rollout pool size R (a pool size of the planner's granularity leaving a valid training
    cluster) and every k of ``staleness_values``, the fastest training placement on the other devices beside R
    generation replicas, as a plan with ``async.max_staleness`` k; with k >= 1 and ``scoring_ahead``, also for
    every non-empty subset of the dataflow's frozen scorers (``scoring_ahead_roles``) moved onto the rollout pool,
    the training side then searched without them. Fastest first. Empty for a dataflow that generates more than
    once per step (the pipelined schedule generates one batch per step)."""
    if planner.dataflow.generation_passes != 1:
        return []
    cluster = planner.cluster
    total, node = cluster.num_devices, cluster.node_size
    shares_cores = cluster.hardware.compute_units_per_node > 0
    movable = scoring_ahead_roles(planner.dataflow) if scoring_ahead else ()
    subsets = [moved for size in range(len(movable) + 1) for moved in itertools.combinations(movable, size)]
    plans = []
    for rollout in cluster.device_counts(planner.granularity):
        rest = total - rollout
        if rest < 1 or (rest > node and rest % node) or not cluster.fits_nodes([rollout, rest]):
            continue
        # (overlapping or not, scorers moved) -> the training side (overlapping or not: the same without cores)
        searched: dict[tuple[bool, tuple[str, ...]], Plan | None] = {}
        for max_staleness in staleness_values:
            overlapping = bool(max_staleness) and shares_cores
            for moved in subsets if max_staleness else [()]:  # scorers move only when the loops overlap
                if (overlapping, moved) not in searched:
                    trainer = training_planner(planner, training_devices=rest, rollout_devices=rollout,
                                               max_staleness=int(overlapping), scoring_ahead=moved)
                    try:
                        searched[overlapping, moved] = trainer.search()[0]
                    except ValueError:  # the roles do not fit the devices left
                        searched[overlapping, moved] = None
                training = searched[overlapping, moved]
                pool = PoolPlan(name=ROLLOUT_ROLE, roles=rollout_pool_roles(moved),
                                devices_per_node=tuple(cluster.pool_nodes(rollout)))
                candidate = None if training is None else with_rollout_pool(planner, training, pool, max_staleness)
                if candidate is not None:
                    plans.append(candidate)
    return sorted(plans, key=lambda plan: plan.total_seconds)


def simulate_with_rollout_pool(planner: Planner, layout: Plan) -> Plan:
    """Predicted times of a given layout with a rollout pool (e.g. a hand-written config with
    ``placement.roles.rollout``); ValueError if it does not fit."""
    assert layout.rollout_pool is not None
    if planner.dataflow.generation_passes != 1:
        raise ValueError(f"{planner.dataflow.name!r} generates {planner.dataflow.generation_passes} times per step; a "
                         f"rollout pool generates one batch per step")
    rollout = layout.rollout_pool.num_devices
    training_devices = sum(pool.num_devices for pool in layout.pools)
    if training_devices + rollout > planner.cluster.num_devices:
        raise ValueError(f"the plan's pools use {training_devices + rollout} devices; the cluster has "
                         f"{planner.cluster.num_devices}")
    moved = layout.scoring_ahead
    unknown = [role for role in moved if role not in scoring_ahead_roles(planner.dataflow)]
    if unknown:
        raise ValueError(f"the rollout pool holds {', '.join(unknown)}, which {planner.dataflow.name!r} does not score "
                         f"with a model; allowed there: {', '.join(scoring_ahead_roles(planner.dataflow)) or 'none'}")
    trainer = training_planner(planner, training_devices=training_devices, rollout_devices=rollout,
                               max_staleness=layout.max_staleness, scoring_ahead=moved)
    training = trainer.simulate(replace(layout, rollout_pool=None, max_staleness=0, strategies={
        role: strategy for role, strategy in layout.strategies.items() if role not in moved}))
    result = with_rollout_pool(planner, training, layout.rollout_pool, layout.max_staleness,
                               strategies={role: layout.strategies[role] for role in moved})
    if result is None:
        beside = f" beside {', '.join(moved)} with the given layouts" if moved else ""
        raise ValueError(f"rollout pool {layout.rollout_pool.name!r}: a replica cannot hold the actor and one "
                         f"sequence of KV cache{beside} on a device of {planner._usable_text()}")
    return result
