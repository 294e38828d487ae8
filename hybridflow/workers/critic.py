"""CriticWorker: the value model — values of the states before each response token, and its update.

Shape legend: B = samples on this rank, T = response tokens.
A ``prefix`` names the tensors of a second critic in the same batch: Safe-RLHF's cost critic
(``prefix="cost_"``) returns ``cost_values``, trains on ``cost_values``/``cost_returns`` and logs
``cost_critic/*``, so both critics' outputs sit side by side in one DataProto.
"""

from __future__ import annotations

from torch import Tensor

from hybridflow.algorithms import aggregate_loss, masked_mean, value_loss
from hybridflow.controller import register
from hybridflow.protocol import DataProto
from hybridflow.workers.base import SEQUENCE_KEYS, ModelWorker, step_context
from hybridflow.workers.spec import CriticSpec


def value_loss_fn(spec: CriticSpec, *, prefix: str = ""):
    """The per-micro-batch clipped value loss the training engine calls (old values and returns read from
    ``{prefix}values`` and ``{prefix}returns``)."""
    clip_range = spec.loss.value_clip if spec.loss.value_clip > 0 else None
    old_values_key, returns_key = f"{prefix}values", f"{prefix}returns"

    def loss_fn(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT = batch["response_mask"]
        loss_BT, clipped_BT = value_loss(outputs["values"], batch[old_values_key], batch[returns_key],
                                         clip_range=clip_range, mask_BT=mask_BT)
        loss = aggregate_loss(loss_BT, mask_BT, aggregation=spec.loss.loss_aggregation,
                              num_tokens_global=batch["num_tokens_global"].clamp(min=1),
                              num_sequences_global=batch["num_sequences_global"],
                              constant_normalizer=spec.sizes.max_response_length)
        return loss, {"value_clip_fraction": masked_mean(clipped_BT.float(), mask_BT),
                      "values_mean": masked_mean(outputs["values"].detach(), mask_BT)}

    return loss_fn


class CriticWorker(ModelWorker):
    """A backbone with a value head, trained to regress the returns."""

    def __init__(self, spec: CriticSpec, *, prefix: str = "") -> None:
        super().__init__(spec.engine)
        self.critic_spec = spec
        self.prefix = prefix

    @register("3D_PROTO")
    def compute_values(self, data: DataProto) -> DataProto:
        """``{prefix}values`` [B, T]: value of the state just before responses[:, t]."""
        return DataProto.from_dict(tensors={f"{self.prefix}values": self._forward(data, ("values",))["values"]})

    @register("DP_METRICS")
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Epochs of clipped value-loss steps over the step's samples (on ``{prefix}values`` and
        ``{prefix}returns``); ``meta_info['seed']`` seeds the shuffling. Metrics are ``{prefix}critic/*``."""
        keys = SEQUENCE_KEYS + (f"{self.prefix}values", f"{self.prefix}returns")
        loss = self.critic_spec.loss
        metrics = self._train_epochs(data, keys=keys, loss_fn=value_loss_fn(self.critic_spec, prefix=self.prefix),
                                     outputs=("values",), ppo_epochs=loss.ppo_epochs,
                                     mini_batch_size=self.critic_spec.sizes.mini_batch_size,
                                     seed=int(data.meta_info.get("seed", 0)), on_non_finite=loss.on_non_finite,
                                     context=step_context(f"{self.prefix}critic", data))
        return {f"{self.prefix}critic/{name}": value for name, value in metrics.items()}
