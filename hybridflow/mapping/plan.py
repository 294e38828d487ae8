"""Plan: a placement (pools and their roles), each role's parallel strategy, and predicted stage times."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from hybridflow.mapping.dataflow import STAGES
from hybridflow.mapping.rollout import rollout_backend
from hybridflow.mapping.strategy import RoleStrategy

ROLLOUT_ROLE = "rollout"
"""The ``placement.roles`` key of a pool of generation replicas of its own (hybridflow.trainers.config.rl)."""
SCORING_AHEAD_ROLES = ("reference", "reward")
"""Frozen scoring roles that may share the rollout pool with k >= 1 (hybridflow.trainers.config.rl): they score each
batch in the replicas' processes right after its generation, ahead of the trainer (docs/async.md)."""


def rollout_pool_roles(scoring_ahead: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The roles of a rollout pool whose replicas also run ``scoring_ahead``, in their canonical order (the
    replicas first, then the scorers in ``SCORING_AHEAD_ROLES`` order), so equal pools compare equal."""
    return (ROLLOUT_ROLE, *(role for role in SCORING_AHEAD_ROLES if role in scoring_ahead))


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """One colocated set: the roles that time-share a pool of devices."""

    name: str
    """Pool name in the config (``placement.pools``)."""
    roles: tuple[str, ...]
    """Roles placed on this pool."""
    devices_per_node: tuple[int, ...]
    """Devices the pool takes on each node it spans."""

    def __post_init__(self) -> None:
        if not self.roles:
            raise ValueError(f"PoolPlan {self.name!r} has no roles")
        if not self.devices_per_node or min(self.devices_per_node) < 1:
            raise ValueError(f"PoolPlan {self.name!r}: devices_per_node must be positive counts, "
                             f"got {self.devices_per_node}")

    @property
    def num_devices(self) -> int:
        return sum(self.devices_per_node)


@dataclass(frozen=True, kw_only=True)
class OverlapSeconds:
    """Predicted seconds of a split placement with a rollout pool, per side of the pipeline (docs/async.md,
    "Placement"): the rollout pool receives the weights, generates and scores ahead with the frozen scorers it
    holds; the training pools send the weights, score the rest and train."""

    receive: float
    """Rollout pool: the weight payload's transfer from the trainer's rank 0 to each of the pool's other nodes,
    unpacking and verifying it on every replica."""
    generation: float
    """Rollout pool: generating the step's samples (one replica per device, pg = tg = 1)."""
    send: float
    """Training pool: gathering the policy on rank 0, casting and packing it, its checksums."""
    preparation: float
    """Training pools: the scoring left to them, log-probs and the reference, critic and reward not on the rollout
    pool (max over pools, summed within one)."""
    training: float
    """Training pools: the actor's and critic's updates."""
    scoring_ahead: float = 0.0
    """Rollout pool: the forward over the step's samples of the frozen scorers it holds (``SCORING_AHEAD_ROLES``),
    one after another in the replicas' processes, after the generation; 0 without scorers there."""

    @property
    def rollout(self) -> float:
        return self.receive + self.generation + self.scoring_ahead

    @property
    def trainer(self) -> float:
        return self.send + self.preparation + self.training

    def step(self, max_staleness: int) -> float:
        """k >= 1: the two sides overlap and the slower one sets the pace (steady state); k = 0: they take turns."""
        return max(self.rollout, self.trainer) if max_staleness >= 1 else self.rollout + self.trainer


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What `hybridflow plan` prints and `hybridflow train` consumes (through to_config_fragment)."""

    pools: tuple[PoolPlan, ...]
    """The colocated sets; pools are disjoint and run concurrently."""
    strategies: dict[str, RoleStrategy]
    """Role -> parallel strategy on its pool (the actor's includes its generation sizes)."""
    stage_seconds: dict[str, float] | None = None
    """Predicted seconds per stage (max over pools of the sum over each pool's roles); None if not simulated."""
    pool_stage_seconds: dict[str, dict[str, float]] | None = field(default=None, compare=False)
    """Pool name -> stage -> predicted seconds of that pool."""
    role_stage_seconds: dict[str, dict[str, float]] | None = field(default=None, compare=False)
    """Role -> stage -> predicted seconds of that role."""
    alternatives: tuple["Plan", ...] = field(default=(), compare=False)
    """Other placements, fastest first (only on the plan the search returns)."""
    workload: Any = field(default=None, compare=False)
    """The ``Workload`` (batch, lengths, epochs) this plan was planned for; None for a plan read from a config.
    Applying a plan to a run with another workload is refused (``apply_plan``)."""
    backend: str | None = None
    """The actor's rollout engine it was planned for (``actor.generation.backend``: native or vllm; written into
    the config fragment); None for a fragment that does not name one."""
    rollout_pool: PoolPlan | None = None
    """A pool of generation replicas of its own (``placement.roles.rollout``; roles ``rollout_pool_roles``: the
    replicas, then any scorers of ``SCORING_AHEAD_ROLES`` placed with them, which need k >= 1); None: the actor
    generates itself through the 3D-HybridEngine."""
    max_staleness: int = 0
    """``async.max_staleness`` k of the plan: >= 1 only with a rollout pool (the pipelined asynchronous step)."""
    overlap: OverlapSeconds | None = field(default=None, compare=False)
    """Predicted seconds per side of a plan with a rollout pool; None otherwise or if not simulated."""

    def __post_init__(self) -> None:
        if self.backend is not None:
            rollout_backend(self.backend)  # ValueError naming the allowed values
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise ValueError(f"Plan.max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        if self.max_staleness and self.rollout_pool is None:
            raise ValueError(f"Plan.max_staleness {self.max_staleness} needs a rollout pool (async.max_staleness >= 1 "
                             f"generates on a pool of its own)")
        if self.rollout_pool is not None:
            self._check_rollout_pool(self.rollout_pool)
        placed = [role for pool in self.all_pools for role in pool.roles if role != ROLLOUT_ROLE]
        if len(placed) != len(set(placed)):
            raise ValueError(f"Plan places a role on several pools: {placed}")
        if set(placed) != set(self.strategies):
            raise ValueError(f"Plan roles on pools {sorted(placed)} differ from roles with strategies "
                             f"{sorted(self.strategies)}")
        names = [pool.name for pool in self.all_pools]
        if len(names) != len(set(names)):
            raise ValueError(f"Plan has duplicate pool names: {names}")

    def _check_rollout_pool(self, pool: PoolPlan) -> None:
        """ValueError unless ``pool`` holds the replicas and at most the scorers that may score ahead, those only
        with k >= 1 (they score batch i + 1 while the trainer updates on batch i)."""
        allowed = f"{ROLLOUT_ROLE!r} with any of {', '.join(map(repr, SCORING_AHEAD_ROLES))}"
        scorers = [role for role in pool.roles if role != ROLLOUT_ROLE]
        if ROLLOUT_ROLE not in pool.roles or len(set(pool.roles)) != len(pool.roles) \
                or not set(scorers) <= set(SCORING_AHEAD_ROLES):
            raise ValueError(f"Plan.rollout_pool.roles got {pool.roles}; allowed: {allowed} (frozen scorers that "
                             f"score ahead on the replicas' processes)")
        if scorers and self.max_staleness < 1:
            raise ValueError(f"Plan.max_staleness got {self.max_staleness} with {', '.join(scorers)} on the rollout "
                             f"pool; allowed: an integer >= 1 (the scorers score a batch ahead while the trainer "
                             f"updates on the one before)")

    @property
    def scoring_ahead(self) -> tuple[str, ...]:
        """The frozen scorers on the rollout pool (they score each batch there after generating it)."""
        if self.rollout_pool is None:
            return ()
        return tuple(role for role in self.rollout_pool.roles if role != ROLLOUT_ROLE)

    @property
    def all_pools(self) -> tuple[PoolPlan, ...]:
        """The role pools, then the rollout pool if there is one."""
        return self.pools + ((self.rollout_pool,) if self.rollout_pool is not None else ())

    @property
    def total_seconds(self) -> float:
        """Predicted seconds per RL step: the stages' sum, or with a rollout pool the pipeline's step
        (``OverlapSeconds.step``)."""
        if self.stage_seconds is None:
            raise ValueError("this plan has not been simulated (it came from a config); use simulate_plan")
        if self.overlap is not None:
            return self.overlap.step(self.max_staleness)
        return sum(self.stage_seconds.values())

    @property
    def mode(self) -> str:
        """``colocated`` (one pool), ``split`` (several pools, synchronous), ``split async k=K`` (a rollout pool
        generating ahead), ``split async k=K scoring ahead`` (with frozen scorers on the rollout pool: the placement
        label names them) or ``split sync rollout`` (a rollout pool taking turns with the trainer, k = 0)."""
        if self.rollout_pool is None:
            return "colocated" if len(self.pools) == 1 else "split"
        if not self.max_staleness:
            return "split sync rollout"
        return f"split async k={self.max_staleness}" + (" scoring ahead" if self.scoring_ahead else "")

    @property
    def placement_label(self) -> str:
        label = " | ".join("+".join(pool.roles) for pool in self.all_pools)
        return label if self.rollout_pool is None else f"{label} (k={self.max_staleness})"

    @property
    def allocation_label(self) -> str:
        return "|".join(str(pool.num_devices) for pool in self.all_pools)

    def pool_of(self, role: str) -> PoolPlan:
        return next(pool for pool in self.all_pools if role in pool.roles)

    def without_prediction(self) -> "Plan":
        return replace(self, stage_seconds=None, pool_stage_seconds=None, role_stage_seconds=None, alternatives=(),
                       workload=None, overlap=None)

    # ---- config fragment ---------------------------------------------------------------------
    def to_config_fragment(self) -> dict[str, Any]:
        """The trainer config keys of this plan: placement.pools/roles, <role>.engine.*, actor.hybrid_engine.*
        and actor.generation.backend when the plan records one
        (what ``hybridflow plan --write`` writes; ``hybridflow train`` applies a plan with typed replacement,
        ``hybridflow.trainers.auto_mapping.apply_plan``)."""
        fragment: dict[str, Any] = {
            "placement": {
                "pools": {pool.name: list(pool.devices_per_node) for pool in self.all_pools},
                "roles": {role: pool.name for pool in self.all_pools for role in pool.roles},
            }
        }
        if self.rollout_pool is not None:
            fragment["async"] = {"max_staleness": self.max_staleness}
        for role, strategy in self.strategies.items():
            section = fragment.setdefault(role, {})
            section["engine"] = {"layout": strategy.layout, "pp_size": strategy.pp_size, "tp_size": strategy.tp_size}
            if strategy.generates:
                section["hybrid_engine"] = {"pp_size": strategy.generation_pp_size,
                                         "tp_size": strategy.generation_tp_size}
                if self.backend is not None:
                    section["generation"] = {"backend": self.backend}
        return fragment

    @classmethod
    def from_config_fragment(cls, fragment: Mapping[str, Any]) -> "Plan":
        """The plan a config describes (its placement and layouts; no predicted times).

        Roles named in ``placement.roles`` are placed; an engine section missing for a placed role
        means the engine defaults (fsdp, p = t = 1); a role with a ``hybrid_engine`` section generates.
        """
        placement = fragment.get("placement")
        if not isinstance(placement, Mapping) or "pools" not in placement or "roles" not in placement:
            raise ValueError("config fragment needs placement.pools and placement.roles, got "
                             f"{sorted(placement) if isinstance(placement, Mapping) else placement!r}")
        pools_cfg, roles_cfg = placement["pools"], placement["roles"]
        unknown_pools = sorted({pool for pool in roles_cfg.values() if pool not in pools_cfg})
        if unknown_pools:
            raise ValueError(f"placement.roles names pools {unknown_pools} missing from placement.pools "
                             f"{sorted(pools_cfg)}")
        pools = tuple(
            PoolPlan(name=name, roles=tuple(role for role, pool in roles_cfg.items() if pool == name),
                     devices_per_node=tuple(int(count) for count in counts))
            for name, counts in pools_cfg.items() if name in roles_cfg.values()
        )
        rollout_pool = next((pool for pool in pools if ROLLOUT_ROLE in pool.roles), None)
        pools = tuple(pool for pool in pools if pool is not rollout_pool)
        if rollout_pool is not None and set(rollout_pool.roles) <= set(rollout_pool_roles(rollout_pool.roles)):
            # the config's key order is not the plan's: scorers on the pool follow the replicas
            rollout_pool = replace(rollout_pool, roles=rollout_pool_roles(rollout_pool.roles))
        strategies = {}
        backend = None
        for role in (role for role in roles_cfg if role != ROLLOUT_ROLE):
            section = fragment.get(role, {}) or {}
            engine = section.get("engine", {}) or {}
            generation = section.get("hybrid_engine")
            strategies[role] = RoleStrategy(
                layout=engine.get("layout", "fsdp"), pp_size=int(engine.get("pp_size", 1)),
                tp_size=int(engine.get("tp_size", 1)),
                generation_pp_size=int(generation.get("pp_size", 1)) if generation is not None else 0,
                generation_tp_size=int(generation.get("tp_size", 1)) if generation is not None else 0,
            )
            if generation is not None:
                backend = (section.get("generation", {}) or {}).get("backend", backend)
        max_staleness = int(((fragment.get("async") or {}).get("max_staleness", 0)))
        return cls(pools=pools, strategies=strategies, backend=backend, rollout_pool=rollout_pool,
                   max_staleness=max_staleness)

    # ---- text --------------------------------------------------------------------------------
    def describe(self) -> str:
        """The plan as lines of text: pools, roles with strategies, predicted stage seconds."""
        lines = []
        for pool in self.pools:
            lines.append(f"pool {pool.name}: {pool.num_devices} devices {list(pool.devices_per_node)}")
            lines.extend(self._role_line(role, pool) for role in pool.roles)
        if self.rollout_pool is not None:
            pool = self.rollout_pool
            lines.append(f"pool {pool.name}: {pool.num_devices} devices {list(pool.devices_per_node)}")
            lines.append(f"  {ROLLOUT_ROLE:<10} {pool.num_devices} generation replicas (pg 1, tg 1), "
                         f"async.max_staleness={self.max_staleness}")
            # scorers with the replicas score each batch in their processes once it is generated
            lines.extend(self._role_line(role, pool) + "  scores ahead" for role in self.scoring_ahead)
        if self.overlap is not None:
            lines.append(f"predicted step: {self.total_seconds:.3g}s ({self.mode}; {self.overlap_text()})")
        elif self.stage_seconds is not None:
            stage_text = ", ".join(f"{stage} {self.stage_seconds[stage]:.1f}s" for stage in STAGES)
            lines.append(f"predicted iteration: {self.total_seconds:.1f}s ({stage_text})")
        reason = self.reason()
        if reason:
            lines.append(reason)
        return "\n".join(lines)

    def _role_line(self, role: str, pool: PoolPlan) -> str:
        """One role of ``pool``: its strategy, data-parallel size and predicted stage seconds when simulated."""
        strategy = self.strategies[role]
        text = f"  {role:<10} {strategy.describe()} (d={strategy.dp_size(pool.num_devices)})"
        if self.role_stage_seconds is not None:
            seconds = self.role_stage_seconds[role]
            text += "  [" + ", ".join(f"{stage} {value:.1f}s" for stage, value in seconds.items()) + "]"
        return text

    def overlap_text(self) -> str:
        """The two sides of a plan with a rollout pool and how they compose, in seconds."""
        assert self.overlap is not None
        parts = self.overlap
        rollout = f"rollout pool {parts.rollout:.3g}s = receive {parts.receive:.3g} + generation {parts.generation:.3g}"
        if self.scoring_ahead:
            rollout += f" + scoring ahead ({', '.join(self.scoring_ahead)}) {parts.scoring_ahead:.3g}"
        trainer = (f"training pools {parts.trainer:.3g}s = send {parts.send:.3g} + preparation "
                   f"{parts.preparation:.3g} + training {parts.training:.3g}")
        compose = "max" if self.max_staleness else "sum"
        return f"{compose} of {rollout} and {trainer}"

    def reason(self) -> str:
        """Why the search picked this plan: its predicted step against the fastest alternative of each other mode
        (empty for a plan without simulated alternatives)."""
        if self.stage_seconds is None or all(plan.rollout_pool is None for plan in (self, *self.alternatives)):
            return ""  # the synchronous search's output stays as it was
        best_of: dict[str, Plan] = {}
        for other in self.alternatives:
            if other.mode != self.mode and other.mode not in best_of:
                best_of[other.mode] = other
        if not best_of:
            return ""
        others = "; ".join(f"{mode} {other.placement_label} on {other.allocation_label} devices "
                           f"{other.total_seconds:.3g}s" for mode, other in best_of.items())
        return f"chosen: {self.mode}, {self.total_seconds:.3g}s per step, against {others}"


def format_table(plans: list[Plan]) -> str:
    """A ranked table of simulated plans: placement, devices per pool, stage seconds, total."""
    header = f"{'rank':>4}  {'placement':<40} {'devices':<14}" + "".join(f"{stage:>12}" for stage in STAGES) \
        + f"{'total':>10}"
    rows = [header, "-" * len(header)]
    for rank, plan in enumerate(plans, start=1):
        assert plan.stage_seconds is not None
        rows.append(f"{rank:>4}  {plan.placement_label:<40} {plan.allocation_label:<14}"
                    + "".join(f"{plan.stage_seconds[stage]:>11.1f}s" for stage in STAGES)
                    + f"{plan.total_seconds:>9.1f}s")
    return "\n".join(rows)
