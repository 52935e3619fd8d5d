"""group_advantages: per-group standardisation over valid samples."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.advantage import group_advantages, group_ranges, tied_fraction


def test_golden_values_one_group() -> None:
    adv = group_advantages(
        torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 0]), torch.ones(3, dtype=torch.bool)
    )
    s = math.sqrt(2 / 3)  # population std of (1, 2, 3)
    assert adv.tolist() == pytest.approx([-1 / (s + 1e-4), 0.0, 1 / (s + 1e-4)], abs=1e-6)
    assert adv.dtype == torch.float32


def test_zero_mean_unit_std_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g) * torch.tensor([1.0] * 4 + [10.0] * 4 + [0.1] * 4)
    group = torch.arange(3).repeat_interleave(4)
    adv = group_advantages(rewards, group, torch.ones(12, dtype=torch.bool))
    for k in range(3):
        a = adv[group == k].double()
        sd = rewards[group == k].double().std(unbiased=False).item()
        assert a.mean().item() == pytest.approx(0.0, abs=1e-6)
        # unit std up to the eps in the denominator (1% for the 0.1-scale group)
        assert a.std(unbiased=False).item() == pytest.approx(sd / (sd + 1e-4), rel=1e-5)
        assert a.std(unbiased=False).item() == pytest.approx(1.0, abs=2e-2)


def test_invalid_samples_are_excluded_and_get_zero() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, float("nan"), 0.0, 10.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, True, False, True, True])
    adv = group_advantages(rewards, group, valid)
    assert torch.isfinite(adv).all()
    assert adv[3] == 0
    ref = group_advantages(
        torch.tensor([1.0, 2.0, 3.0]),
        torch.zeros(3, dtype=torch.long),
        torch.ones(3, dtype=torch.bool),
    )
    torch.testing.assert_close(adv[:3], ref)
    # any value in the invalid slot gives the same advantages
    adv2 = group_advantages(rewards.clone().index_fill_(0, torch.tensor([3]), 1e6), group, valid)
    torch.testing.assert_close(adv, adv2)


def test_identical_rewards_give_zero() -> None:
    adv = group_advantages(
        torch.tensor([0.7, 0.7, 0.7, 0.0, 1.0]),
        torch.tensor([0, 0, 0, 1, 1]),
        torch.ones(5, dtype=torch.bool),
    )
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3] < 0 < adv[4]


def test_global_std_uses_the_batch_spread() -> None:
    rewards = torch.tensor([0.0, 2.0, 0.0, 4.0])  # centred: -1, 1 | -2, 2
    group = torch.tensor([0, 0, 1, 1])
    valid = torch.ones(4, dtype=torch.bool)
    per_group = group_advantages(rewards, group, valid)
    assert per_group.tolist() == pytest.approx([-1, 1, -1, 1], abs=1e-3)
    glob = group_advantages(rewards, group, valid, global_std=True)
    s = math.sqrt((1 + 1 + 4 + 4) / 4)
    assert glob.tolist() == pytest.approx([-1 / s, 1 / s, -2 / s, 2 / s], abs=1e-3)


def test_global_std_ignores_invalid() -> None:
    rewards = torch.tensor([0.0, 2.0, 100.0, 0.0, 4.0])
    group = torch.tensor([0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, False, True, True])
    glob = group_advantages(rewards, group, valid, global_std=True)
    s = math.sqrt(2.5)
    assert glob.tolist() == pytest.approx([-1 / s, 1 / s, 0.0, -2 / s, 2 / s], abs=1e-3)


def test_tied_fraction_counts_groups_whose_valid_rewards_all_tie() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 9.0, 0.3, 0.3])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    valid = torch.tensor([True, True, True, True, True, False, False, False])
    # group 0 ties, 1 differs, 2 has one valid reward (ties), 3 has none (not counted)
    assert tied_fraction(rewards, group, valid) == pytest.approx(2 / 3)
    assert torch.isnan(group_ranges(rewards, group, valid)[3])
    assert math.isnan(tied_fraction(rewards, group, torch.zeros(8, dtype=torch.bool)))
