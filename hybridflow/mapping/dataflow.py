"""Dataflow: which models an RLHF algorithm runs and what each does in the three stages of an iteration."""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("generation", "preparation", "training")
"""An iteration's stages, in order: actor generation; scoring (reference/critic/reward inference and the
actor's log-probs); training (actor and critic updates)."""

ROLE_KINDS = ("actor", "critic", "inference")
"""actor: generates, computes log-probs, trains; critic: computes values, trains; inference: scores only."""


@dataclass(frozen=True, kw_only=True)
class Dataflow:
    """The models of an algorithm by role, and how often the actor generates per iteration."""

    name: str
    """Algorithm name (as in ``hybridflow plan --algorithm``)."""
    roles: dict[str, str]
    """Role -> kind (one of ROLE_KINDS); exactly one role is of kind 'actor'."""
    generation_passes: int = 1
    """Times the actor generates for every prompt per iteration (ReMax adds a greedy baseline pass)."""

    def __post_init__(self) -> None:
        bad = {role: kind for role, kind in self.roles.items() if kind not in ROLE_KINDS}
        if bad:
            raise ValueError(f"Dataflow.roles has unknown kinds {bad}; allowed: {', '.join(ROLE_KINDS)}")
        actors = [role for role, kind in self.roles.items() if kind == "actor"]
        if len(actors) != 1:
            raise ValueError(f"Dataflow.roles must have exactly one 'actor' role, got {actors}")
        if not isinstance(self.generation_passes, int) or self.generation_passes < 1:
            raise ValueError(f"Dataflow.generation_passes must be a positive integer, got {self.generation_passes!r}")

    @property
    def actor_role(self) -> str:
        return next(role for role, kind in self.roles.items() if kind == "actor")

    def head_of(self, role: str) -> str:
        """'lm' for the actor and the reference (they produce log-probs), 'value' for scalar heads."""
        return "lm" if self.roles[role] == "actor" or role == "reference" else "value"


DATAFLOWS: dict[str, Dataflow] = {
    "ppo": Dataflow(name="ppo", roles={"actor": "actor", "critic": "critic", "reference": "inference",
                                       "reward": "inference"}),
    "safe-rlhf": Dataflow(name="safe-rlhf", roles={"actor": "actor", "critic": "critic", "reference": "inference",
                                                   "reward": "inference", "cost": "inference"}),
    "remax": Dataflow(name="remax", roles={"actor": "actor", "reference": "inference", "reward": "inference"},
                      generation_passes=2),
    "grpo": Dataflow(name="grpo", roles={"actor": "actor", "reference": "inference", "reward": "inference"}),
}


def dataflow(name: str | Dataflow) -> Dataflow:
    """A built-in dataflow by algorithm name."""
    if isinstance(name, Dataflow):
        return name
    if name.lower() not in DATAFLOWS:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(DATAFLOWS)}")
    return DATAFLOWS[name.lower()]
