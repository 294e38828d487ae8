"""ReferenceWorker: the frozen initial policy, scoring responses for the KL penalty; AdapterReferenceWorker: the
same role for a LoRA actor, computed by the actor's own model with its adapters off (no second copy)."""

from __future__ import annotations

from hybridflow.controller import Worker, register
from hybridflow.protocol import DataProto
from hybridflow.workers.base import SEQUENCE_KEYS, ModelWorker, rollout_temperature, tensors_of


class ReferenceWorker(ModelWorker):
    """Log-probs of the responses under the reference weights (never trained)."""

    TRAINABLE = False
    # fp32 weights computing by autocast, as the actor's masters do: with the actor's initial model the KL to it is
    # then exactly 0 before the first update (bf16-held weights gave ~1e-3 per token: autocast leaves norms and
    # residual adds in the weights' dtype). Costs twice a bf16 copy's memory; docs/engines.md, "Precision".
    FP32_WEIGHTS = True

    @register("3D_PROTO")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_logprobs`` [B, T] aligned to ``responses``."""
        return DataProto.from_dict(tensors={"ref_logprobs": self._forward(data, ("logprobs",))["logprobs"]})


class AdapterReferenceWorker(Worker):
    """The reference of a LoRA actor: the actor's base model, i.e. its model with the adapters switched off.

    It holds no weights: it must be colocated with the actor (same pool, built after it) and runs the actor's
    engine, under the actor's parallel layout, inside ``adapters_disabled``.
    """

    def __init__(self, actor_role: str = "actor") -> None:
        self.actor = self.colocated_role(actor_role)
        if getattr(self.actor.engine, "lora", None) is None:
            raise ValueError(f"AdapterReferenceWorker needs a colocated {actor_role!r} role with LoRA adapters "
                             f"(actor.lora); without them use ReferenceWorker")
        self.set_parallel_layout(self.actor.engine.layout)

    @register("3D_PROTO")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_logprobs`` [B, T] aligned to ``responses``, under the actor's base weights."""
        engine = self.actor.engine
        with engine.adapters_disabled():
            logprobs_BT = engine.forward(tensors_of(data, SEQUENCE_KEYS), outputs=("logprobs",),
                                         temperature=rollout_temperature(data))["logprobs"]
        return DataProto.from_dict(tensors={"ref_logprobs": logprobs_BT})
