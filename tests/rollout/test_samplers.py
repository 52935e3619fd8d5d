"""Sampler steps against their analytic formulas."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.rollout.samplers import (
    coarse_tail,
    cps_step_with_logprob,
    euler_step,
    gaussian_log_prob,
    sde_std,
    sde_step_with_logprob,
    sde_window,
    sigma_schedule,
    tree_noise_blocks,
)

SHAPE = (4, 3, 5, 5)


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_euler_step_golden() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(2, 1, 1, 2)
    v = torch.tensor([[10.0, -10.0], [1.0, 1.0]]).view(2, 1, 1, 2)
    out = euler_step(x, v, torch.tensor([1.0, 0.5]), torch.tensor([0.75, 0.25]))
    assert out.flatten().tolist() == pytest.approx([-1.5, 4.5, 2.75, 3.75])
    # scalar sigmas broadcast as well
    out = euler_step(x, v, torch.tensor(0.5), torch.tensor(0.0))
    assert out.flatten().tolist() == pytest.approx([-4.0, 7.0, 2.5, 3.5])


def analytic(x, v, sigma, sigma_next, a):
    """FlowGRPO step in float64: mean, std (per sample)."""
    sig = sigma.view(-1, 1, 1, 1)
    d = (sigma_next - sigma).view(-1, 1, 1, 1)
    s = a * torch.sqrt(sigma / (1 - sigma))
    mean = x + (v + s.view(-1, 1, 1, 1) ** 2 / (2 * sig) * (x + (1 - sig) * v)) * d
    std = s * torch.sqrt(sigma - sigma_next)
    return mean, std


def test_sde_step_mean_std_logprob_against_formula() -> None:
    x, v, noise = rand(*SHAPE, seed=1), rand(*SHAPE, seed=2), rand(*SHAPE, seed=3)
    sigma = torch.tensor([0.9, 0.6, 0.3, 0.1], dtype=torch.float64)
    sigma_next = torch.tensor([0.8, 0.4, 0.25, 0.0], dtype=torch.float64)
    a = 0.7
    x_next, lp, mean, std = sde_step_with_logprob(x, v, sigma, sigma_next, a, 0.9, noise=noise)
    m_ref, s_ref = analytic(x, v, sigma, sigma_next, a)
    torch.testing.assert_close(mean, m_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(std.flatten(), s_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x_next, m_ref + s_ref.view(-1, 1, 1, 1) * noise)
    # the last row has sigma_next = 0 but sigma < 1: std = s * sqrt(0.1)
    assert std.flatten()[3].item() == pytest.approx(a * math.sqrt(0.1 / 0.9) * math.sqrt(0.1))
    ref_lp = torch.distributions.Normal(m_ref, s_ref.view(-1, 1, 1, 1)).log_prob(x_next)
    torch.testing.assert_close(lp, ref_lp.flatten(1).mean(1), rtol=1e-10, atol=1e-10)
    assert lp.shape == (4,)


def test_sde_step_scores_a_given_x_next() -> None:
    x, v, noise = rand(*SHAPE, seed=4), rand(*SHAPE, seed=5), rand(*SHAPE, seed=6)
    sigma, sigma_next = (
        torch.full((4,), 0.5, dtype=torch.float64),
        torch.full((4,), 0.4, dtype=torch.float64),
    )
    sampled, lp, mean, std = sde_step_with_logprob(x, v, sigma, sigma_next, 0.5, 0.9, noise=noise)
    same, lp2, _, _ = sde_step_with_logprob(x, v, sigma, sigma_next, 0.5, 0.9, x_next=sampled)
    assert same is sampled
    torch.testing.assert_close(lp2, lp)
    # a point farther from the mean is less likely
    _, lp_far, _, _ = sde_step_with_logprob(
        x, v, sigma, sigma_next, 0.5, 0.9, x_next=mean + 3 * std.view(-1, 1, 1, 1)
    )
    assert (lp_far < lp2).all()
    with pytest.raises(ValueError, match="noise"):
        sde_step_with_logprob(x, v, sigma, sigma_next, 0.5, 0.9)


def test_small_noise_level_recovers_euler() -> None:
    x, v, noise = rand(*SHAPE, seed=7), rand(*SHAPE, seed=8), rand(*SHAPE, seed=9)
    sigma, sigma_next = (
        torch.full((4,), 0.7, dtype=torch.float64),
        torch.full((4,), 0.6, dtype=torch.float64),
    )
    euler = euler_step(x, v, sigma, sigma_next)
    x_next, _, mean, _ = sde_step_with_logprob(x, v, sigma, sigma_next, 0.0, 0.9, noise=noise)
    torch.testing.assert_close(mean, euler)
    torch.testing.assert_close(x_next, euler)
    x_next, _, _, _ = sde_step_with_logprob(x, v, sigma, sigma_next, 1e-6, 0.9, noise=noise)
    torch.testing.assert_close(x_next, euler, rtol=0, atol=1e-5)
    # and a real noise level does move it
    x_next, _, _, _ = sde_step_with_logprob(x, v, sigma, sigma_next, 0.7, 0.9, noise=noise)
    assert (x_next - euler).abs().max() > 1e-2


def test_sigma_one_is_guarded() -> None:
    x, v, noise = rand(*SHAPE, seed=10), rand(*SHAPE, seed=11), rand(*SHAPE, seed=12)
    sigma, sigma_next = (
        torch.ones(4, dtype=torch.float64),
        torch.full((4,), 0.9, dtype=torch.float64),
    )
    x_next, lp, mean, std = sde_step_with_logprob(x, v, sigma, sigma_next, 0.7, 0.9, noise=noise)
    for t in (x_next, lp, mean, std):
        assert torch.isfinite(t).all()
    s_cap = 0.7 * math.sqrt(0.9 / 0.1)  # sigma replaced by the cap in the diffusion scale
    assert std.flatten().tolist() == pytest.approx([s_cap * math.sqrt(0.1)] * 4)
    assert sde_std(torch.tensor([1.0, 0.5]), 0.7, 0.9).tolist() == pytest.approx([s_cap, 0.7 * 1.0])


def test_gaussian_log_prob_golden() -> None:
    x = torch.zeros(2, 1, 1, 2)
    mean = torch.tensor([[0.0, 1.0], [0.0, 0.0]]).view(2, 1, 1, 2)
    lp = gaussian_log_prob(x, mean, torch.tensor([1.0, 2.0]))
    c = -0.5 * math.log(2 * math.pi)
    assert lp.tolist() == pytest.approx([c - 0.25, c - math.log(2.0)])


def test_sigma_schedule() -> None:
    s = sigma_schedule(4)
    assert s.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    for shift in (0.5, 1.0, 3.0):
        s = sigma_schedule(10, shift)
        assert s.shape == (11,)
        assert s[0].item() == pytest.approx(1.0) and s[-1].item() == 0.0
        assert (s[1:] < s[:-1]).all()
    shifted = sigma_schedule(4, 3.0)
    assert shifted[2].item() == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    assert (shifted[1:-1] > sigma_schedule(4)[1:-1]).all()  # shift > 1: more time at high noise


def test_cps_step_against_formula_and_normal() -> None:
    x, v, noise = rand(*SHAPE, seed=21), rand(*SHAPE, seed=22), rand(*SHAPE, seed=23)
    sigma = torch.tensor([1.0, 0.6, 0.3, 0.1], dtype=torch.float64)
    sigma_next = torch.tensor([0.8, 0.4, 0.25, 0.0], dtype=torch.float64)
    eta = 0.6
    x_next, lp, mean, std = cps_step_with_logprob(x, v, sigma, sigma_next, eta, noise=noise)
    sig, sig_n = sigma.view(-1, 1, 1, 1), sigma_next.view(-1, 1, 1, 1)
    x0_hat, eps_hat = x - sig * v, x + (1 - sig) * v
    c, s = math.cos(eta * math.pi / 2), math.sin(eta * math.pi / 2)
    m_ref = (1 - sig_n) * x0_hat + sig_n * c * eps_hat
    torch.testing.assert_close(mean, m_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(std.flatten(), sigma_next * s, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x_next, m_ref + sig_n * s * noise)
    ok = sigma_next > 0  # at sigma' = 0 the step is deterministic (no density)
    ref = torch.distributions.Normal(m_ref[ok], (sig_n * s)[ok]).log_prob(x_next[ok])
    torch.testing.assert_close(lp[ok], ref.flatten(1).mean(1), rtol=1e-10, atol=1e-10)
    assert torch.isfinite(mean).all()  # sigma = 1 needs no guard


def test_cps_eta_zero_is_euler_and_noise_keeps_coefficients() -> None:
    x, v = rand(*SHAPE, seed=24), rand(*SHAPE, seed=25)
    sigma, sigma_next = (
        torch.full((4,), 0.7, dtype=torch.float64),
        torch.full((4,), 0.5, dtype=torch.float64),
    )
    x_next, _, _, std = cps_step_with_logprob(x, v, sigma, sigma_next, 0.0, noise=rand(*SHAPE))
    torch.testing.assert_close(x_next, euler_step(x, v, sigma, sigma_next))
    assert (std == 0).all()
    # with the exact velocity v = eps - x0 the step lands on (1 - s') x0 + s' * (unit noise):
    # the forward process's coefficients, whatever eta (the noise is not inflated)
    n = 20000
    x0, eps = rand(n, 1, 1, 1, seed=26), rand(n, 1, 1, 1, seed=27)
    xs = 0.3 * x0 + 0.7 * eps
    sig, sig_n = (
        torch.full((n,), 0.7, dtype=torch.float64),
        torch.full((n,), 0.5, dtype=torch.float64),
    )
    for eta in (0.3, 0.9):
        out, *_ = cps_step_with_logprob(
            xs, eps - x0, sig, sig_n, eta, noise=rand(n, 1, 1, 1, seed=28)
        )
        resid = (out - 0.5 * x0) / 0.5  # should be unit-variance noise
        assert resid.std().item() == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("mode", ["fixed", "random", "sliding"])
def test_sde_window_masks(mode: str) -> None:
    full = sde_window(6, 0, mode, 0, 1, 0, 0)
    assert full.tolist() == [True] * 5 + [False]  # the last step is never stochastic
    for it in range(12):
        m = sde_window(8, 3, mode, 2, 2, it, seed=it)
        idx = m.nonzero().flatten().tolist()
        assert len(idx) == 3 and idx == list(range(idx[0], idx[0] + 3)) and idx[-1] <= 6
        if mode == "fixed":
            assert idx[0] == 2
        if mode == "sliding":  # starts at 2, moves one step every 2 iterations, back to 2 after 4
            assert idx[0] == 2 + (it // 2) % 3
            ranged = sde_window(8, 3, mode, 1, 1, it, 0, end=2).nonzero().flatten().tolist()
            assert ranged[0] == 1 + it % 2
    if mode == "random":
        starts = {int(sde_window(8, 3, mode, 0, 1, 0, seed=s).nonzero()[0]) for s in range(40)}
        assert starts == {0, 1, 2, 3, 4}
        ranged = {int(sde_window(8, 1, mode, 1, 1, 0, s, end=3).nonzero()[0]) for s in range(40)}
        assert ranged == {1, 2, 3}  # drawn in [start, end] only
        with pytest.raises(ValueError, match="cannot start"):
            sde_window(8, 3, mode, 3, 1, 0, 0, end=2)  # end before start
        with pytest.raises(ValueError, match="cannot start"):
            sde_window(8, 3, mode, 0, 1, 0, 0, end=5)  # a window of 3 from 5 runs past step 6
        assert torch.equal(sde_window(8, 3, mode, 0, 1, 0, 7), sde_window(8, 3, mode, 0, 1, 5, 7))


def test_tree_noise_blocks_halve_per_window_step() -> None:
    mask = sde_window(10, 3, "fixed", 1, 1, 0, 0)
    assert tree_noise_blocks(mask, 8) == [4, 2, 1]
    assert tree_noise_blocks(mask, 16) == [8, 4, 1]  # the last window step: every member
    assert tree_noise_blocks(sde_window(10, 1, "fixed", 2, 1, 0, 0), 8) == [1]  # plain branch
    with pytest.raises(ValueError, match="divisible by 2\\^2"):
        tree_noise_blocks(mask, 6)


def test_fixed_window_out_of_range_is_an_error() -> None:
    from diffrl.config import validate_tree
    from diffrl.errors import ConfigError
    from diffrl.rollout.engine import RolloutConfig

    with pytest.raises(ValueError, match="cannot start"):
        sde_window(10, 3, "fixed", 7, 1, 0, 0)
    with pytest.raises(ConfigError, match="sde_window_start"):
        validate_tree(RolloutConfig(num_steps=10, sde_window=3, sde_window_start=7), "rollout")
    validate_tree(RolloutConfig(num_steps=10, sde_window=3, sde_window_start=6), "rollout")
    with pytest.raises(ConfigError, match="sde_window_start"):  # any mode: the window must fit
        validate_tree(RolloutConfig(sde_window=3, sde_window_mode="random", sde_window_start=7))
    with pytest.raises(ConfigError, match="sde_window_end"):
        validate_tree(RolloutConfig(sde_window=1, sde_window_mode="random", sde_window_end=9))
    validate_tree(RolloutConfig(sde_window=1, sde_window_mode="random", sde_window_end=4))


def test_coarse_tail_regrids_only_the_ode_steps_after_the_window() -> None:
    sig = sigma_schedule(10)
    mask = sde_window(10, 1, "fixed", 2, 1, 0, 0)
    s, m = coarse_tail(sig, mask, 4)
    assert m.tolist() == [False, False, True] + [False] * 4  # window kept, 4 tail steps
    torch.testing.assert_close(s[:4], sig[:4])  # up to where the window lands, untouched
    torch.testing.assert_close(s[3:], sig[3] * torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted, _ = coarse_tail(sigma_schedule(10, 3.0), mask, 4, shift=3.0)
    end, u = 3 * 0.7 / (1 + 2 * 0.7), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    torch.testing.assert_close(shifted[3:], end * 3 * u / (1 + 2 * u))  # shift 3's spacing
    for tail_steps, m_ in ((0, mask), (7, mask), (9, mask), (3, torch.zeros(10, dtype=torch.bool))):
        s_, k_ = coarse_tail(sig, m_, tail_steps)  # off, already short enough, or no SDE step
        assert torch.equal(s_, sig) and torch.equal(k_, m_)
    last = sde_window(10, 2, "fixed", 7, 1, 0, 0)  # a window ending at the last SDE step
    assert torch.equal(coarse_tail(sig, last, 1)[0], sig)
