"""Advantage and loss math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tclightning.grpo.advantages import group_advantages, reward_sem, zero_variance_groups
from tclightning.grpo.loss import aggregate, gap_metrics, k3_kl, policy_loss

# float32 exp/log against float64 math: a few ulp, and vector kernels (SLEEF, SVML, plain libm)
# round differently; 1e-5 absorbs that, while a wrong formula is off by far more.
F32 = 1e-5


def test_group_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4, scale="group", eps=1e-6)
    # group 1: mean 0.25, unbiased std sqrt(0.25 * 0.75 * 4 / 3) = 0.5
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    # group 2 has no variance: all advantages 0 (mean removed; 0 / eps-floored std)
    assert adv[4:].abs().max() == 0
    assert zero_variance_groups(rewards, 4).tolist() == [False, True]


def test_reward_sem_counts_each_group_as_one_cluster() -> None:
    # two groups that disagree completely: group means 1 and 0, std 0.7071, sem 0.5 -- far above
    # the 0.19 that eight independent draws would claim (std 0.535 / sqrt(8))
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert reward_sem(rewards, group_size=4) == pytest.approx(0.5)
    # groups that agree with each other: their means are equal, so the batch mean has no error
    assert reward_sem(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=2) == pytest.approx(0.0)
    # one group: the completions are all there is, std / sqrt(n)
    assert reward_sem(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4) == pytest.approx(0.57735 / 2, rel=1e-4)
    assert reward_sem(torch.tensor([1.0]), group_size=1) == 0.0
    with pytest.raises(ValueError, match="groups of 3"):
        reward_sem(torch.ones(8), group_size=3)


def test_dr_grpo_advantages_are_not_scaled() -> None:
    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=2, scale="none")
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_group_advantages_reject_ragged_groups() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.ones(5), group_size=2)


def test_aggregations_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=4).item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    with pytest.raises(ValueError):
        aggregate(values, mask, "sum")


def test_k3_kl_is_zero_at_equality_and_matches_formula() -> None:
    logp = torch.tensor([-1.0, -2.0])
    assert k3_kl(logp, logp).abs().max() == 0
    ref = torch.tensor([-1.5, -1.0])
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert k3_kl(logp, ref).tolist() == pytest.approx(expected, rel=F32)


def test_clipped_surrogate_by_hand() -> None:
    # one sequence of two tokens; ratios e^0.5 = 1.6487 (clipped to 1.28 for A>0) and e^-0.5
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    mask = torch.ones(1, 2)
    out = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    # A = +1: token 1 -> min(1.6487, 1.28) = 1.28 (clipped); token 2 -> min(0.6065, 0.8) = 0.6065
    assert out.loss.item() == pytest.approx(-(1.28 + math.exp(-0.5)) / 2, rel=1e-5)
    assert out.clip_frac.item() == pytest.approx(0.5)
    out.loss.backward()
    # the clipped token gets no gradient; the other gets -ratio/2
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-math.exp(-0.5) / 2, rel=1e-5)


def test_negative_advantage_uses_low_clip() -> None:
    old = torch.zeros(1, 1)
    logp = torch.tensor([[-0.5]])
    out = policy_loss(logp, old, torch.tensor([-2.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28)
    # ratio 0.6065 < 0.8: -min(0.6065 * -2, 0.8 * -2) = 1.6
    assert out.loss.item() == pytest.approx(1.6, rel=1e-5)


def test_kl_term_added_with_coefficient() -> None:
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    mask = torch.ones(1, 2)
    base = policy_loss(logp, logp.detach(), torch.tensor([0.0]), mask)
    with_kl = policy_loss(logp, logp.detach(), torch.tensor([0.0]), mask, ref_logp=ref, kl_coef=0.5)
    kl = (math.exp(-1.0) + 1.0 - 1) / 2
    assert with_kl.kl.item() == pytest.approx(kl, rel=1e-5)
    assert (with_kl.loss - base.loss).item() == pytest.approx(0.5 * kl, rel=1e-5)


def test_truncated_importance_sampling_and_masking() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.05, 0.5, 0.9]]))  # ratios 10, 1, 0.556
    logp = old.clone()
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    tis = policy_loss(logp, old, adv, mask, logp_sampler=sampler, tis_cap=2.0)
    # per-token loss -1 weighted by min(w, 2): (2 + 1 + 0.556) / 3
    assert tis.loss.item() == pytest.approx(-(2 + 1 + 0.5 / 0.9) / 3, rel=1e-4)
    assert tis.tis_frac.item() == pytest.approx(1 / 3)
    masked = policy_loss(logp, old, adv, mask, logp_sampler=sampler, mask_ratio=(0.2, 5.0))
    assert masked.masked_frac.item() == pytest.approx(1 / 3)
    assert masked.loss.item() == pytest.approx(-1.0)


def test_gap_metrics_by_hand() -> None:
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    sampler = torch.log(torch.tensor([[0.5, 0.02, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    gap = gap_metrics(trainer, sampler, mask)
    delta = [0.0, math.log(10)]
    assert gap["gap/abs_mean"] == pytest.approx(sum(map(abs, delta)) / 2, rel=1e-5)
    assert gap["gap/max"] == pytest.approx(math.log(10), rel=1e-5)
    assert gap["gap/k3"] == pytest.approx(sum(math.exp(d) - 1 - d for d in delta) / 2, rel=1e-5)
    assert gap["gap/outside_5x_frac"] == pytest.approx(0.5)
    assert gap["gap/prob_abs_mean"] == pytest.approx((0 + 0.18) / 2, rel=1e-4)
    same = gap_metrics(trainer, trainer, torch.ones(1, 3))
    assert same["gap/abs_mean"] == 0 and same["gap/logp_corr"] == pytest.approx(1.0, rel=F32)
