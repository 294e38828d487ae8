"""Advantages, losses, KL penalties and controllers checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    discounted_returns,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    kl_shaped_rewards,
    lagrange_multiplier_update,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
    safe_rlhf_advantages,
    scores_on_last_token,
    value_loss,
)

def assert_values(tensor: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=tensor.dtype), rtol=1e-5, atol=1e-6)


MASK_BT = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_masked_mean_and_var_ignore_padding():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    assert masked_mean(values, MASK_BT).item() == pytest.approx(3.0)
    assert masked_var(values, MASK_BT).item() == pytest.approx(2.5)  # var([1..5], unbiased)
    assert masked_mean(values, MASK_BT, dim=-1).tolist() == pytest.approx([2.0, 4.5])


def test_masked_whiten_gives_zero_mean_unit_variance_and_zero_padding():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    whitened = masked_whiten(values, MASK_BT)
    assert masked_mean(whitened, MASK_BT).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(whitened, MASK_BT).item() == pytest.approx(1.0, rel=1e-5)
    assert whitened[0, 3].item() == 0.0 and whitened[1, 2].item() == 0.0


def test_masked_var_of_a_single_value_is_an_error():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.ones(1, 3), torch.tensor([[1, 0, 0]]))


def test_gae_equals_discounted_returns_minus_values_when_lambda_is_one():
    torch.manual_seed(0)
    rewards_BT = torch.randn(2, 4) * MASK_BT
    values_BT = torch.randn(2, 4)
    advantages_BT, returns_BT = gae_advantages(rewards_BT, values_BT, MASK_BT, gamma=0.9, lam=1.0)
    expected_returns_BT = discounted_returns(rewards_BT, MASK_BT, gamma=0.9)
    torch.testing.assert_close(advantages_BT, (expected_returns_BT - values_BT) * MASK_BT)
    torch.testing.assert_close(returns_BT, expected_returns_BT)


def test_gae_with_gamma_and_lambda_one_and_zero_values_is_reward_to_go():
    rewards_BT = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]])
    advantages_BT, _ = gae_advantages(rewards_BT, torch.zeros(2, 4), MASK_BT, gamma=1.0, lam=1.0)
    assert advantages_BT.tolist() == [[6.0, 5.0, 3.0, 0.0], [9.0, 5.0, 0.0, 0.0]]


def test_gae_matches_a_hand_computed_example():
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0]])
    values_BT = torch.tensor([[0.5, 0.2, 0.4]])
    advantages_BT, returns_BT = gae_advantages(rewards_BT, values_BT, torch.ones(1, 3), gamma=0.9, lam=0.5)
    delta2 = 1.0 - 0.4
    delta1 = 0.0 + 0.9 * 0.4 - 0.2
    delta0 = 0.0 + 0.9 * 0.2 - 0.5
    a2 = delta2
    a1 = delta1 + 0.45 * a2
    a0 = delta0 + 0.45 * a1
    assert advantages_BT[0].tolist() == pytest.approx([a0, a1, a2])
    assert returns_BT[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4])


def test_gae_skips_masked_positions_inside_a_response():
    rewards_BT = torch.tensor([[0.0, 7.0, 0.0, 1.0]])
    values_BT = torch.tensor([[0.5, 9.0, 0.2, 0.4]])
    holes_BT = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    advantages_BT, _ = gae_advantages(rewards_BT, values_BT, holes_BT, gamma=0.9, lam=0.5)
    compact_BT, _ = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.2, 0.4]]), torch.ones(1, 3), gamma=0.9, lam=0.5
    )
    assert advantages_BT[0, 1].item() == 0.0
    torch.testing.assert_close(advantages_BT[:, [0, 2, 3]], compact_BT)


def test_gae_rejects_gamma_outside_unit_interval():
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5, lam=1.0)


def test_remax_advantage_is_score_minus_greedy_baseline_on_every_token():
    rewards_BT = scores_on_last_token(torch.tensor([1.0, 0.0]), MASK_BT)
    advantages_BT, returns_BT = remax_advantages(rewards_BT, torch.tensor([0.25, 0.5]), MASK_BT)
    assert advantages_BT.tolist() == [[0.75, 0.75, 0.75, 0.0], [-0.5, -0.5, 0.0, 0.0]]
    assert returns_BT.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_grpo_normalizes_within_each_group_by_mean_and_sample_std():
    scores_B = torch.tensor([1.0, 0.0, 0.0, 5.0, 3.0, 4.0])
    group_ids = ["a", "a", "a", "b", "b", "b"]
    advantages_BT = grpo_advantages(scores_B, group_ids, torch.ones(6, 2), eps=0.0)
    std_a = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = [2 / 3 / std_a, -1 / 3 / std_a, -1 / 3 / std_a, 1.0, -1.0, 0.0]
    assert advantages_BT[:, 0].tolist() == pytest.approx(expected)
    assert advantages_BT[:, 1].tolist() == pytest.approx(expected)


def test_grpo_handles_interleaved_group_ids_and_masks_padding():
    scores_B = torch.tensor([1.0, 5.0, 0.0, 3.0])
    advantages_BT = grpo_advantages(scores_B, torch.tensor([7, 9, 7, 9]), MASK_BT.repeat(2, 1), normalize_by_std=False)
    assert advantages_BT[:, 0].tolist() == [0.5, 1.0, -0.5, -1.0]
    assert advantages_BT[0, 3].item() == 0.0 and advantages_BT[1, 2].item() == 0.0


def test_grpo_with_a_single_sample_per_prompt_is_an_error():
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0, 1], torch.ones(3, 1))


def test_rloo_subtracts_the_mean_of_the_other_samples():
    advantages_BT = rloo_advantages(torch.tensor([3.0, 0.0, 0.0, 1.0, 2.0]), [0, 0, 0, 1, 1], torch.ones(5, 1))
    assert advantages_BT[:, 0].tolist() == pytest.approx([3.0, -1.5, -1.5, -1.0, 1.0])


def test_reinforce_plus_plus_whitens_discounted_returns_over_the_batch():
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    advantages_BT, returns_BT = reinforce_plus_plus_advantages(rewards_BT, MASK_BT, gamma=0.5)
    assert returns_BT.tolist() == [[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]]
    torch.testing.assert_close(advantages_BT, masked_whiten(returns_BT, MASK_BT))


def test_safe_rlhf_advantage_mixes_reward_and_cost_by_the_multiplier():
    combined = safe_rlhf_advantages(torch.tensor([[2.0]]), torch.tensor([[1.0]]), 3.0)
    assert combined.item() == pytest.approx((2.0 - 3.0) / 4.0)


def test_kl_estimators_match_their_formulas():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0]])
    x = torch.tensor([[0.5, -1.0]])
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, estimator="k1"), x)
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, estimator="abs"), x.abs())
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, estimator="k2"), 0.5 * x**2)
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, estimator="k3"), torch.exp(-x) + x - 1)
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-30.0]), estimator="low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_estimate(logprobs, ref_logprobs, estimator="k4")


def test_kl_shaped_rewards_put_the_score_on_the_last_real_token():
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-1.0, -2.0, -9.0, -9.0]])
    rewards_BT, kl_BT = kl_shaped_rewards(torch.tensor([10.0, 20.0]), logprobs, ref_logprobs, MASK_BT, 0.1)
    assert_values(kl_BT, [[0.5, 0.0, -0.5, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    assert_values(rewards_BT, [[-0.05, 0.0, 10.05, 0.0], [0.1, 20.0, 0.0, 0.0]])


def test_an_empty_response_mask_is_an_error_naming_the_row():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        scores_on_last_token(torch.tensor([1.0, 2.0]), torch.tensor([[1, 0], [0, 0]]))


def test_ppo_policy_loss_clips_the_ratio_on_the_side_of_the_advantage():
    old_logprobs = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = ppo_policy_loss(logprobs, old_logprobs, advantages, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # A>0, r=1.5 -> clipped to 1.2; A>0, r=0.5 -> unclipped; A<0, r=1.5 -> unclipped; A<0, r=0.5 -> 0.8.
    assert_values(out.loss_BT, [[-1.2, -0.5, 1.5, 0.8]])
    assert out.clipped_BT.tolist() == [[True, False, False, True]]
    kl_high, kl_low = 0.5 - math.log(1.5), -0.5 - math.log(0.5)
    assert_values(out.approx_kl_BT, [[kl_high, kl_low, kl_high, kl_low]])


def test_ppo_policy_loss_gradient_vanishes_on_clipped_tokens():
    logprobs = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    out = ppo_policy_loss(logprobs, torch.zeros(1, 2), torch.ones(1, 2))
    out.loss_BT.sum().backward()
    assert_values(logprobs.grad, [[0.0, -1.1]])


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_advantage():
    logprobs = torch.log(torch.tensor([[10.0, 10.0]]))
    out = ppo_policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), dual_clip_ratio=3.0)
    assert_values(out.loss_BT, [[3.0, -1.2]])
    assert out.dual_clipped_BT.tolist() == [[True, False]]
    with pytest.raises(ValueError, match="dual_clip_ratio"):
        ppo_policy_loss(logprobs, torch.zeros(1, 2), torch.ones(1, 2), dual_clip_ratio=0.5)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    values = torch.tensor([[1.0, 0.0, 0.5]])
    old_values = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 1.0]])
    loss_BT, clipped_BT = value_loss(values, old_values, returns, clip_range=0.2)
    # token 0: unclipped (1-0)^2=1, clipped (0.2-0)^2=0.04 -> 1; token 2: 0.25 vs (0.2-1)^2=0.64 -> 0.64.
    assert_values(loss_BT, [[0.5, 0.5, 0.32]])
    assert clipped_BT.tolist() == [[False, False, True]]
    unclipped_BT, _ = value_loss(values, old_values, returns, clip_range=None)
    assert_values(unclipped_BT, [[0.5, 0.5, 0.125]])


def test_entropy_and_logprobs_from_logits_match_the_definitions():
    logits_BTV = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [1.0, 1e-9, 1e-9]]]))
    entropy_BT = entropy_from_logits(logits_BTV)
    assert entropy_BT[0, 0].item() == pytest.approx(1.5 * math.log(2))
    assert entropy_BT[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    logprobs_BT = logprobs_from_logits(logits_BTV, torch.tensor([[1, 0]]))
    assert_values(logprobs_BT, [[math.log(0.25), 0.0]])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_losses_with_global_normalisers_add_up_to_the_full_batch_loss(aggregation):
    torch.manual_seed(0)
    loss_BT = torch.randn(6, 5)
    mask_BT = (torch.rand(6, 5) > 0.3).float()
    mask_BT[:, 0] = 1
    full = aggregate_loss(loss_BT, mask_BT, aggregation=aggregation)
    counts = {"num_tokens_global": mask_BT.sum().item(), "num_sequences_global": 6}
    parts = [
        aggregate_loss(loss_BT[rows], mask_BT[rows], aggregation=aggregation, **counts)
        for rows in (slice(0, 1), slice(1, 4), slice(4, 6))
    ]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-6)


def test_aggregations_match_hand_computed_values():
    loss_BT = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 6.0, 9.0, 9.0]])
    assert aggregate_loss(loss_BT, MASK_BT, aggregation="token-mean").item() == pytest.approx(16 / 5)
    assert aggregate_loss(loss_BT, MASK_BT, aggregation="seq-mean-token-sum").item() == pytest.approx(8.0)
    assert aggregate_loss(loss_BT, MASK_BT, aggregation="seq-mean-token-mean").item() == pytest.approx(3.5)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate_loss(loss_BT, MASK_BT, aggregation="sum")


def test_fixed_kl_controller_never_changes():
    controller = FixedKLController(kl_coef=0.05)
    controller.update(current_kl=100.0, n_steps=64)
    assert controller.value == 0.05


def test_adaptive_kl_controller_follows_ziegler_et_al():
    controller = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    controller.update(current_kl=12.0, n_steps=100)  # error clipped to +0.2
    assert controller.value == pytest.approx(0.2 * (1 + 0.2 * 100 / 10000))
    controller.update(current_kl=5.4, n_steps=1000)  # error -0.1
    assert controller.value == pytest.approx(0.2 * 1.002 * (1 - 0.1 * 0.1))
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=6.0, horizon=10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.2, target_kl=0.0, horizon=10)


def test_lagrange_multiplier_grows_above_the_cost_limit_and_shrinks_below():
    up = lagrange_multiplier_update(0.0, 2.0, cost_limit=1.0, lr=0.1)
    assert up == pytest.approx(0.1)
    down = lagrange_multiplier_update(math.log(2.0), 0.0, cost_limit=1.0, lr=0.1)
    assert down == pytest.approx(math.log(2.0) - 0.2)
    capped = lagrange_multiplier_update(0.0, 100.0, cost_limit=0.0, lr=1.0, max_lambda=5.0)
    assert capped == pytest.approx(math.log(5.0))


def reference_gae_one_row(rewards, values, gamma, lam):
    """Textbook GAE on one unpadded trajectory (a plain Python loop)."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


def test_batched_gae_equals_the_textbook_loop_on_each_right_padded_row():
    torch.manual_seed(1)
    lengths = [5, 1, 3, 7]
    rewards_BT, values_BT = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64)
    mask_BT = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).double()
    advantages_BT, _ = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=0.97, lam=0.9)
    for row, length in enumerate(lengths):
        expected = reference_gae_one_row(rewards_BT[row, :length].tolist(), values_BT[row, :length].tolist(), 0.97, 0.9)
        assert advantages_BT[row, :length].tolist() == pytest.approx(expected, rel=1e-12)
        assert advantages_BT[row, length:].abs().sum().item() == 0.0
