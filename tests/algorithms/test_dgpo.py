"""DGPO: the surrogate's gradient against the paper's group-DPO loss written out here, and the
whole-group rules."""

import math

import pytest
import torch
import torch.nn.functional as F
from fm_policy import LinearPolicy, fm_batch

from diffrl.algorithms.dgpo import DGPOConfig, loss


def paper_dgpo(policy, batch, adv, beta, reference):
    """sum over groups of -log sigmoid(R(G+) - R(G-)), R(G+) - R(G-) = -beta/|G| sum A dl."""
    total = 0.0
    draws = policy.draws(batch.x0)
    for x, sigma, eps in draws:
        s = sigma.view(-1, 1, 1)
        target = eps - batch.x0
        err = ((policy.w["default"] * x + s - target) ** 2).mean(dim=(1, 2))
        ref_err = ((policy.w[reference] * x + s - target) ** 2).mean(dim=(1, 2))
        for g in batch.group.unique():
            rows = batch.group == g
            margin = -beta * (adv[rows] * (err[rows] - ref_err[rows])).sum() / rows.sum()
            total = total - F.logsigmoid(margin) / len(draws)
    return total


@pytest.mark.parametrize("reference", ["base", "ema"])
def test_gradient_is_the_group_dpo_gradient(reference) -> None:
    adv = torch.tensor([1.2, -0.4, -0.8, 0.9, -0.9, 0.0], dtype=torch.float64)
    batch = fm_batch(6, 3, advantages=adv)  # two groups of three
    beta = 40.0
    cfg = DGPOConfig(beta=beta, reference=reference, timesteps_per_sample=2)
    policy = LinearPolicy((2, 3))
    value, metrics = loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    (got,) = torch.autograd.grad(value, policy.w["default"])
    paper = paper_dgpo(policy, batch, adv, beta, None if reference == "base" else "old")
    (want,) = torch.autograd.grad(paper, policy.w["default"])
    n_groups = 2  # the surrogate's gradient is the paper's / (beta * number of groups)
    assert torch.allclose(got * beta * n_groups, want, rtol=1e-9, atol=1e-12)
    assert abs(float(metrics["dgpo/group_loss"]) * n_groups - float(paper.detach())) < 1e-9
    # shared noise: every member of a group was noised alike
    for _x, sigma, eps in policy.draws(batch.x0):
        assert torch.equal(sigma[0:3], sigma[0].expand(3)) and sigma[0] != sigma[3]
        assert torch.allclose(eps[0], eps[2]) and not torch.allclose(eps[0], eps[3])


def test_a_policy_equal_to_its_reference_weighs_every_group_one_half() -> None:
    batch = fm_batch(4, 2, advantages=torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64))
    policy = LinearPolicy((2, 3))
    policy.w[None] = policy.w["default"].detach()
    _, metrics = loss(policy, batch, DGPOConfig(), torch.Generator().manual_seed(0))
    assert float(metrics["dgpo/weight"]) == 0.5
    assert abs(float(metrics["dgpo/group_loss"]) - math.log(2)) < 1e-12


def test_a_micro_batch_that_splits_a_group_is_refused() -> None:
    batch = fm_batch(4, 3, advantages=torch.zeros(4, dtype=torch.float64))  # groups of 3 and 1
    with pytest.raises(ValueError, match="actor.micro_batch to a multiple of rollout.group_size"):
        loss(LinearPolicy((2, 3)), batch, DGPOConfig(), torch.Generator())


def test_the_config_refuses_micro_batches_of_split_groups() -> None:
    from diffrl.config import load_config
    from diffrl.errors import ConfigError

    with pytest.raises(ConfigError, match="'actor.micro_batch' = 12: dgpo"):
        load_config("shapes_dgpo.yaml", ["actor.micro_batch=12"])  # groups of 8
    assert load_config("shapes_dgpo.yaml", ["actor.micro_batch=16"]).actor.micro_batch == 16
