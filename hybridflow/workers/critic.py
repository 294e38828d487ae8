"""CriticWorker: the value model — values of the states before each response token, and its update.

Shape legend: B = samples on this rank, T = response tokens.
A ``prefix`` names the tensors of a second critic in the same batch: Safe-RLHF's cost critic
(``prefix="cost_"``) returns ``cost_values``, trains on ``cost_values``/``cost_returns`` and logs
``cost_critic/*``, so both critics' outputs sit side by side in one DataProto.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algorithms import aggregate_loss, gae_advantages, masked_mean, value_loss
from hybridflow.controller import register
from hybridflow.protocol import DataProto
from hybridflow.workers.base import SEQUENCE_KEYS, ModelWorker, rollout_temperature, step_context, tensors_of
from hybridflow.workers.spec import EngineSpec, ValueLossConfig

TOKEN_REWARDS = "token_rewards"
"""Batch key of the per-token rewards GAE reads (``update_critic_from_own_values``)."""
ROW_INDEX = "row_index"
"""Batch key of each row's position, so the values of packed micro-batches go back to their rows."""


def value_loss_fn(spec: ValueLossConfig, *, prefix: str = ""):
    """The per-micro-batch clipped value loss the training engine calls (old values and returns read from
    ``{prefix}values`` and ``{prefix}returns``)."""
    clip_range = spec.value_clip if spec.value_clip > 0 else None
    old_values_key, returns_key = f"{prefix}values", f"{prefix}returns"

    def loss_fn(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT = batch["response_mask"]
        loss_BT, clipped_BT = value_loss(outputs["values"], batch[old_values_key], batch[returns_key],
                                         clip_range=clip_range, mask_BT=mask_BT)
        loss = aggregate_loss(loss_BT, mask_BT, aggregation=spec.loss_aggregation,
                              num_tokens_global=batch["num_tokens_global"].clamp(min=1),
                              num_sequences_global=batch["num_sequences_global"],
                              constant_normalizer=spec.max_response_length)
        return loss, {"value_clip_fraction": masked_mean(clipped_BT.float(), mask_BT),
                      "values_mean": masked_mean(outputs["values"].detach(), mask_BT)}

    return loss_fn


def own_values_loss_fn(spec: ValueLossConfig, *, gamma: float, lam: float, values_out: list, prefix: str = ""):
    """The value loss of an update whose forward also provides the old values (one epoch of one mini-batch):
    each micro-batch's values, detached, are the old values and GAE's baseline for its returns (from
    ``token_rewards``). Appends (rows, values_BT) to ``values_out`` so the caller can hand the values back."""
    loss_fn = value_loss_fn(spec, prefix=prefix)

    def loss_with_own_values(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        values_BT = outputs["values"].detach().float()
        mask_BT = batch["response_mask"].to(values_BT.dtype)
        _, returns_BT = gae_advantages(batch[TOKEN_REWARDS].to(values_BT.dtype), values_BT, mask_BT,
                                       gamma=gamma, lam=lam)
        values_out.append((batch[ROW_INDEX], values_BT))
        return loss_fn(outputs, {**batch, f"{prefix}values": values_BT, f"{prefix}returns": returns_BT})

    return loss_with_own_values


class CriticWorker(ModelWorker):
    """A backbone with a value head, trained to regress the returns."""

    def __init__(self, spec: EngineSpec, loss: ValueLossConfig, *, prefix: str = "") -> None:
        super().__init__(spec)
        self.loss = loss
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
        metrics = self._train_epochs(data, keys=keys, loss_fn=value_loss_fn(self.loss, prefix=self.prefix),
                                     outputs=("values",), ppo_epochs=self.loss.ppo_epochs,
                                     mini_batch_size=self.loss.mini_batch_size, seed=int(data.meta_info.get("seed", 0)),
                                     on_non_finite=self.loss.on_non_finite,
                                     context=step_context(f"{self.prefix}critic", data))
        return {f"{self.prefix}critic/{name}": value for name, value in metrics.items()}

    @register("3D_PROTO")
    def update_critic_from_own_values(self, data: DataProto) -> DataProto:
        """One optimizer step whose forward also computes the values (``compute_values`` folded into
        ``update_critic`` when the critic makes one step per batch: trainers/redundant_passes.py). Reads
        ``token_rewards`` [B, T] and ``meta_info`` ``gamma``/``lam`` (one mini-batch: no shuffling, no seed);
        returns ``{prefix}values`` [B, T] (the weights before the step, as ``compute_values`` would give them up
        to float rounding) with the update's metrics in ``meta_info['metrics']``."""
        values_out: list[tuple[Tensor, Tensor]] = []
        loss_fn = own_values_loss_fn(self.loss, gamma=float(data.meta_info["gamma"]), lam=float(data.meta_info["lam"]),
                                     values_out=values_out, prefix=self.prefix)
        batch = tensors_of(data, SEQUENCE_KEYS + (TOKEN_REWARDS,))
        batch[ROW_INDEX] = torch.arange(len(data))
        metrics = self.engine.train_step(batch, loss_fn, outputs=("values",), on_non_finite=self.loss.on_non_finite,
                                         context=step_context(f"{self.prefix}critic", data),
                                         temperature=rollout_temperature(data))
        values_BT = torch.zeros(data["response_mask"].shape, dtype=torch.float32)
        for rows_b, micro_values_BT in values_out:  # empty off the last pipeline stage, whose copy is returned
            values_BT[rows_b.cpu()] = micro_values_BT.cpu()
        return DataProto.from_dict(tensors={f"{self.prefix}values": values_BT},
                                   meta_info={"metrics": {f"{self.prefix}critic/{name}": value
                                                          for name, value in metrics.items()}})
