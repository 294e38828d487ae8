"""The selectable options (registries) against hand-computed values: loss aggregations, Dr. GRPO, DAPO,
GSPO, CISPO, TIS and KL as a loss; with all-equal groups, length-1 responses and fully masked rows."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OUTCOME_ADVANTAGES,
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    dynamic_sampling_keep_mask,
    first_kept_groups,
    gspo_policy_loss,
    kl_estimate,
    overlong_filter_mask,
    overlong_reward_penalty,
    ppo_policy_loss,
    truncated_importance_weights,
)

LOSS_BT = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 6.0, 9.0, 9.0], [5.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
# rows: 3 tokens, 2 tokens, a length-1 response, a fully masked row
MASK_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool()


@pytest.mark.parametrize(("aggregation", "expected"), [
    ("token-mean", (6 + 10 + 5) / 6),
    ("seq-mean-token-sum", (6 + 10 + 5 + 0) / 4),
    ("seq-mean-token-mean", (2 + 5 + 5 + 0) / 4),
    ("seq-mean-token-sum-norm", (6 + 10 + 5) / (4 * 4)),
])
def test_each_loss_aggregation_matches_its_hand_computed_value(aggregation, expected):
    assert aggregate_loss(LOSS_BT, MASK_BT, aggregation=aggregation).item() == pytest.approx(expected)


def test_dr_grpo_aggregation_divides_by_the_constant_not_by_lengths():
    value = aggregate_loss(LOSS_BT, MASK_BT, aggregation="seq-mean-token-sum-norm", constant_normalizer=8)
    assert value.item() == pytest.approx(21 / (4 * 8))
    with pytest.raises(ValueError, match="constant_normalizer must be > 0"):
        aggregate_loss(LOSS_BT, MASK_BT, aggregation="seq-mean-token-sum-norm", constant_normalizer=0)


@pytest.mark.parametrize("aggregation", list(LOSS_AGGREGATIONS))
def test_every_aggregation_adds_up_over_micro_batches_with_global_counts(aggregation):
    counts = {"num_tokens_global": 6.0, "num_sequences_global": 4, "constant_normalizer": 4}
    full = aggregate_loss(LOSS_BT, MASK_BT, aggregation=aggregation, **counts)
    parts = [aggregate_loss(LOSS_BT[rows], MASK_BT[rows], aggregation=aggregation, **counts)
             for rows in (slice(0, 1), slice(1, 3), slice(3, 4))]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-6)


def test_a_batch_without_real_tokens_has_zero_loss_in_every_aggregation():
    for aggregation in LOSS_AGGREGATIONS:
        assert aggregate_loss(LOSS_BT, torch.zeros_like(MASK_BT), aggregation=aggregation).item() == 0.0


# ------------------------------------------------------------------ outcome advantages
def test_dr_grpo_subtracts_the_group_mean_without_dividing_by_the_std():
    scores_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3])
    mask_BT = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 0]])
    advantages_BT = OUTCOME_ADVANTAGES["dr_grpo"](scores_B, [0, 0, 0, 0, 1, 1], mask_BT)
    expected = [[0.5, 0.5], [-0.5, 0.0], [-0.5, -0.5], [0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]
    assert advantages_BT.tolist() == expected


def test_registered_grpo_and_rloo_match_their_formulas_on_one_group():
    scores_B = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    mask_BT = torch.ones(3, 1, dtype=torch.float64)
    grpo_B = OUTCOME_ADVANTAGES["grpo"](scores_B, [7, 7, 7], mask_BT)[:, 0]
    torch.testing.assert_close(grpo_B, torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64) / (0.5 + 1e-6))
    rloo_B = OUTCOME_ADVANTAGES["rloo"](scores_B, [7, 7, 7], mask_BT)[:, 0]
    torch.testing.assert_close(rloo_B, torch.tensor([0.75, -0.75, 0.0], dtype=torch.float64))


# ------------------------------------------------------------------ DAPO
def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ():
    scores_B = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    keep_B = dynamic_sampling_keep_mask(scores_B, ["a", "a", "b", "b", "c", "c", "d", "d"])
    assert keep_B.tolist() == [False, False, True, True, False, False, False, False]


def test_first_kept_groups_fills_the_batch_from_kept_groups_in_sampling_order():
    # round 1: groups 5 (tied) and 3; round 2: groups 9 and 1 (tied) and 4
    scores_B = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.2, 0.7, 0.0, 0.0, 1.0, 0.0])
    group_ids_B = torch.tensor([5, 5, 3, 3, 9, 9, 1, 1, 4, 4])
    keep_B = dynamic_sampling_keep_mask(scores_B, group_ids_B)
    rows_R, groups_kept = first_kept_groups(keep_B, group_ids_B, num_groups=2)
    assert rows_R.tolist() == [2, 3, 4, 5] and groups_kept == 3
    rows_R, groups_kept = first_kept_groups(keep_B[:4], group_ids_B[:4], num_groups=2)
    assert rows_R.tolist() == [2, 3] and groups_kept == 1


def test_overlong_penalty_is_zero_before_the_buffer_a_ramp_inside_it_and_full_beyond():
    lengths_B = torch.tensor([5, 6, 8, 10, 12])
    penalty_B = overlong_reward_penalty(lengths_B, max_response_length=10, buffer_length=4)
    assert penalty_B.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    doubled_B = overlong_reward_penalty(lengths_B, max_response_length=10, buffer_length=4, penalty_factor=2.0)
    assert doubled_B.tolist() == [0.0, 0.0, -1.0, -2.0, -2.0]
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_reward_penalty(lengths_B, max_response_length=10, buffer_length=11)


def test_overlong_filter_drops_truncated_responses_but_keeps_one_that_ended_at_the_limit():
    lengths_B = torch.tensor([3, 10, 10])
    assert overlong_filter_mask(lengths_B, max_response_length=10).tolist() == [True, False, False]
    ended_B = torch.tensor([True, False, True])
    assert overlong_filter_mask(lengths_B, max_response_length=10, ended_B=ended_B).tolist() == [True, False, True]


def test_decoupled_clip_bounds_the_ratio_at_one_plus_high_and_one_minus_low():
    logprobs_BT = torch.log(torch.tensor([[1.5, 0.5, 1.25]]))
    advantages_BT = torch.tensor([[1.0, -1.0, 1.0]])
    out = ppo_policy_loss(logprobs_BT, torch.zeros(1, 3), advantages_BT, clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(out.loss_BT, torch.tensor([[-1.28, 0.8, -1.25]]))
    assert out.clipped_BT.tolist() == [[True, True, False]]


# ------------------------------------------------------------------ GSPO
def gspo_reference_objective(logprobs_BT, old_BT, advantages_B, mask_BT, low, high):
    """GSPO as written in the paper: -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log-ratio)."""
    terms = []
    for row in range(logprobs_BT.shape[0]):
        real = mask_BT[row].bool()
        if not bool(real.any()):
            terms.append(logprobs_BT[row].sum() * 0.0)
            continue
        ratio = torch.exp((logprobs_BT[row][real] - old_BT[row][real]).mean())
        advantage = advantages_B[row]
        terms.append(-torch.minimum(ratio * advantage, ratio.clamp(1 - low, 1 + high) * advantage))
    return torch.stack(terms).mean()


@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (3e-4, 4e-4), (0.9, 5.0)])
def test_gspo_value_and_gradient_equal_the_sequence_level_objective(low, high):
    old_BT = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.2, 0.0, 0.0], [-0.7, 0.0, 0.0, 0.0], [0.0] * 4])
    shift_BT = torch.tensor([[0.1, 0.3, 0.5, 0.0], [-0.4, -0.2, 0.0, 0.0], [0.05, 0.0, 0.0, 0.0], [9.0] * 4])
    advantages_B = torch.tensor([1.0, -1.0, 2.0, 1.0])
    mask_BT = MASK_BT
    logprobs_BT = (old_BT + shift_BT).requires_grad_(True)
    out = gspo_policy_loss(logprobs_BT, old_BT, advantages_B[:, None].expand(4, 4), mask_BT=mask_BT,
                           clip_ratio_low=low, clip_ratio_high=high)
    loss = aggregate_loss(out.loss_BT, mask_BT, aggregation="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logprobs_BT)
    reference_logprobs_BT = (old_BT + shift_BT).requires_grad_(True)
    reference = gspo_reference_objective(reference_logprobs_BT, old_BT, advantages_B, mask_BT, low, high)
    (reference_grad,) = torch.autograd.grad(reference, reference_logprobs_BT)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(grad, reference_grad)
    sequence_ratio = math.exp((0.1 + 0.3 + 0.5) / 3)
    assert out.ratio_BT[0, :3].tolist() == pytest.approx([sequence_ratio] * 3, rel=1e-6)
    assert out.ratio_BT[3].tolist() == [1.0] * 4  # fully masked row


def test_gspo_on_length_one_responses_equals_ppo():
    logprobs_BT = torch.tensor([[-0.3], [-2.0], [-1.0]])
    old_BT = torch.tensor([[-0.5], [-1.0], [-1.05]])
    advantages_BT = torch.tensor([[1.0], [-1.0], [0.5]])
    gspo = gspo_policy_loss(logprobs_BT, old_BT, advantages_BT, clip_ratio_low=0.2, clip_ratio_high=0.3)
    ppo = ppo_policy_loss(logprobs_BT, old_BT, advantages_BT, clip_ratio_low=0.2, clip_ratio_high=0.3)
    torch.testing.assert_close(gspo.loss_BT, ppo.loss_BT)
    assert gspo.clipped_BT.tolist() == ppo.clipped_BT.tolist()


# ------------------------------------------------------------------ CISPO
def test_cispo_weights_the_log_prob_gradient_by_the_clipped_detached_ratio():
    old_BT = torch.zeros(1, 4)
    logprobs_BT = torch.log(torch.tensor([[1.5, 0.5, 1.1, 2.0]])).requires_grad_(True)
    advantages_BT = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    mask_BT = torch.tensor([[1, 1, 1, 0]])
    out = cispo_policy_loss(logprobs_BT, old_BT, advantages_BT, clip_ratio_high=0.28, mask_BT=mask_BT)
    torch.testing.assert_close(out.loss_BT[0, :3], torch.tensor([-1.28, 0.5, -2.2]))
    assert out.clipped_BT[0, :3].tolist() == [True, False, False]
    aggregate_loss(out.loss_BT, mask_BT, aggregation="token-mean").backward()
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[-1.28, 0.5, -2.2, 0.0]]) / 3)


def test_cispo_and_ppo_have_the_same_gradient_on_policy():
    logprobs_BT = torch.tensor([[-0.3, -1.2], [-0.8, -0.1]], requires_grad=True)
    advantages_BT = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    grads = []
    for loss_fn in (POLICY_LOSSES["ppo"], POLICY_LOSSES["cispo"]):
        out = loss_fn(logprobs_BT, logprobs_BT.detach(), advantages_BT, clip_ratio_low=0.2, clip_ratio_high=0.2)
        grads.append(torch.autograd.grad(aggregate_loss(out.loss_BT, torch.ones(2, 2)), logprobs_BT)[0])
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_every_policy_loss_gives_a_fully_masked_row_zero_loss_and_zero_gradient(name):
    logprobs_BT = torch.tensor([[-0.3, -1.2, 0.0], [math.nan, -math.inf, math.nan]], requires_grad=True)
    old_BT = torch.tensor([[-0.5, -1.0, 0.0], [-0.5, -1.0, -0.2]])
    advantages_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mask_BT = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = POLICY_LOSSES[name](logprobs_BT, old_BT, advantages_BT, mask_BT=mask_BT,
                              clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss = aggregate_loss(out.loss_BT, mask_BT, aggregation="seq-mean-token-mean")
    loss.backward()
    assert math.isfinite(loss.item())
    assert logprobs_BT.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert bool(torch.isfinite(logprobs_BT.grad).all())


# ------------------------------------------------------------------ TIS
def test_truncated_importance_weights_cap_the_ratio_and_report_how_often_the_cap_binds():
    old_BT = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -0.5, 0.0]])
    behaviour_BT = old_BT - torch.log(torch.tensor([[3.0, 0.5, 1.0], [2.5, 1.0, 1.0]]))
    behaviour_BT[1, 2] = -math.inf  # padding
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tis = truncated_importance_weights(old_BT, behaviour_BT, mask_BT, cap=2.0)
    torch.testing.assert_close(tis.weights_BT, torch.tensor([[2.0, 0.5, 1.0], [2.0, 1.0, 0.0]]))
    assert tis.cap_fraction.item() == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_importance_weights(old_BT, behaviour_BT, mask_BT, cap=0.5)


# ------------------------------------------------------------------ KL as a loss
@pytest.mark.parametrize(("estimator", "per_token"), [
    ("k1", lambda x: x), ("k2", lambda x: x * x / 2), ("k3", lambda x: math.exp(-x) + x - 1),
])
def test_kl_loss_with_each_estimator_matches_hand_computed_token_mean(estimator, per_token):
    logprobs_BT = torch.tensor([[-1.0, -0.5, -math.inf], [-0.2, 0.0, 0.0]], dtype=torch.float64)
    ref_BT = torch.tensor([[-1.2, -0.4, -1.0], [-0.2, 0.0, 0.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    kl = aggregate_loss(kl_estimate(logprobs_BT, ref_BT, estimator=estimator, mask_BT=mask_BT), mask_BT)
    expected = (per_token(0.2) + per_token(-0.1) + per_token(0.0)) / 3
    assert kl.item() == pytest.approx(expected, rel=1e-9)
    assert estimator in KL_ESTIMATORS
