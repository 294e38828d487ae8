"""Supervised roles on the same engines: SFTWorker (next-token loss) and PreferenceWorker (Bradley-Terry reward model).

A reward model is one of two kinds, told apart by its head:
- ``score`` head: a scalar read at the last real token (the InstructGPT reward model);
- ``lm`` head (a *likelihood* reward model): the reward of a response is ``beta`` times the sum of its
  tokens' log-probabilities under the model, so the reward is a sum of per-token terms that PPO can
  credit token by token. Bradley-Terry on these sums is the DPO loss without a reference model.

Shape legend: B = pairs (or rows) on this rank, S = sequence tokens, T = response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algorithms.preference import bradley_terry_loss, likelihood_scores
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
        mask_BT = data["response_mask"].to(logprobs_BT.dtype)
        return DataProto.from_dict(tensors={"nll_sum": -(logprobs_BT * mask_BT).sum(-1), "num_tokens": mask_BT.sum(-1)})


def interleave_pairs(data: DataProto) -> dict[str, Tensor]:
    """Rows chosen_0, rejected_0, chosen_1, ... -> tensors [2B, S] (pairs stay adjacent in micro-batches)."""
    tensors = {}
    for key in PAIR_KEYS:
        chosen, rejected = data[f"chosen_{key}"], data[f"rejected_{key}"]
        tensors[key] = torch.stack([chosen, rejected], dim=1).flatten(0, 1)
    return tensors


def bradley_terry_loss_fn(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """-log sigmoid(score_chosen - score_rejected), averaged over all pairs of the mini-batch."""
    scores_B2 = outputs["scores"].view(-1, 2)
    loss, margin_B = bradley_terry_loss(scores_B2[:, 0], scores_B2[:, 1],
                                        num_pairs_global=batch["num_sequences_global"] / 2)
    return loss, {"accuracy": (margin_B > 0).float().mean(), "margin": margin_B.detach().mean()}


def likelihood_preference_loss_fn(beta: float, nll_coef: float):
    """Bradley-Terry on likelihood scores, plus ``nll_coef`` x the chosen responses' mean token NLL.

    The NLL term keeps the chosen answers likely: Bradley-Terry alone only widens the gap, and may
    do so by making both answers of a pair less likely.
    """

    def loss_fn(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        logprobs_B2T = outputs["logprobs"].view(-1, 2, outputs["logprobs"].shape[-1])
        mask_B2T = batch["response_mask"].view(logprobs_B2T.shape).to(logprobs_B2T.dtype)
        scores_B2 = likelihood_scores(logprobs_B2T, mask_B2T, beta)
        num_pairs = batch["num_sequences_global"] / 2
        loss, margin_B = bradley_terry_loss(scores_B2[:, 0], scores_B2[:, 1], num_pairs_global=num_pairs)
        metrics = {"accuracy": (margin_B > 0).float().mean(), "margin": margin_B.detach().mean()}
        if nll_coef > 0:
            chosen_tokens_B = mask_B2T[:, 0].sum(dim=-1).clamp(min=1)
            nll_B = -(logprobs_B2T[:, 0] * mask_B2T[:, 0]).sum(dim=-1) / chosen_tokens_B
            loss = loss + nll_coef * nll_B.sum() / num_pairs
            metrics["chosen_nll"] = nll_B.detach().mean()
        return loss, metrics

    return loss_fn


class PreferenceWorker(ModelWorker):
    """A reward model trained with the Bradley-Terry loss on chosen/rejected pairs.

    A ``score``-head model learns a scalar; an ``lm``-head model is a likelihood reward model
    (scores = ``beta`` x summed response log-probs; ``nll_coef`` anchors the chosen answers).
    """

    def __init__(self, spec, *, beta: float = 1.0, nll_coef: float = 0.0) -> None:
        super().__init__(spec)
        self.beta, self.nll_coef = beta, nll_coef

    def _pair_scores(self, data: DataProto) -> Tensor:
        tensors = interleave_pairs(data)
        if self.engine.head == "score":
            return self.engine.forward(tensors, outputs=("scores",))["scores"]
        logprobs_BT = self.engine.forward(tensors, outputs=("logprobs",))["logprobs"]
        return likelihood_scores(logprobs_BT, tensors["response_mask"].to(logprobs_BT.device), self.beta)

    @register("DP_METRICS")
    def train_batch(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on the batch's pairs."""
        if self.engine.head == "score":
            return self.engine.train_step(interleave_pairs(data), bradley_terry_loss_fn, outputs=("scores",),
                                          group_size=2)
        return self.engine.train_step(interleave_pairs(data), likelihood_preference_loss_fn(self.beta, self.nll_coef),
                                      outputs=("logprobs",), group_size=2)

    @register("3D_PROTO")
    def evaluate(self, data: DataProto) -> DataProto:
        """``chosen_scores`` and ``rejected_scores`` [B] of each pair; no update."""
        scores_B2 = self._pair_scores(data).view(-1, 2)
        return DataProto.from_dict(tensors={"chosen_scores": scores_B2[:, 0], "rejected_scores": scores_B2[:, 1]})
