"""Planner: the placement, allocation and parallel strategies that minimize simulated iteration time.

Paper Algorithm 1 (placements x allocations) and Algorithm 2 (parallel strategy per model):
1. every set partition of the dataflow's roles is a placement (colocated sets time-share devices);
2. each set gets at least the fewest devices on which its roles fit in memory together;
3. every allocation of the N devices over the sets (node-aligned: whole nodes, or with granularity "divisor"
   whole nodes plus a divisor of a node; each at least its minimum) is tried;
4. per set and device count each role takes its fastest strategy, cached per (model, devices, role
   kind); colocated roles share memory, so when the fastest strategies do not fit together the
   roles give up speed for memory where that costs the fewest seconds per byte;
5. iteration time = sum over stages of the max over sets of the sum over the set's roles.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Sequence, TypeVar

from hybridflow.mapping.cluster import Cluster, check_granularity
from hybridflow.mapping.dataflow import STAGES, Dataflow, dataflow as get_dataflow
from hybridflow.mapping.hardware import GIB
from hybridflow.mapping.model_spec import ModelSpec, model_spec
from hybridflow.mapping.plan import Plan, PoolPlan
from hybridflow.mapping.rollout import RolloutBackend, rollout_backend
from hybridflow.mapping.simulator import RoleCost, Simulator
from hybridflow.mapping.strategy import RoleStrategy, generation_strategies, training_strategies
from hybridflow.mapping.workload import Workload

T = TypeVar("T")
NO_SHARING = (1.0, 1.0, 1.0)
"""Compute share per stage when no process waits for a core (always on GPUs)."""


def set_partitions(items: Sequence[T]) -> Iterator[list[list[T]]]:
    """Every split of ``items`` into non-empty unordered blocks (Bell(len(items)) of them), order kept."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first]] + partition
        for index in range(len(partition)):
            yield partition[:index] + [[first] + partition[index]] + partition[index + 1:]


def pareto_front(costs: list[RoleCost]) -> list[RoleCost]:
    """Costs no other cost beats on both time and memory, fastest first (memory then strictly falls)."""
    front: list[RoleCost] = []
    for cost in sorted(costs, key=lambda c: (c.total_seconds, c.footprint_bytes)):
        if not front or cost.footprint_bytes < front[-1].footprint_bytes:
            front.append(cost)
    return front


MAX_FRONT = 12
"""Layouts per colocated role tried jointly: the fastest, the most frugal and others evenly between."""


def _spread(front: list[RoleCost], count: int) -> list[RoleCost]:
    """At most ``count`` entries of a Pareto front (fastest first), keeping both ends."""
    if len(front) <= count:
        return front
    return [front[round(i * (len(front) - 1) / (count - 1))] for i in range(count)]


def _combinations_front(fronts: list[list[RoleCost]]) -> list[tuple[float, float, float, tuple[RoleCost, ...]]]:
    """(summed seconds, summed resident bytes, largest transient bytes, costs) of every choice of one
    entry per front that no other choice beats on all three: the only candidates for a joint choice."""
    combos = [(0.0, 0.0, 0.0, ())]
    for front in fronts:
        combos = [(seconds + cost.total_seconds, resident + cost.resident_bytes,
                   max(transient, cost.transient_bytes), chosen + (cost,))
                  for seconds, resident, transient, chosen in combos for cost in front]
        combos.sort(key=lambda combo: combo[:3])
        kept: list[tuple] = []
        for combo in combos:  # drop dominated choices (sorted by seconds: a kept one is at least as fast)
            if not any(k[1] <= combo[1] and k[2] <= combo[2] for k in kept):
                kept.append(combo)
        combos = kept
    return combos


@dataclass(frozen=True)
class SetResult:
    """The chosen costs of one colocated set's roles on a device count."""

    costs: dict[str, RoleCost]

    @functools.cached_property
    def stage_seconds(self) -> dict[str, float]:
        # fsum is exactly rounded, so the result does not depend on the order of the roles
        return {stage: math.fsum(cost.stage_seconds.get(stage, 0.0) for cost in self.costs.values())
                for stage in STAGES}


class Planner:
    """Searches the mappings of one dataflow, its models, a workload and a cluster."""

    actor_generates = True
    """Whether the actor generates on its own pool (False beside a rollout pool: hybridflow.mapping.overlap)."""

    def __init__(self, *, dataflow: Dataflow, models: Mapping[str, ModelSpec], workload: Workload,
                 cluster: Cluster, backend: str | RolloutBackend = "native",
                 kv_cache_gib: float | None = None, granularity: str = "node") -> None:
        """``backend``: the actor's rollout engine (``actor.generation.backend``: native or vllm).
        ``kv_cache_gib``: the KV cache the rollout engine allocates per device, GiB (vllm:
        ``actor.generation.vllm_kv_cache_gib``); None: whatever memory the colocated roles leave.
        ``granularity``: the pool sizes searched (hybridflow.mapping.cluster.GRANULARITIES): ``node`` (divisors
        of a node, then whole nodes) or ``divisor`` (also whole nodes plus a divisor of a node)."""
        check_granularity(granularity)
        if kv_cache_gib is not None and (isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, (int, float))
                                         or not kv_cache_gib > 0):
            raise ValueError(f"kv_cache_gib (actor.generation.vllm_kv_cache_gib) must be a number > 0 or None "
                             f"(all memory left), got {kv_cache_gib!r}")
        missing = sorted(set(dataflow.roles) - set(models))
        extra = sorted(set(models) - set(dataflow.roles))
        if missing or extra:
            raise ValueError(f"models must name exactly the roles of {dataflow.name!r} "
                             f"({', '.join(dataflow.roles)}); missing {missing}, not in the dataflow {extra}")
        self.dataflow = dataflow
        self.models = dict(models)
        self.workload = workload
        self.cluster = cluster
        self.granularity = granularity
        self.device_counts = cluster.device_counts(granularity)
        self.backend = rollout_backend(backend)
        self.kv_cache_gib = kv_cache_gib
        self.kv_cache_bytes = None if kv_cache_gib is None else kv_cache_gib * GIB
        self._simulators: dict[float, Simulator] = {}
        self.simulator = self.simulator_for(1.0)
        self._candidates: dict[tuple, list[RoleCost]] = {}
        self._actor: dict[tuple, RoleCost | None] = {}
        self._actor_alone: dict[tuple, list[RoleCost]] = {}
        self._sets: dict[tuple, SetResult | None] = {}

    # ---- one role ----------------------------------------------------------------------------
    def _strategies(self, role: str, num_devices: int) -> Iterator[RoleStrategy]:
        """The role's layouts on ``num_devices`` that split the batch as the trainer requires: d divides the
        samples per step (and, for trained roles, the samples per update); the actor's generation replicas
        n / (pg tg) may leave a remainder of prompts (``Workload.pad_generation``, the default: the generation
        dispatch pads them; the simulator charges each replica ceil(prompts / replicas)), or must divide the
        prompts per step when it is False. With ``Workload.pad_uneven`` every layout is allowed (each rank
        charged ceil(samples / d)). The actor generates only with the (pg, tg) its rollout backend supports
        (vllm: 1, 1)."""
        spec, kind, workload = self.models[role], self.dataflow.roles[role], self.workload
        even = not workload.pad_uneven
        even_prompts = even and not workload.pad_generation
        for strategy in training_strategies(spec, num_devices=num_devices, node_size=self.cluster.node_size):
            dp_size = strategy.dp_size(num_devices)
            if even and (workload.num_samples % dp_size
                         or (kind != "inference" and workload.samples_per_update % dp_size)):
                continue
            if kind != "actor":
                yield strategy
                continue
            for with_generation in generation_strategies(strategy):
                if not self.backend.supports(with_generation.generation_pp_size, with_generation.generation_tp_size):
                    continue
                replicas = num_devices // (with_generation.generation_pp_size * with_generation.generation_tp_size)
                if not even_prompts or workload.prompts_per_step % replicas == 0:
                    yield with_generation

    def simulator_for(self, compute_share: float) -> Simulator:
        """The simulator of this planner's workload and cluster at a compute share (cached)."""
        if compute_share not in self._simulators:
            self._simulators[compute_share] = Simulator(workload=self.workload, cluster=self.cluster,
                                                        generation_passes=self.dataflow.generation_passes,
                                                        compute_share=compute_share, backend=self.backend,
                                                        kv_cache_bytes=self.kv_cache_bytes)
        return self._simulators[compute_share]

    def stage_shares(self, sets: Sequence[tuple[str, ...]], allocation: Sequence[int]) -> tuple[float, ...]:
        """Per stage, the device share of each busy process: only the pools working in a stage compete
        for a CPU node's cores (all 1 on GPUs)."""
        busy = self.stage_busy(sets, allocation)
        return tuple(self.cluster.compute_share(busy[stage]) for stage in STAGES)

    def stage_busy(self, sets: Sequence[tuple[str, ...]], allocation: Sequence[int]) -> dict[str, int]:
        """Per stage, the processes busy in it: every role scores in preparation; generation runs on the
        actor's pool; training on the pools of trained roles."""
        actor = self.dataflow.actor_role
        return {
            "generation": sum(count for roles, count in zip(sets, allocation) if actor in roles),
            "preparation": sum(allocation),
            "training": sum(count for roles, count in zip(sets, allocation)
                            if any(self.dataflow.roles[role] != "inference" for role in roles)),
        }

    def cost_of(self, role: str, strategy: RoleStrategy, num_devices: int, other_resident: float = 0.0,
              other_transient: float = 0.0, shares: tuple[float, ...] = NO_SHARING) -> RoleCost | None:
        """The role's cost with each stage simulated at that stage's compute share."""
        by_share = {}
        for share in sorted(set(shares)):
            by_share[share] = self.simulator_for(share).role_cost(
                kind=self.dataflow.roles[role], spec=self.models[role], head=self.dataflow.head_of(role),
                strategy=strategy, num_devices=num_devices, other_resident_bytes=other_resident,
                other_transient_bytes=other_transient)
            if by_share[share] is None:  # memory does not depend on the share: infeasible for all
                return None
        if len(by_share) == 1:
            return by_share[shares[0]]
        stage_share = dict(zip(STAGES, shares))
        first = by_share[shares[0]]
        stage_seconds = {stage: by_share[stage_share[stage]].stage_seconds[stage] for stage in first.stage_seconds}
        return replace(first, stage_seconds=stage_seconds, details=by_share[stage_share["generation"]].details)

    def candidates(self, role: str, num_devices: int, shares: tuple[float, ...] = NO_SHARING) -> list[RoleCost]:
        """A non-actor role's strategies that fit alone on ``num_devices``, Pareto-front, fastest first."""
        key = (self.dataflow.roles[role], self.dataflow.head_of(role), self.models[role], num_devices, shares)
        if key not in self._candidates:
            costs = [self.cost_of(role, strategy, num_devices, shares=shares)
                     for strategy in self._strategies(role, num_devices)]
            self._candidates[key] = pareto_front([cost for cost in costs if cost is not None])
        return self._candidates[key]

    def actor_costs(self, num_devices: int, shares: tuple[float, ...] = NO_SHARING) -> list[RoleCost]:
        """The actor's strategies that fit alone on ``num_devices``, each with the memory its generation
        leaves for the KV cache; generation seconds are recomputed for the memory colocated roles leave."""
        role = self.dataflow.actor_role
        key = (self.models[role], num_devices, shares)
        if key not in self._actor_alone:
            costs = [self.cost_of(role, strategy, num_devices, shares=shares)
                     for strategy in self._strategies(role, num_devices)]
            self._actor_alone[key] = [cost for cost in costs if cost is not None]
        return self._actor_alone[key]

    def best_actor(self, num_devices: int, other_resident: float = 0.0, other_transient: float = 0.0,
                   shares: tuple[float, ...] = NO_SHARING) -> RoleCost | None:
        """The actor's fastest strategy next to colocated roles holding the given memory (cached)."""
        role = self.dataflow.actor_role
        key = (self.models[role], num_devices, other_resident, other_transient, shares)
        if key not in self._actor:
            best = None
            for alone in self.actor_costs(num_devices, shares):
                if other_resident + alone.resident_bytes + max(alone.transient_bytes, other_transient) \
                        > self.simulator.budget_bytes:
                    continue
                # generation only gets slower with less memory: skip strategies that cannot win
                if best is not None and alone.total_seconds >= best.total_seconds:
                    continue
                cost = self.cost_of(role, alone.strategy, num_devices, other_resident, other_transient, shares)
                if cost is not None and (best is None or cost.total_seconds < best.total_seconds):
                    best = cost
            self._actor[key] = best
        return self._actor[key]

    # ---- one colocated set -------------------------------------------------------------------
    def set_result(self, roles: tuple[str, ...], num_devices: int,
                   shares: tuple[float, ...] = NO_SHARING) -> SetResult | None:
        """The roles' strategies on one pool of ``num_devices``, chosen jointly: the combination of
        layouts with the least summed time among those that fit together, the actor's generation
        taking the KV cache the others leave (None if they cannot fit together)."""
        key = (roles, num_devices, shares)
        if key in self._sets:
            return self._sets[key]
        actor = self.dataflow.actor_role if self.dataflow.actor_role in roles else None
        others = [role for role in roles if role != actor]
        result = None
        budget = self.simulator.budget_bytes
        best_seconds = float("inf")
        for seconds, resident, transient, chosen in self.joint_choices(others, num_devices, shares):
            if resident + transient > budget:
                continue
            if actor is None:
                if seconds < best_seconds:
                    best_seconds, result = seconds, SetResult(costs=dict(zip(others, chosen)))
                continue
            actor_cost = self.best_actor(num_devices, resident, transient, shares)
            if actor_cost is not None and seconds + actor_cost.total_seconds < best_seconds:
                best_seconds = seconds + actor_cost.total_seconds
                result = SetResult(costs={actor: actor_cost, **dict(zip(others, chosen))})
        self._sets[key] = result
        return result

    def joint_choices(self, roles: Sequence[str], num_devices: int, shares: tuple[float, ...] = NO_SHARING
                      ) -> list[tuple[float, float, float, tuple[RoleCost, ...]]]:
        """The candidates for a joint choice of layouts of non-actor ``roles`` sharing ``num_devices``: (summed
        seconds, summed resident bytes, largest transient bytes, one cost per role in ``roles``' order) of every
        choice from the roles' Pareto fronts that no other choice beats on all three; empty if a role fits on no
        layout. The caller checks them against the memory the rest of the pool takes."""
        fronts = [_spread(self.candidates(role, num_devices, shares), MAX_FRONT) for role in roles]
        return _combinations_front(fronts) if all(fronts) else []

    def min_devices(self, roles: tuple[str, ...]) -> int | None:
        """Fewest devices (among the counts of the granularity) on which the set fits, or None."""
        return next((n for n in self.device_counts if self.set_result(roles, n) is not None), None)

    # ---- placements and allocations ----------------------------------------------------------
    def allocations(self, minimums: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """Device counts per set, each >= its minimum, summing to N and packing into the nodes."""
        counts = self.device_counts
        total = self.cluster.num_devices

        def extend(prefix: tuple[int, ...], remaining: int) -> Iterator[tuple[int, ...]]:
            index = len(prefix)
            if index == len(minimums):
                if remaining == 0 and self.cluster.fits_nodes(list(prefix)):
                    yield prefix
                return
            reserve = sum(minimums[index + 1:])
            for count in counts:
                if minimums[index] <= count <= remaining - reserve:
                    yield from extend(prefix + (count,), remaining - count)

        yield from extend((), total)

    def best_allocation(self, sets: Sequence[tuple[str, ...]], minimums: Sequence[int]) -> tuple[int, ...] | None:
        """The allocation of ``allocations(minimums)`` with the least ``total_seconds_of`` (the first in their
        order among equals), found by branch and bound: a prefix of set sizes is dropped once the stage times
        it fixes already exceed the best total. Exact, as the bound never exceeds a completion's total: per
        stage, the max over the sets placed so far and, for the sets still to place, the least time each has at
        any size; computed without core sharing (sharing only slows a stage), on sizes where each set fits."""
        counts = self.device_counts
        options = []  # per set: (count, stage seconds) for every size it fits on, fewest devices first
        for roles, minimum in zip(sets, minimums):
            fitting = [(count, result.stage_seconds) for count in counts if count >= minimum
                       for result in [self.set_result(roles, count)] if result is not None]
            options.append([(count, tuple(seconds[stage] for stage in STAGES)) for count, seconds in fitting])
        # per stage, the largest over sets index.. of each set's least time there (0 past the last set)
        floors = [tuple(0.0 for _ in STAGES)] * (len(sets) + 1)
        for index in range(len(sets) - 1, -1, -1):
            least = [min(seconds[i] for _, seconds in options[index]) for i in range(len(STAGES))]
            floors[index] = tuple(max(a, b) for a, b in zip(least, floors[index + 1]))
        reserve = [sum(minimums[index + 1:]) for index in range(len(sets))]
        last_options = dict(options[-1])
        best: list = [float("inf"), None]  # seconds, allocation

        def extend(prefix: tuple[int, ...], remaining: int, stage_max: tuple[float, ...]) -> None:
            index = len(prefix)
            if sum(max(a, b) for a, b in zip(stage_max, floors[index])) > best[0]:
                return
            if index == len(sets) - 1:  # the last set takes what is left
                if remaining not in last_options:
                    return
                allocation = prefix + (remaining,)
                if not self.cluster.fits_nodes(list(allocation)):
                    return
                seconds = self.total_seconds_of(sets, allocation)
                if seconds is not None and (seconds, allocation) < tuple(best):
                    best[:] = [seconds, allocation]
                return
            for count, seconds in options[index]:
                if count > remaining - reserve[index]:
                    break
                extend(prefix + (count,), remaining - count, tuple(max(a, b) for a, b in zip(stage_max, seconds)))

        extend((), self.cluster.num_devices, floors[-1])
        return best[1]

    def total_seconds_of(self, sets: Sequence[tuple[str, ...]], allocation: Sequence[int]) -> float | None:
        """plan_for(sets, allocation).total_seconds without building the plan (the search's inner loop)."""
        shares = self.stage_shares(sets, allocation)
        results = [self.set_result(roles, count, shares) for roles, count in zip(sets, allocation)]
        if any(result is None for result in results):
            return None
        return sum(max(result.stage_seconds[stage] for result in results) for stage in STAGES)

    def plan_for(self, sets: Sequence[tuple[str, ...]], allocation: Sequence[int]) -> Plan | None:
        """The simulated plan of one placement and allocation (None if a set does not fit)."""
        shares = self.stage_shares(sets, allocation)
        results = [self.set_result(roles, count, shares) for roles, count in zip(sets, allocation)]
        if any(result is None for result in results):
            return None
        pools = tuple(PoolPlan(name="_".join(roles), roles=roles,
                               devices_per_node=tuple(self.cluster.pool_nodes(count)))
                      for roles, count in zip(sets, allocation))
        return replace(self._assemble(pools, results), backend=self.backend.name)

    @staticmethod
    def _assemble(pools: Sequence[PoolPlan], results: Sequence[SetResult]) -> Plan:
        pool_stage_seconds = {pool.name: result.stage_seconds for pool, result in zip(pools, results)}
        costs = {role: result.costs[role] for pool, result in zip(pools, results) for role in pool.roles}
        return Plan(
            pools=tuple(pools),
            strategies={role: cost.strategy for role, cost in costs.items()},
            stage_seconds={stage: max(seconds[stage] for seconds in pool_stage_seconds.values()) for stage in STAGES},
            pool_stage_seconds=pool_stage_seconds,
            role_stage_seconds={role: dict(cost.stage_seconds) for role, cost in costs.items()},
        )

    def simulate(self, layout: Plan) -> Plan:
        """Predicted times of a given placement and strategies (e.g. a hand-written config)."""
        placed = {role for pool in layout.pools for role in pool.roles}
        if placed != set(self.dataflow.roles):
            raise ValueError(f"the plan places roles {sorted(placed)}; {self.dataflow.name!r} needs "
                             f"{sorted(self.dataflow.roles)}")
        if sum(pool.num_devices for pool in layout.pools) > self.cluster.num_devices:
            raise ValueError(f"the plan's pools use {sum(pool.num_devices for pool in layout.pools)} devices; "
                             f"the cluster has {self.cluster.num_devices}")
        results = []
        shares = self.stage_shares([pool.roles for pool in layout.pools], [pool.num_devices for pool in layout.pools])
        for pool in layout.pools:
            count = pool.num_devices
            for role in pool.roles:
                strategy = layout.strategies[role]
                self.check_layout(role, strategy, count)
                if (self.dataflow.roles[role] == "actor" and self.actor_generates) != strategy.generates:
                    raise ValueError(f"role {role!r}: generation sizes must be given for the actor and only for it"
                                     + ("" if self.actor_generates else " (not beside a rollout pool)"))
                if strategy.generates and not self.backend.supports(strategy.generation_pp_size,
                                                                    strategy.generation_tp_size):
                    raise ValueError(f"role {role!r}: actor.generation.backend={self.backend.name!r} generates with "
                                     f"hybrid_engine pp_size = tp_size = 1 only, got pp_size="
                                     f"{strategy.generation_pp_size}, tp_size={strategy.generation_tp_size}")
            actor = self.dataflow.actor_role if self.dataflow.actor_role in pool.roles else None
            costs = {}
            for role in pool.roles:
                if role != actor:
                    costs[role] = self.cost_of(role, layout.strategies[role], count, shares=shares)
            if actor is not None and None not in costs.values():
                resident = sum(cost.resident_bytes for cost in costs.values())
                transient = max((cost.transient_bytes for cost in costs.values()), default=0.0)
                costs[actor] = self.cost_of(actor, layout.strategies[actor], count, resident, transient, shares)
            if None in costs.values() or sum(c.resident_bytes for c in costs.values()) + \
                    max(c.transient_bytes for c in costs.values()) > self.simulator.budget_bytes:
                raise ValueError(f"pool {pool.name!r} ({', '.join(pool.roles)}) does not fit in "
                                 f"{count} devices of {self._usable_text()} with the given strategies")
            results.append(SetResult(costs=costs))
        return replace(self._assemble(layout.pools, results), backend=self.backend.name)

    def check_layout(self, role: str, strategy: RoleStrategy, num_devices: int) -> None:
        """ValueError unless ``strategy``'s model-parallel size divides its pool's ``num_devices`` and its tensor
        parallelism fits in a node."""
        if num_devices % strategy.model_parallel_size or strategy.tp_size > self.cluster.node_size:
            raise ValueError(f"role {role!r}: pp_size*tp_size = {strategy.model_parallel_size} must divide "
                             f"its pool's {num_devices} devices and tp_size {strategy.tp_size} must fit in a "
                             f"node of {self.cluster.node_size}")

    def search(self) -> list[Plan]:
        """The fastest allocation of every feasible placement, fastest placement first."""
        self._check_each_role_fits()
        roles = list(self.dataflow.roles)
        best_per_placement: list[Plan] = []
        for partition in set_partitions(roles):
            sets = [tuple(block) for block in partition]
            minimums = [self.min_devices(block) for block in sets]
            if any(minimum is None for minimum in minimums):
                continue
            best_allocation = self.best_allocation(sets, minimums)
            if best_allocation is not None:
                best_per_placement.append(self.plan_for(sets, best_allocation))
        if not best_per_placement:
            raise ValueError(f"no placement of {', '.join(roles)} fits {self.cluster.num_devices} devices of "
                             f"{self._usable_text()}: every role fits alone on all devices, but not together "
                             f"nor split; use more devices or shorter sequences")
        return sorted(best_per_placement, key=lambda plan: plan.total_seconds)

    def _usable_text(self) -> str:
        hardware = self.cluster.hardware
        return (f"{hardware.usable_memory_bytes / GIB:.1f} GiB usable each ({hardware.device_memory_gib:g} GiB x "
                f"{hardware.usable_memory_fraction:g}, {hardware.name})")

    def _check_each_role_fits(self) -> None:
        """ValueError naming the memory a role needs if it cannot fit even alone on every device."""
        total = self.cluster.num_devices
        for role, kind in self.dataflow.roles.items():
            fits = self.best_actor(total) if kind == "actor" else self.candidates(role, total)
            if fits:
                continue
            spec = self.models[role]
            strategies = list(self._strategies(role, total))
            if not strategies:
                workload = self.workload
                rules = [f"its data-parallel size must divide the {workload.num_samples} samples per step"]
                if kind != "inference":
                    rules.append(f"the {workload.samples_per_update} samples per update")
                if kind == "actor" and not workload.pad_generation:
                    rules.append(f"its generation replicas the {workload.prompts_per_step} prompts")
                raise ValueError(
                    f"role {role!r} ({spec.name}) has no layout on {total} devices that splits the batch evenly: "
                    f"{' and '.join(rules)} (model-parallel sizes reach at most {spec.num_layers} layers x a node "
                    f"of {self.cluster.node_size}); use a batch that is a multiple of the device count")
            need = min(self._footprint(role, strategy, total) for strategy in strategies)
            params = spec.num_params(head=self.dataflow.head_of(role))
            raise ValueError(
                f"role {role!r} ({spec.name}, {params / 1e9:.2f}B parameters, {kind}) does not fit on "
                f"{total} devices: its most memory-frugal layout needs {need / GIB:.1f} GiB per device "
                f"(weights{', gradients, optimizer state' if kind != 'inference' else ''}, activations"
                f"{', generation weights and one sequence of KV cache' if kind == 'actor' else ''}), "
                f"but a device has {self._usable_text()}; use more devices or a smaller model"
                + (f" (actor.generation.backend={self.backend.name!r} generates with tg = pg = 1 and keeps its own "
                   f"copy of the weights: the whole model twice per device; the native backend shards it)"
                   if kind == "actor" and not self.backend.model_parallel_generation else ""))

    def _footprint(self, role: str, strategy: RoleStrategy, num_devices: int) -> float:
        simulator = self.simulator
        spec, head, kind = self.models[role], self.dataflow.head_of(role), self.dataflow.roles[role]
        trained = kind != "inference"
        need = simulator.resident_bytes(spec, head, strategy, num_devices, trained=trained)
        transient = simulator.transient_bytes(spec, head, strategy, trained=trained, num_devices=num_devices)
        if kind != "actor" or not strategy.generates:
            return need + transient
        kv_cache = simulator.kv_bytes_per_sequence(spec, strategy)
        if self.kv_cache_bytes is not None:
            kv_cache = max(kv_cache, self.kv_cache_bytes)
        generation = simulator.generation_extra_bytes(spec, strategy) + kv_cache
        return need + max(transient, generation)


def resolve_models(models: Mapping[str, str | ModelSpec]) -> dict[str, ModelSpec]:
    """Model specs per role from names, config paths or specs (the Planner checks the roles)."""
    return {role: model_spec(value) for role, value in models.items()}


def plan(dataflow: Dataflow | str, models: Mapping[str, str | ModelSpec], workload: Workload,
         cluster: Cluster, *, top: int = 10, backend: str | RolloutBackend = "native",
         kv_cache_gib: float | None = None, granularity: str = "node", max_staleness: int = 0,
         scoring_ahead: bool = True) -> Plan:
    """The fastest plan, with up to ``top - 1`` other placements (ranked) as ``alternatives``, for the actor's
    rollout ``backend`` (``actor.generation.backend``: native or vllm; the plan records it), whose KV cache takes
    ``kv_cache_gib`` per device (vllm: ``actor.generation.vllm_kv_cache_gib``) or, if None, all memory left,
    searching pool sizes of ``granularity`` (``node`` or ``divisor``: Planner). ``max_staleness`` k >= 1 also
    searches the splits with a rollout pool of their own (hybridflow.mapping.overlap), pipelined with staleness k
    and synchronous (k = 0), beside the placements where the actor generates; 0 searches only the latter. With
    ``scoring_ahead`` the pipelined splits also move the frozen scorers (reference, reward model) onto the rollout
    pool, each subset of them (False: a run that cannot score ahead, e.g. ``async.mode: streaming``)."""
    from hybridflow.mapping.overlap import rollout_pool_plans

    flow = get_dataflow(dataflow)
    if not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
        raise ValueError(f"max_staleness (async.max_staleness) must be an integer >= 0, got {max_staleness!r}")
    planner = Planner(dataflow=flow, models=resolve_models(models), workload=workload, cluster=cluster,
                      backend=backend, kv_cache_gib=kv_cache_gib, granularity=granularity)
    ranked = planner.search()
    if max_staleness:
        # sorted is stable: on a tie the synchronous placement (listed first) wins
        ranked = sorted(ranked + rollout_pool_plans(planner, (0, max_staleness), scoring_ahead=scoring_ahead),
                        key=lambda candidate: candidate.total_seconds)
    return replace(ranked[0], alternatives=tuple(ranked[1:top]))


def simulate_plan(layout: Plan, dataflow: Dataflow | str, models: Mapping[str, str | ModelSpec],
                  workload: Workload, cluster: Cluster, *, backend: str | RolloutBackend | None = None,
                  kv_cache_gib: float | None = None) -> Plan:
    """``layout`` (e.g. ``Plan.from_config_fragment(config)``) with its predicted stage times filled in, for the
    rollout ``backend`` given, else the one the layout records, else native."""
    flow = get_dataflow(dataflow)
    backend = backend if backend is not None else (layout.backend or "native")
    planner = Planner(dataflow=flow, models=resolve_models(models), workload=workload, cluster=cluster,
                      backend=backend, kv_cache_gib=kv_cache_gib)
    if layout.rollout_pool is not None:
        from hybridflow.mapping.overlap import simulate_with_rollout_pool

        return simulate_with_rollout_pool(planner, layout)
    return planner.simulate(layout)
