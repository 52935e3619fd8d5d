"""FlowGRPO's importance ratios: rollout correction (is / rs, bypass or recompute), GRPO-Guard
and Flow-DPPO, each against its paper's formula written out here in plain torch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_runs import tiny_run

from diffrl.algorithms import flow_dppo, flow_grpo, grpo_guard
from diffrl.algorithms.flow_grpo import GRPOConfig
from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import ConfigError
from diffrl.rollout.samplers import sde_step_with_logprob, sigma_schedule
from diffrl.types import StepSpec, TrainBatch

A, STEPS = 0.7, 3  # the rollout's noise level, and its SDE steps (all trained)
ADV = [1.0, -0.5, 0.7, -1.2]


class TwoAdapterPolicy:
    """v = w x under ``default`` (trainable), w_old x under ``old``, 0.5 x as the reference;
    counts the forwards per adapter."""

    def __init__(self, w: float, w_old: float) -> None:
        self.w = torch.tensor(w, requires_grad=True)
        self.w_old = torch.tensor(w_old)
        self.calls: dict[str | None, int] = {}

    def velocity(self, x, sigma, ids, adapter="default", cond=None):
        self.calls[adapter] = self.calls.get(adapter, 0) + 1
        return {"default": self.w, "old": self.w_old, None: torch.tensor(0.5)}[adapter] * x


def rollout_batch(w_rollout: float) -> TrainBatch:
    """4 SDE trajectories sampled by v = w_rollout x (the rollout's log-probs mu)."""
    g = torch.Generator().manual_seed(3)
    sig = sigma_schedule(STEPS)
    x = torch.randn(4, 2, 2, 2, generator=g)
    lat, lps = [x], []
    for i in range(STEPS):
        eps = torch.randn(x.shape, generator=g)
        x, lp, _, _ = sde_step_with_logprob(
            x, w_rollout * x, sig[i], sig[i + 1], A, float(sig[1]), noise=eps
        )
        lat.append(x)
        lps.append(lp)
    return TrainBatch(
        input_ids=torch.zeros(4, 2, dtype=torch.long),
        ids_hash=("",) * 4,
        x0=lat[-1],
        advantages=torch.tensor(ADV),
        seeds=torch.zeros(4, dtype=torch.long),
        latents=torch.stack(lat, 1),
        log_probs=torch.stack(lps, 1),
        sigmas=sig,
        sde_mask=torch.ones(STEPS, dtype=torch.bool),
        step_spec=StepSpec("flow_grpo", A, 1.0, (1, 0)),
    )


def hand_step(batch: TrainBatch, j: int, w: torch.Tensor):
    """Flow-GRPO's SDE step by hand: (x_{j+1}, its mean under v = w x, std, sigma, sigma')."""
    s, s_next = float(batch.sigmas[j]), float(batch.sigmas[j + 1])
    x, x_next = batch.latents[:, j], batch.latents[:, j + 1]
    safe = float(batch.sigmas[1]) if s >= 1 else s
    a = A * math.sqrt(safe / (1 - safe))
    v = w * x
    mean = x + (v + a**2 / (2 * s) * (x + (1 - s) * v)) * (s_next - s)
    return x_next, mean, a * math.sqrt(s - s_next), s, s_next


def hand_logp(x, mean, std: float) -> torch.Tensor:
    lp = -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def cfg_of(cls, **kw):
    return cls(kl_coef=0.0, timestep_fraction=1.0, timestep_order="ordered", **kw)


def run_loss(module, policy, batch, cfg):
    total, m = module.loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    total.backward()
    return total.detach(), m, policy.w.grad.clone()


def hand_weights(batch, w_cur: float):
    """Per trained step: pi_old/mu with pi_old = the current policy (the bypass)."""
    w = torch.tensor(w_cur)
    out = []
    for j in range(STEPS):
        x_next, mean, std, _, _ = hand_step(batch, j, w)
        out.append(torch.exp(hand_logp(x_next, mean, std) - batch.log_probs[:, j]))
    return torch.stack(out)  # (STEPS, 4)


@pytest.mark.parametrize("mode", ["is", "rs"])
def test_rollout_correction_weights_follow_the_formula(mode: str) -> None:
    batch = rollout_batch(0.8)  # the rollout's policy differs from the trainer's (mismatch)
    r = hand_weights(batch, 1.1)
    cap = float(torch.maximum(r, 1 / r).median())  # the cap both bites and does not
    assert cap > 1
    policy = TwoAdapterPolicy(1.1, 1.1)
    cfg = cfg_of(GRPOConfig, rollout_correction=mode, tis_cap=cap, clip_range=0.2)
    total, m, grad = run_loss(flow_grpo, policy, batch, cfg)

    # independent: w = min(r, C) | 1[1/C <= r <= C]; rho = pi_theta / pi_old = 1 in value
    w = r.clamp(max=cap) if mode == "is" else ((r >= 1 / cap) & (r <= cap)).float()
    changed = (w != 1).sum() if mode == "rs" else (w < r).sum()
    assert 0 < changed < w.numel()
    adv = torch.tensor(ADV)
    w_leaf = torch.tensor(1.1, requires_grad=True)
    objs = []
    for j in range(STEPS):
        x_next, mean, std, _, _ = hand_step(batch, j, w_leaf)
        lp = hand_logp(x_next, mean, std)
        rho = torch.exp(lp - lp.detach())
        objs.append((w[j] * torch.maximum(-adv * rho, -adv * rho.clamp(0.8, 1.2))).mean())
    want = torch.stack(objs).mean()
    want.backward()
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, w_leaf.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["grpo/tis_weight_mean"], w.mean(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["grpo/tis_weight_max"], w.max(), rtol=1e-5, atol=1e-7)


def test_the_bypass_skips_the_old_log_prob_recompute() -> None:
    batch = rollout_batch(0.8)
    runs = {}
    for bypass in (True, False):
        # old == default: what the weight plan keeps at an update's start (minibatches = 1)
        policy = TwoAdapterPolicy(1.1, 1.1)
        cfg = cfg_of(GRPOConfig, rollout_correction="is", rollout_correction_bypass=bypass)
        runs[bypass] = (*run_loss(flow_grpo, policy, batch, cfg), policy.calls, cfg)
    (t_by, m_by, g_by, calls_by, cfg_by), (t_re, m_re, g_re, calls_re, cfg_re) = (
        runs[True],
        runs[False],
    )
    assert calls_by == {"default": STEPS}  # no forward beyond the update's own
    assert calls_re == {"default": STEPS, "old": STEPS}  # one no-grad forward per trained step
    assert torch.equal(t_by, t_re) and torch.equal(g_by, g_re)  # the same loss, for less work
    assert "perf/old_logp_frac" not in m_by and 0 < m_re["perf/old_logp_frac"] < 1
    assert m_re["perf/old_logp_s_per_sample"] > 0
    cost_by, cost_re = flow_grpo.train_cost(cfg_by, batch), flow_grpo.train_cost(cfg_re, batch)
    assert cost_re.forwards - cost_by.forwards == STEPS and cost_re.backwards == cost_by.backwards
    # the recompute keeps ``old`` at the next update's start; off and the bypass leave it alone
    assert flow_grpo.weight_plan(1, cfg_re).refresh_old == 0.0
    assert flow_grpo.weight_plan(1, cfg_by).refresh_old is None
    assert flow_grpo.weight_plan(1, GRPOConfig()).refresh_old is None


def old_and_new(batch, j: int, w_leaf: torch.Tensor, w_old: float):
    """(lp, lp_old, mean, mean_old, std, sigma, sigma') of step j under w_leaf and w_old."""
    x_next, mean, std, s, s_next = hand_step(batch, j, w_leaf)
    _, mean_old, _, _, _ = hand_step(batch, j, torch.tensor(w_old))
    lp, lp_old = hand_logp(x_next, mean, std), hand_logp(x_next, mean_old, std)
    return lp, lp_old, mean, mean_old, std, s, s_next


def test_grpo_guard_matches_the_papers_ratio_norm_and_step_weights() -> None:
    batch, w_old = rollout_batch(0.95), 0.95  # on-policy rollout; the policy moved since
    adv = torch.tensor(ADV)
    # independent: b = ||mu - mu_old||^2_mean / (2 std^2), rho~ = exp((lp - lp_old + b) std),
    # L_t = clipped(rho~) / (sigma - sigma')
    w_leaf = torch.tensor(1.1, requires_grad=True)
    parts = [old_and_new(batch, j, w_leaf, w_old) for j in range(STEPS)]
    rhos, bs = [], []
    for lp, lp_old, mean, mean_old, std, _, _ in parts:
        b = ((mean - mean_old) ** 2 / (2 * std**2)).flatten(1).mean(1)
        rhos.append(torch.exp((lp - lp_old + b) * std))
        bs.append(b.detach())
    eps = float(torch.stack(rhos).detach().sub(1).abs().median())  # the clip both bites and not
    objs = []
    for rho, (*_, s, s_next) in zip(rhos, parts, strict=True):
        clipped = torch.maximum(-adv * rho, -adv * rho.clamp(1 - eps, 1 + eps))
        objs.append((clipped / (s - s_next)).mean())
    want = torch.stack(objs).mean()
    want.backward()

    policy = TwoAdapterPolicy(1.1, w_old)
    cfg = cfg_of(grpo_guard.GuardConfig, clip_range=eps, rollout_correction_bypass=False)
    total, m, grad = run_loss(grpo_guard, policy, batch, cfg)
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, w_leaf.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["guard/bias"], torch.stack(bs).mean(), rtol=1e-5, atol=1e-9)
    assert 0 < float(m["grpo/clip_frac"]) < 1


def test_flow_dppo_matches_the_papers_divergence_mask() -> None:
    batch, w_old = rollout_batch(0.95), 0.95
    adv = torch.tensor(ADV)
    # independent: D = ||mu - mu_old||^2_mean / (2 std^2); mask the rows with D > delta moving
    # away (A > 0 and rho > 1, or A < 0 and rho < 1); L_t = -M A rho
    w_leaf = torch.tensor(1.1, requires_grad=True)
    parts = [old_and_new(batch, j, w_leaf, w_old) for j in range(STEPS)]
    ds = torch.stack([((m - mo).detach() ** 2 / (2 * s**2)).flatten(1).mean(1)
                      for _, _, m, mo, s, _, _ in parts])  # fmt: skip
    delta = float(ds.median())
    objs, masked = [], []
    for (lp, lp_old, *_), d in zip(parts, ds, strict=True):
        rho = torch.exp(lp - lp_old)
        away = ((adv > 0) & (rho.detach() > 1)) | ((adv < 0) & (rho.detach() < 1))
        block = (d > delta) & away
        masked.append(block.float())
        objs.append((-(~block).float() * adv * rho).mean())
    want = torch.stack(objs).mean()
    want.backward()
    frac = torch.stack(masked).mean()
    assert 0 < frac < 0.5  # some rows masked, and not every far one (corrective ones stay)

    policy = TwoAdapterPolicy(1.1, w_old)
    cfg = cfg_of(flow_dppo.DPPOConfig, divergence_threshold=delta, rollout_correction_bypass=False)
    total, m, grad = run_loss(flow_dppo, policy, batch, cfg)
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, w_leaf.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["dppo/masked_frac"], frac, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["dppo/divergence"], ds.mean(), rtol=1e-5, atol=1e-9)
    assert "grpo/clip_frac" not in m  # no clip: the mask takes its place


@pytest.mark.parametrize(
    ("recipe", "overrides", "says"),
    [
        ("shapes_grpo", ["algorithm.rollout_correction=maybe"], "'algorithm.rollout_correction'"),
        (
            "shapes_grpo",
            ["algorithm.rollout_correction=is", "actor.minibatches=2"],
            "'actor.minibatches' = 2",
        ),
        ("shapes_dppo", ["algorithm.rollout_correction_bypass=true"], "'actor.minibatches' = 2"),
        ("shapes_grpo_guard", ["algorithm.modality_credit=true"], "'algorithm.modality_credit'"),
        ("shapes_dppo", ["algorithm.divergence_threshold=0"], "divergence_threshold"),
    ],
)
def test_ratio_config_refusals(recipe: str, overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(recipe, overrides)


@pytest.mark.parametrize("recipe", ["shapes_grpo_guard", "shapes_dppo"])
def test_recipe_trains_two_steps_through_the_cli(recipe: str, tiny_checkpoint, tmp_path: Path):
    smallest = ("data.prompts_per_step=1", "rollout.group_size=2", "rollout.num_steps=2",
                "data.eval_prompts=1", "run.eval_every=100")  # fmt: skip
    argv = tiny_run(tiny_checkpoint, tmp_path, 2, *smallest)
    assert main(["train", recipe, *argv]) == 0
    (metrics,) = tmp_path.rglob("metrics.jsonl")
    rows = [r for r in read_metrics(metrics.parent) if "actor/loss" in r]
    assert len(rows) == 2
    key = "guard/bias" if recipe == "shapes_grpo_guard" else "dppo/masked_frac"
    assert all(key in r and 0 < r["perf/old_logp_frac"] < 1 for r in rows)
