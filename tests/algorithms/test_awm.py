"""AWM: the loss and its gradient against the paper's formula written out here, and prepare's
advantages against an independent group normalisation."""

import pytest
import torch
from fm_policy import LinearPolicy, fm_batch

from diffrl.algorithms.awm import AWMConfig, loss, prepare, weight_plan


def reference_awm(policy, batch, adv, cfg):
    """E[A w(l, sigma)] + kl ||v - v_ref||^2 + ema_kl ||v - v_old||^2, from the recorded draws."""
    total = 0.0
    for x, sigma, eps in policy.draws(batch.x0):
        s = sigma.view(-1, 1, 1)
        v = policy.w["default"] * x + s
        err = ((v - (eps - batch.x0)) ** 2).mean(dim=(1, 2))
        p = cfg.ghuber_power
        w = {
            "uniform": err,
            "t": sigma * err,
            "t2": sigma**2 * err,
            "ghuber": sigma / p * ((err + 1e-10) ** p - 1e-10**p),
        }[cfg.weighting]
        term = (adv * w).mean()
        for coef, name in ((cfg.kl_coef, None), (cfg.ema_kl_coef, "old")):
            frozen = (policy.w[name] * x + s).detach()
            term = term + coef * ((v - frozen) ** 2).mean()
        total = total + term / len(policy.draws(batch.x0))
    return total


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "ghuber"])
def test_loss_and_gradient_match_the_formula(weighting) -> None:
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    batch = fm_batch(4, 2, advantages=adv)
    cfg = AWMConfig(weighting=weighting, timesteps_per_sample=2, kl_coef=0.3, ema_kl_coef=0.7)
    policy = LinearPolicy((2, 3))
    value, metrics = loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    (got,) = torch.autograd.grad(value, policy.w["default"])
    want_value = reference_awm(policy, batch, adv, cfg)
    (want,) = torch.autograd.grad(want_value, policy.w["default"])
    assert torch.allclose(value, want_value, rtol=1e-9, atol=1e-12)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    assert float(metrics["awm/kl"]) > 0 and float(metrics["awm/ema_kl"]) > 0


def test_a_positive_advantage_lowers_the_matching_error() -> None:
    batch = fm_batch(2, 2, advantages=torch.tensor([1.0, 0.0], dtype=torch.float64))
    policy = LinearPolicy((2, 3))
    value, _ = loss(policy, batch, AWMConfig(), torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(value, policy.w["default"])
    err_grad = torch.zeros_like(grad)  # d/dW of the first sample's matching error
    for x, sigma, eps in policy.draws(batch.x0):
        v = policy.w["default"] * x[:1] + sigma[0]
        (g,) = torch.autograd.grad(
            ((v - (eps[:1] - batch.x0[:1])) ** 2).mean(), policy.w["default"]
        )
        err_grad += g / 2
    assert torch.allclose(grad, 0.5 * err_grad)  # mean over 2 rows of A=1 * grad l


def test_prepare_scales_group_advantages_and_drops_failed_samples() -> None:
    from types import SimpleNamespace

    rewards = torch.tensor([0.0, 1.0, 0.2, 0.9, 0.5, 0.5])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    valid = torch.tensor([True, True, True, True, True, False])
    traj = SimpleNamespace(
        x0=torch.zeros(6, 1), group=group, seeds=torch.arange(6), latents=None, log_probs=None,
        sigmas=None, sde_mask=None, step_spec=None, step_versions=None, modality_split=None,
        modality_log_probs=None,
        prompts=SimpleNamespace(
            input_ids=torch.zeros(6, 1, dtype=torch.long), ids_hash=tuple("h" * 6),
            cond=None, cond_hash=None,
        ),
    )  # fmt: skip
    scored = SimpleNamespace(traj=traj, rewards=rewards, valid=valid)
    batch = prepare(scored, AWMConfig(adv_clip=1.0, adv_max=0.5))
    want = []
    for g in (0, 1):
        r = rewards[(group == g) & valid].double()
        want.append(((r - r.mean()) / (r.std(unbiased=False) + 1e-4)).clamp(-1, 1) * 0.5)
    assert torch.allclose(batch.advantages.double(), torch.cat(want), atol=1e-6)
    assert len(batch) == 5  # the failed sample is not trained on


def test_the_ema_anchor_refreshes_old_every_update() -> None:
    assert weight_plan(3, AWMConfig()).refresh_old is None
    plan = weight_plan(3, AWMConfig(ema_kl_coef=1.0, old_ema=0.3))
    assert plan.rollout_adapter == "default" and plan.refresh_old == 0.3 and plan.sync
