"""Plan: a placement (pools and their roles), each role's parallel strategy, and predicted stage times."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from hybridflow.mapping.dataflow import STAGES
from hybridflow.mapping.rollout import rollout_backend
from hybridflow.mapping.strategy import RoleStrategy


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

    def __post_init__(self) -> None:
        if self.backend is not None:
            rollout_backend(self.backend)  # ValueError naming the allowed values
        placed = [role for pool in self.pools for role in pool.roles]
        if len(placed) != len(set(placed)):
            raise ValueError(f"Plan places a role on several pools: {placed}")
        if set(placed) != set(self.strategies):
            raise ValueError(f"Plan roles on pools {sorted(placed)} differ from roles with strategies "
                             f"{sorted(self.strategies)}")
        names = [pool.name for pool in self.pools]
        if len(names) != len(set(names)):
            raise ValueError(f"Plan has duplicate pool names: {names}")

    @property
    def total_seconds(self) -> float:
        if self.stage_seconds is None:
            raise ValueError("this plan has not been simulated (it came from a config); use simulate_plan")
        return sum(self.stage_seconds.values())

    @property
    def placement_label(self) -> str:
        return " | ".join("+".join(pool.roles) for pool in self.pools)

    @property
    def allocation_label(self) -> str:
        return "|".join(str(pool.num_devices) for pool in self.pools)

    def pool_of(self, role: str) -> PoolPlan:
        return next(pool for pool in self.pools if role in pool.roles)

    def without_prediction(self) -> "Plan":
        return replace(self, stage_seconds=None, pool_stage_seconds=None, role_stage_seconds=None, alternatives=(),
                       workload=None)

    # ---- config fragment ---------------------------------------------------------------------
    def to_config_fragment(self) -> dict[str, Any]:
        """The trainer config keys of this plan: placement.pools/roles, <role>.engine.*, actor.hybrid_engine.*
        and actor.generation.backend when the plan records one
        (what ``hybridflow plan --write`` writes; ``hybridflow train`` applies a plan with typed replacement,
        ``hybridflow.trainers.auto_mapping.apply_plan``)."""
        fragment: dict[str, Any] = {
            "placement": {
                "pools": {pool.name: list(pool.devices_per_node) for pool in self.pools},
                "roles": {role: pool.name for pool in self.pools for role in pool.roles},
            }
        }
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
        strategies = {}
        backend = None
        for role in roles_cfg:
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
        return cls(pools=pools, strategies=strategies, backend=backend)

    # ---- text --------------------------------------------------------------------------------
    def describe(self) -> str:
        """The plan as lines of text: pools, roles with strategies, predicted stage seconds."""
        lines = []
        for pool in self.pools:
            lines.append(f"pool {pool.name}: {pool.num_devices} devices {list(pool.devices_per_node)}")
            for role in pool.roles:
                strategy = self.strategies[role]
                dp_size = strategy.dp_size(pool.num_devices)
                text = f"  {role:<10} {strategy.describe()} (d={dp_size})"
                if self.role_stage_seconds is not None:
                    stage_text = ", ".join(f"{stage} {seconds:.1f}s"
                                           for stage, seconds in self.role_stage_seconds[role].items())
                    text += f"  [{stage_text}]"
                lines.append(text)
        if self.stage_seconds is not None:
            stage_text = ", ".join(f"{stage} {self.stage_seconds[stage]:.1f}s" for stage in STAGES)
            lines.append(f"predicted iteration: {self.total_seconds:.1f}s ({stage_text})")
        return "\n".join(lines)


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
