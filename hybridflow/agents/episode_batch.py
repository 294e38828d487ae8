"""A step's episodes as the RL step's batch tensors, and their ``agent/*`` metrics.

The batch keeps the rollout's conventions (``engine.rollout.batch_output``): ``prompts`` left-padded, ``responses``
right-padded, ``input_ids`` = prompts + responses. An episode's response is every token after its prompt (sampled
turns and observations, in order); ``attention_mask`` is 1 on all of them (observations take part in attention)
while ``response_mask``, the loss mask, is 1 only on sampled tokens. ``logprobs`` holds the sampled log-probs (0
on observations). ``episode_turn_rewards`` places each turn's reward on that turn's last sampled token.
``episode_trainable`` says which episodes the updates may train: not one whose environment failed under
``on_env_error="drop"``, nor one that sampled nothing (its environment failed to start, or its prompt filled the
token budget), which holds one placeholder end-of-sequence token so that its reward has a token to sit on; the
RL step takes those rows out of the loss once the advantages are computed (``EpisodeLossMask``).
Shape legend: B episodes, P prompt tokens, T response tokens.
"""

from __future__ import annotations

import torch

from hybridflow.agents.episode import Episode


def episode_tensors(episodes: list[Episode], *, pad_token_id: int, eos_token_id: int,
                    on_env_error: str = "drop") -> dict[str, torch.Tensor]:
    """The batch tensors of ``episodes`` (see the module docstring). A failed episode is not trainable under
    ``on_env_error="drop"``; under ``"zero_reward"`` its sampled tokens train with reward 0."""
    for episode in episodes:
        if not episode.num_tokens("sampled"):  # a placeholder for the reward to sit on; never trained
            episode.add_sampled([eos_token_id], [0.0])
            episode.placeholder = True
    B = len(episodes)
    P = max(len(episode.prompt_ids) for episode in episodes)
    T = max(len(episode.response_ids) for episode in episodes)
    prompts_BP = torch.full((B, P), pad_token_id, dtype=torch.long)
    prompt_mask_BP = torch.zeros((B, P), dtype=torch.long)
    responses_BT = torch.full((B, T), pad_token_id, dtype=torch.long)
    real_BT = torch.zeros((B, T), dtype=torch.long)
    loss_mask_BT = torch.zeros((B, T), dtype=torch.long)
    logprobs_BT = torch.zeros((B, T), dtype=torch.float32)
    turn_rewards_BT = torch.zeros((B, T), dtype=torch.float32)
    for row, episode in enumerate(episodes):
        prompt, response = episode.prompt_ids, episode.response_ids
        prompts_BP[row, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask_BP[row, P - len(prompt):] = 1
        if response:
            responses_BT[row, :len(response)] = torch.tensor(response, dtype=torch.long)
            real_BT[row, :len(response)] = 1
            logprobs_BT[row, :len(response)] = torch.tensor(episode.sampled_logprobs, dtype=torch.float32)
            loss_mask_BT[row, :len(response)] = torch.tensor(episode.loss_mask, dtype=torch.long)
        if not episode.failed:  # a failed episode's reward is 0 (zero_reward) or irrelevant (drop: nothing trains)
            for position, reward in episode.turn_reward_positions():
                turn_rewards_BT[row, position] += reward
    attention_mask_BS = torch.cat([prompt_mask_BP, real_BT], dim=1)
    return {
        "prompts": prompts_BP, "responses": responses_BT, "response_mask": loss_mask_BT,
        "input_ids": torch.cat([prompts_BP, responses_BT], dim=1), "attention_mask": attention_mask_BS,
        "position_ids": (attention_mask_BS.cumsum(dim=1) - 1).clamp(min=0), "logprobs": logprobs_BT,
        "episode_turn_rewards": turn_rewards_BT,
        "episode_failed": torch.tensor([episode.failed is not None for episode in episodes]),
        "episode_trainable": torch.tensor([not (episode.placeholder or (episode.failed and on_env_error == "drop"))
                                           for episode in episodes]),
    }


def episode_metrics(records: list[dict], *, generation_seconds: float) -> dict[str, float]:
    """``agent/*`` of a step's episode records (``Episode.record``): turns, sampled and observation tokens per
    episode, tool calls and errors per tool, truncations, failures, seconds in tools (summed over episodes) and in
    generation (the rollout's)."""
    from hybridflow.agents.tool_calls import tool_metrics

    count = len(records)
    calls = [call for record in records for call in record["tool_calls"]]

    def mean(key: str) -> float:
        return sum(float(record[key]) for record in records) / count

    metrics = {
        "agent/turns_mean": mean("turns"), "agent/turns_max": float(max(record["turns"] for record in records)),
        "agent/sampled_tokens_mean": mean("sampled_tokens"),
        "agent/observation_tokens_mean": mean("observation_tokens"),
        "agent/done_fraction": mean("done"), "agent/reward_mean": mean("reward"),
        "agent/truncated_max_turns": float(sum(record["truncated"] == "max_turns" for record in records)),
        "agent/truncated_token_budget": float(sum(record["truncated"] == "token_budget" for record in records)),
        "agent/env_failures": float(sum(record["failed"] is not None for record in records)),
        "agent/tool_calls_per_episode": len(calls) / count,
        "time/agent_env_s": sum(record["tool_seconds"] for record in records),
        "time/agent_generation_s": generation_seconds,
        **{name: value for name, value in tool_metrics(calls).items() if name != "agent/tool_seconds"},
        "time/agent_tool_calls_s": sum(call["seconds"] for call in calls),
    }
    return metrics
