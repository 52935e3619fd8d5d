"""Diffusion-DPO: pair construction and the loss's sign against an independent computation."""

import math

import torch

from diffrl.algorithms.diffusion_dpo import dpo_loss, make_pairs


def test_loss_matches_formula_and_prefers_winner_improvement():
    m_w, m_l = torch.tensor([0.10]), torch.tensor([0.30])
    r_w, r_l = torch.tensor([0.20]), torch.tensor([0.20])
    beta = 10.0
    inside = -0.5 * beta * ((0.10 - 0.30) - (0.20 - 0.20))
    expected = -math.log(1 / (1 + math.exp(-inside)))
    assert abs(float(dpo_loss(m_w, m_l, r_w, r_l, beta)) - expected) < 1e-6
    # policy fits the winner better than the reference does -> loss below log 2
    assert float(dpo_loss(m_w, m_l, r_w, r_l, beta)) < math.log(2)
    # fitting the loser better -> loss above log 2
    assert float(dpo_loss(m_l, m_w, r_w, r_l, beta)) > math.log(2)
    # equal to the reference -> exactly log 2
    assert abs(float(dpo_loss(r_w, r_l, r_w, r_l, beta)) - math.log(2)) < 1e-6


def test_gradient_lowers_winner_error_and_raises_loser_error():
    m = torch.tensor([0.2, 0.2], requires_grad=True)
    dpo_loss(m[0:1], m[1:2], torch.tensor([0.2]), torch.tensor([0.2]), 5.0).sum().backward()
    assert m.grad[0] > 0 and m.grad[1] < 0  # descent: m_w down, m_l up


def test_pairs_best_worst_and_margin():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.5, 0.2, 0.8, 0.8])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    valid = torch.tensor([True, True, True, True, True, False, True, True])
    pairs = make_pairs(rewards, group, valid, "best_worst", 0.0)
    # group 1 and 3 are ties, group 2 has one valid sample: only group 0 pairs
    assert pairs.tolist() == [[1, 0]]
    allp = make_pairs(
        torch.tensor([0.0, 0.5, 1.0]),
        torch.zeros(3, dtype=torch.long),
        torch.ones(3, dtype=torch.bool),
        "margin",
        0.4,
    )
    assert sorted(allp.tolist()) == [[1, 0], [2, 0], [2, 1]]


def test_loss_on_a_policy_equal_to_its_reference(tiny_model, actor_factory, train_batch_factory):
    """Right after a reference refresh (online mode): loss log 2 and implicit accuracy 1/2."""
    from diffrl.algorithms.diffusion_dpo import DPOConfig, loss
    from diffrl.algorithms.registry import get_algorithm

    actor = actor_factory(
        tiny_model, algorithm=get_algorithm("diffusion_dpo"), algo_cfg=DPOConfig()
    )
    batch = train_batch_factory(4)
    value, m = loss(actor, batch, DPOConfig(mode="online"), torch.Generator().manual_seed(0))
    assert abs(float(value.detach()) - math.log(2)) < 1e-6
    assert m["dpo/implicit_acc"] == 0.5 and m["dpo/pairs"] == 2.0


class _RecordingPolicy:
    """velocity = scale * x, with a different scale for the reference; records the sigmas."""

    def __init__(self) -> None:
        self.sigmas: list[torch.Tensor] = []

    def velocity(self, x, sigma, ids, adapter="default", cond=None):
        self.sigmas.append(sigma.detach().clone())
        return x * (0.5 if adapter == "default" else 0.3)


def test_sigma_range_and_timesteps_per_pair_average_the_draws(train_batch_factory):
    from diffrl.algorithms.diffusion_dpo import DPOConfig, loss

    batch = train_batch_factory(8)  # 4 pairs
    cfg = DPOConfig(mode="offline", beta=50.0, sigma_min=0.4, sigma_max=0.6, timesteps_per_pair=3)
    policy = _RecordingPolicy()
    total, _ = loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    assert len(policy.sigmas) == 6  # policy + reference per draw
    for s in policy.sigmas:
        assert float(s.min()) >= 0.4 and float(s.max()) <= 0.6
        assert torch.equal(s[0::2], s[1::2])  # shared within each pair
    # the same generator stream, one draw at a time: the 3-draw loss is their mean
    gen, single = torch.Generator().manual_seed(0), []
    for _ in range(3):
        one = DPOConfig(mode="offline", beta=50.0, sigma_min=0.4, sigma_max=0.6)
        single.append(float(loss(_RecordingPolicy(), batch, one, gen)[0]))
    assert abs(float(total) - sum(single) / 3) < 1e-6


def test_bad_sigma_range_is_a_config_error():
    import pytest

    from diffrl.algorithms.diffusion_dpo import DPOConfig
    from diffrl.errors import FieldError

    with pytest.raises(FieldError, match="sigma_max"):
        DPOConfig(sigma_min=0.5, sigma_max=0.4).validate()
    with pytest.raises(FieldError, match="timesteps_per_pair"):
        DPOConfig(timesteps_per_pair=0).validate()
