"""Numeric edge cases of the algorithms: tied groups in float32, NaN/inf in padding, k3 at extreme log-ratios."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate_loss,
    discounted_returns,
    first_non_finite,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    kl_shaped_rewards,
    masked_mean,
    masked_sum,
    masked_whiten,
    ppo_policy_loss,
    reinforce_plus_plus_advantages,
    remax_advantages,
    rloo_advantages,
    value_loss,
)

MASK_BT = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def tied_groups(group_size: int, num_groups: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scores where every group holds one random value `group_size` times."""
    generator = torch.Generator().manual_seed(seed)
    values_G = torch.rand(num_groups, generator=generator, dtype=torch.float64).float()
    scores_B = values_G.repeat_interleave(group_size)
    return scores_B, torch.arange(num_groups).repeat_interleave(group_size)


@pytest.mark.parametrize("group_size", [8, 16])
@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages])
def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero_advantage_in_float32(estimator, group_size):
    scores_B, group_ids_B = tied_groups(group_size)
    advantages_BT = estimator(scores_B, group_ids_B, torch.ones(scores_B.numel(), 3))
    assert advantages_BT.dtype == torch.float32
    assert advantages_BT.abs().max().item() == 0.0


def test_eight_samples_all_scoring_point_seven_get_zero_grpo_advantage():
    scores_B = torch.full((8,), 0.7, dtype=torch.float32)
    assert grpo_advantages(scores_B, [0] * 8, torch.ones(8, 2)).abs().max().item() == 0.0


def test_a_tied_group_next_to_a_spread_group_keeps_the_spread_groups_advantages():
    scores_B = torch.tensor([0.7, 0.7, 0.7, 0.0, 1.0, 0.5], dtype=torch.float32)
    advantages_B = grpo_advantages(scores_B, [0, 0, 0, 1, 1, 1], torch.ones(6, 1))[:, 0]
    assert advantages_B[:3].tolist() == [0.0, 0.0, 0.0]
    std = 0.5  # sample std of (0, 1, 0.5)
    torch.testing.assert_close(advantages_B[3:], torch.tensor([-0.5, 0.5, 0.0]) / (std + 1e-6))


def test_grpo_and_rloo_in_float32_agree_with_float64_on_random_groups():
    generator = torch.Generator().manual_seed(1)
    scores64_B = torch.rand(64, generator=generator, dtype=torch.float64)
    ids_B = torch.arange(8).repeat_interleave(8)
    mask_BT = torch.ones(64, 2)
    for estimator in (grpo_advantages, rloo_advantages):
        expected = estimator(scores64_B, ids_B, mask_BT.double())
        torch.testing.assert_close(estimator(scores64_B.float(), ids_B, mask_BT), expected.float())


# ------------------------------------------------------------------ NaN / inf in padding
def with_padding(tensor_BT: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(MASK_BT.bool(), tensor_BT, torch.full_like(tensor_BT, fill))


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
def test_gae_ignores_nan_and_inf_values_and_rewards_in_padding(fill):
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    values_BT = torch.tensor([[0.5, 0.2, 0.1, 0.0], [0.3, 0.4, 0.0, 0.0]])
    clean = gae_advantages(rewards_BT, values_BT, MASK_BT, gamma=0.9, lam=0.8)
    dirty = gae_advantages(with_padding(rewards_BT, fill), with_padding(values_BT, fill), MASK_BT, gamma=0.9, lam=0.8)
    for expected, got in zip(clean, dirty):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("fill", [math.nan, -math.inf])
def test_discounted_returns_remax_and_reinforce_plus_plus_ignore_nan_in_padding(fill):
    rewards_BT = torch.tensor([[0.1, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    dirty_BT = with_padding(rewards_BT, fill)
    assert torch.equal(discounted_returns(dirty_BT, MASK_BT, gamma=0.9),
                       discounted_returns(rewards_BT, MASK_BT, gamma=0.9))
    baseline_B = torch.tensor([0.5, 1.0])
    for expected, got in zip(remax_advantages(rewards_BT, baseline_B, MASK_BT),
                             remax_advantages(dirty_BT, baseline_B, MASK_BT)):
        assert torch.equal(got, expected)
    for expected, got in zip(reinforce_plus_plus_advantages(rewards_BT, MASK_BT),
                             reinforce_plus_plus_advantages(dirty_BT, MASK_BT)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("estimator", list(KL_ESTIMATORS))
def test_kl_shaping_ignores_minus_inf_log_probs_in_padding(estimator):
    logprobs_BT = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.3, -0.1, 0.0, 0.0]])
    ref_BT = torch.tensor([[-1.2, -0.4, -1.0, 0.0], [-0.2, -0.3, 0.0, 0.0]])
    scores_B = torch.tensor([1.0, 0.0])
    clean = kl_shaped_rewards(scores_B, logprobs_BT, ref_BT, MASK_BT, 0.1, estimator=estimator)
    dirty = kl_shaped_rewards(scores_B, with_padding(logprobs_BT, -math.inf), with_padding(ref_BT, -math.inf),
                              MASK_BT, 0.1, estimator=estimator)
    for expected, got in zip(clean, dirty):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("fill", [math.nan, math.inf])
def test_masked_reductions_ignore_nan_and_inf_in_padding(fill):
    values_BT = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 6.0, 0.0, 0.0]])
    dirty_BT = with_padding(values_BT, fill)
    assert masked_sum(dirty_BT, MASK_BT).item() == 16.0
    assert masked_mean(dirty_BT, MASK_BT).item() == pytest.approx(16 / 5)
    assert masked_mean(dirty_BT, MASK_BT, dim=-1).tolist() == pytest.approx([2.0, 5.0])
    assert torch.equal(masked_whiten(dirty_BT, MASK_BT), masked_whiten(values_BT, MASK_BT))
    for aggregation in LOSS_AGGREGATIONS:
        assert torch.equal(aggregate_loss(dirty_BT, MASK_BT, aggregation=aggregation),
                           aggregate_loss(values_BT, MASK_BT, aggregation=aggregation))


def test_policy_loss_gradient_stays_finite_with_nan_log_probs_in_padding():
    logprobs_BT = with_padding(torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.3, -0.1, 0.0, 0.0]]), math.nan)
    logprobs_BT.requires_grad_(True)
    old_BT = torch.tensor([[-1.1, -0.5, -1.9, 0.0], [-0.3, -0.2, 0.0, 0.0]])
    advantages_BT = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    output = ppo_policy_loss(logprobs_BT, old_BT, advantages_BT, mask_BT=MASK_BT)
    loss = aggregate_loss(output.loss_BT, MASK_BT)
    loss.backward()
    assert math.isfinite(loss.item())
    assert bool(torch.isfinite(logprobs_BT.grad).all())
    assert logprobs_BT.grad[~MASK_BT.bool()].abs().sum().item() == 0.0


# ------------------------------------------------------------------ k3 at extreme log-ratios
@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
def test_k3_is_finite_with_finite_gradients_for_minus_inf_log_probs_and_log_ratios_below_minus_88(estimator):
    logprobs_BT = torch.tensor([[-math.inf, -100.0, -1.0, -95.0]], requires_grad=True)
    ref_BT = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    kl_BT = kl_estimate(logprobs_BT, ref_BT, estimator=estimator)
    assert kl_BT.tolist() == [[10.0, 10.0, 0.0, 10.0]]
    kl_BT.sum().backward()
    assert bool(torch.isfinite(logprobs_BT.grad).all()) and bool(torch.isfinite(ref_BT.grad).all())


def test_k3_of_an_infinite_reference_log_prob_is_the_clamped_maximum():
    kl_BT = kl_estimate(torch.tensor([[-1.0]]), torch.tensor([[-math.inf]]), estimator="k3")
    assert kl_BT.item() == 10.0


def test_k3_on_masked_tokens_is_zero_with_zero_gradient_even_for_nan_and_minus_inf():
    logprobs_BT = torch.tensor([[-0.5, -math.inf, math.nan, -200.0]], requires_grad=True)
    ref_BT = torch.tensor([[-0.7, -math.inf, -1.0, -1.0]])
    mask_BT = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    kl_BT = kl_estimate(logprobs_BT, ref_BT, estimator="k3", mask_BT=mask_BT)
    x = 0.2
    assert kl_BT[0].tolist() == pytest.approx([math.exp(-x) + x - 1, 0.0, 0.0, 0.0], rel=1e-4)
    kl_BT.sum().backward()
    assert logprobs_BT.grad[0, 1:].tolist() == [0.0, 0.0, 0.0]
    assert logprobs_BT.grad[0, 0].item() == pytest.approx(1 - math.exp(-x), rel=1e-4)


def test_first_non_finite_names_the_first_bad_quantity_in_order():
    assert first_non_finite({"loss": torch.tensor(1.0), "grad_norm": 2.0}) is None
    assert first_non_finite({"loss": torch.tensor(1.0), "kl": torch.tensor([0.0, math.inf]),
                             "grad_norm": math.nan}) == "kl"
    assert first_non_finite({"loss": 1.0, "grad_norm": float("nan")}) == "grad_norm"


def test_value_loss_with_a_mask_passes_no_nan_gradient_from_padding():
    values_BT = with_padding(torch.tensor([[0.5, 0.2, 0.1, 0.0], [0.3, 0.4, 0.0, 0.0]]), math.nan)
    values_BT.requires_grad_(True)
    returns_BT = with_padding(torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), math.inf)
    old_BT = torch.tensor([[0.4, 0.2, 0.3, 0.0], [0.3, 0.5, 0.0, 0.0]])
    loss_BT, _ = value_loss(values_BT, old_BT, returns_BT, clip_range=0.2, mask_BT=MASK_BT)
    loss = aggregate_loss(loss_BT, MASK_BT)
    loss.backward()
    # hand-computed: 0.5 * max((V - R)^2, (V_clip - R)^2) per real token, token mean over 5
    expected = 0.5 * (0.5**2 + 0.8**2 + 0.9**2 + 0.3**2 + 0.4**2) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert bool(torch.isfinite(values_BT.grad).all())
    assert values_BT.grad[~MASK_BT.bool()].abs().sum().item() == 0.0
