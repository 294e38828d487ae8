"""Supervised roles on the same engines: SFTWorker (next-token loss) and PreferenceWorker (Bradley-Terry reward model).

Shape legend: B = pairs (or rows) on this rank, S = sequence tokens, T = response tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridflow.controller import register
from hybridflow.protocol import DataProto
from hybridflow.workers.actor import next_token_loss_fn
from hybridflow.workers.base import SEQUENCE_KEYS, ModelWorker, tensors_of

PAIR_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask")


class SFTWorker(ModelWorker):
    """A causal LM trained on the response tokens of prompt/response pairs."""

    @register("DP_METRICS")
    def train_batch(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on this batch's mean response-token NLL."""
        return self.engine.train_step(tensors_of(data, SEQUENCE_KEYS), next_token_loss_fn(1.0), outputs=("logprobs",))

    @register("3D_PROTO")
    def evaluate(self, data: DataProto) -> DataProto:
        """Per-row response-token NLL sum and token count (``nll_sum`` [B], ``num_tokens`` [B]); no update."""
        logprobs_BT = self.engine.forward(tensors_of(data, SEQUENCE_KEYS), outputs=("logprobs",))["logprobs"]
        mask_BT = data.batch["response_mask"].to(logprobs_BT.dtype)
        return DataProto.from_dict(tensors={"nll_sum": -(logprobs_BT * mask_BT).sum(-1), "num_tokens": mask_BT.sum(-1)})


def interleave_pairs(data: DataProto) -> dict[str, Tensor]:
    """Rows chosen_0, rejected_0, chosen_1, ... -> tensors [2B, S] (pairs stay adjacent in micro-batches)."""
    tensors = {}
    for key in PAIR_KEYS:
        chosen, rejected = data.batch[f"chosen_{key}"], data.batch[f"rejected_{key}"]
        tensors[key] = torch.stack([chosen, rejected], dim=1).flatten(0, 1)
    return tensors


def bradley_terry_loss_fn(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """-log sigmoid(score_chosen - score_rejected), averaged over all pairs of the mini-batch."""
    scores_B2 = outputs["scores"].view(-1, 2)
    margin_B = scores_B2[:, 0] - scores_B2[:, 1]
    num_pairs = batch["num_sequences_global"] / 2
    loss = -F.logsigmoid(margin_B).sum() / num_pairs
    return loss, {"accuracy": (margin_B > 0).float().mean(), "margin": margin_B.detach().mean()}


class PreferenceWorker(ModelWorker):
    """A score-head model trained with the Bradley-Terry loss on chosen/rejected pairs."""

    @register("DP_METRICS")
    def train_batch(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on the batch's pairs."""
        return self.engine.train_step(interleave_pairs(data), bradley_terry_loss_fn, outputs=("scores",), group_size=2)

    @register("3D_PROTO")
    def evaluate(self, data: DataProto) -> DataProto:
        """``chosen_scores`` and ``rejected_scores`` [B] of each pair; no update."""
        scores_2B = self.engine.forward(interleave_pairs(data), outputs=("scores",))["scores"]
        scores_B2 = scores_2B.view(-1, 2)
        return DataProto.from_dict(tensors={"chosen_scores": scores_B2[:, 0], "rejected_scores": scores_B2[:, 1]})
