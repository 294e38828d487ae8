"""The step's reward: a reward model's scores and/or a rule-based function on the decoded text, weighted.

A likelihood reward model also hands over its per-token terms (``rm_token_scores``); the RL step
then credits each token with its own term (``token_rewards``) instead of the whole score at the end. Multi-turn
episodes (``env``) bring their environment's rewards as ``episode_turn_rewards``, each turn's on its last sampled
token, credited the same way.
Shape legend: B = samples, T = response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.protocol import DataProto
from hybridflow.rewards import RuleReward
from hybridflow.data import answer_texts


class RewardScorer:
    """Combines ``rm_scores`` (from the RewardWorker) and a rule function into the ``scores`` PPO optimizes."""

    def __init__(self, *, tokenizer, function: str | None, function_weight: float, model_weight: float,
                 uses_model: bool, timeout_s: float = 300.0) -> None:
        self.tokenizer = tokenizer
        self.rule = RuleReward(function, timeout_s=timeout_s) if function is not None else None
        self.function_weight, self.model_weight, self.uses_model = function_weight, model_weight, uses_model

    def rule_scores(self, data: DataProto, rule: RuleReward | None = None) -> Tensor:
        """A rule function (default: the reward's) on every sample -> scores_B; RewardError naming the sample."""
        rule = rule or self.rule
        assert rule is not None
        prompts = [str(prompt) for prompt in data["raw_prompt"]]
        extra = list(data["extra_fields"]) if "extra_fields" in data else None
        return rule.score_batch(prompts, answer_texts(self.tokenizer, data), extra)

    def token_rewards(self, data: DataProto) -> tuple[Tensor, Tensor | None, dict[str, float]]:
        """The reward split by where it is credited -> (sequence_B, dense_BT or None, metrics).

        ``sequence_B`` goes on each response's last token (rule scores, score-head models);
        ``dense_BT`` holds per-token terms (a likelihood reward model's weighted log-probs).
        ``sequence_B + dense_BT.sum(-1)`` is the total that ``score`` returns. Each rule runs once.
        """
        sequence_B = torch.zeros(len(data))
        dense_BT = None
        metrics: dict[str, float] = {}
        if self.rule is not None:
            rule_B = self.rule_scores(data)
            sequence_B += self.function_weight * rule_B
            metrics["reward/function_mean"] = float(rule_B.mean())
        if "episode_turn_rewards" in data.batch:  # multi-turn episodes: each turn's reward on its last token
            turn_BT = data["episode_turn_rewards"].float()
            metrics["reward/env_mean"] = float(turn_BT.sum(dim=-1).mean())
            dense_BT = turn_BT if dense_BT is None else dense_BT + turn_BT
        if self.uses_model:
            model_B = data["rm_scores"].float()
            metrics["reward/model_mean"] = float(model_B.mean())
            if "rm_token_scores" in data.batch:
                model_BT = self.model_weight * data["rm_token_scores"].float()
                dense_BT = model_BT if dense_BT is None else dense_BT + model_BT
            else:
                sequence_B += self.model_weight * model_B
        total_B = sequence_B if dense_BT is None else sequence_B + dense_BT.sum(dim=-1)
        metrics.update({"reward/score_mean": float(total_B.mean()), "reward/score_max": float(total_B.max()),
                        "reward/score_min": float(total_B.min())})
        return sequence_B, dense_BT, metrics

    def score(self, data: DataProto) -> tuple[Tensor, dict[str, float]]:
        """(scores_B, metrics) for a batch that holds ``rm_scores`` when a reward model is in use."""
        sequence_B, dense_BT, metrics = self.token_rewards(data)
        return (sequence_B if dense_BT is None else sequence_B + dense_BT.sum(dim=-1)), metrics
