"""Advantage Weighted Matching (Xue et al., 2025, "Advantage Weighted Matching: Aligning RL
with Pretraining in Diffusion Models", arXiv:2509.25050).

The pretraining loss, flow matching on the policy's own clean samples, weighted per sample by
its group advantage: with x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0 and
l = ||v_theta(x_sigma, sigma) - v||^2 (mean over dimensions),

    L = E_{x0, sigma, eps} [ A(x0) * w(l, sigma) ]
        + kl_coef * ||v_theta - v_ref||^2 + ema_kl_coef * ||v_theta - v_ema||^2

so a sample above its group's mean is pulled towards (its matching error is lowered) and one
below is pushed away; -w(l, sigma) plays the log-likelihood of DDPO's policy gradient (the
paper's point: DDPO is flow matching on noisy targets, AWM the same on clean ones). The
weightings w of the reference: ``uniform`` l, ``t`` sigma l, ``t2`` sigma^2 l, ``ghuber``
sigma / p * ((l + e)^p - e^p) (a generalised Huber loss that damps large errors; p =
``ghuber_power``, e = 1e-10). A is the group-normalised advantage clipped to +-``adv_clip``
and scaled by ``adv_max / adv_clip`` (the reference's ``advantage_max``), so |A| <= adv_max.
v_ref is the base model (adapters disabled); v_ema the ``old`` adapter, kept as an EMA of the
policy (old <- old_ema * old + (1 - old_ema) * policy after each update), the reference's
"KL-EMA" trust region. The rollout samples with the policy and is synced every update.

What the reference does that diffrl does differently:
- Its loss is PPO's, -A * rho with rho = exp(-w_theta + w_old) against the policy at the
  update's start, clipped to 1 +- clip_range; one pass over fresh samples makes rho = 1 at the
  first optimizer step, where the gradient is A * grad w (the README calls the clip "currently
  not work (on policy)"). diffrl trains each sample once, on policy, on A * w, which has that
  gradient, without the extra no-grad forward the ratio costs; with ``actor.minibatches`` > 1
  the later minibatches are slightly off policy and unclipped (the EMA anchor is the trust
  region).
- Training sigmas are drawn uniform in [sigma_min, sigma_max] per sample and draw (the
  reference picks stratified indices of the sampler's discrete grid, or a shifted
  logit-normal); ``shared_noise`` draws one (sigma, eps) per group instead.
- The reference's old-policy EMA decay follows a linear ramp; here it is constant
  (``old_ema``). Samples come from diffrl's ODE (or SDE) sampler rather than SA-Solver.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diffrl.algorithms.advantage import group_advantages
from diffrl.algorithms.diffusion_nft import NFTConfig, group_key, training_noise
from diffrl.algorithms.registry import (
    Algorithm,
    AlgorithmConfig,
    Backward,
    Metrics,
    Policy,
    TrainCost,
    WeightPlan,
    add_part,
    check_training_draws,
    register_algorithm,
)
from diffrl.errors import check, check_choice
from diffrl.models.family import noised
from diffrl.types import ScoredBatch, TrainBatch, train_batch

WEIGHTINGS = ("uniform", "t", "t2", "ghuber")
GHUBER_EPS = 1e-10  # the reference's e in (l + e)^p - e^p: keeps the gradient finite at l = 0


@dataclass(frozen=True)
class AWMConfig(AlgorithmConfig):
    name: str = "awm"
    adv_clip: float = 5.0  # A clipped to [-adv_clip, adv_clip] ...
    adv_max: float = 1.0  # ... then scaled by adv_max / adv_clip (|A| <= adv_max)
    global_std: bool = False  # normalise advantages by the batch std instead of the group's
    weighting: str = "uniform"  # w(l, sigma): uniform | t | t2 | ghuber (see the docstring)
    ghuber_power: float = 0.25  # p of the ghuber weighting
    timesteps_per_sample: int = 2  # fresh (sigma, eps) draws per sample per update
    sigma_min: float = 0.02  # training sigmas ~ U(sigma_min, sigma_max)
    sigma_max: float = 0.98
    # common random numbers: every member of a group noised with the same (sigma, eps)
    shared_noise: bool = False
    kl_coef: float = 0.0  # ||v_theta - v_ref||^2, ref = the base model (adapters disabled)
    ema_kl_coef: float = 0.0  # ||v_theta - v_old||^2, old = an EMA of the policy
    old_ema: float = 0.3  # old <- old_ema * old + (1 - old_ema) * policy, every update

    def validate(self) -> None:
        check(self.adv_clip > 0, "adv_clip", self.adv_clip, "must be > 0")
        check(self.adv_max > 0, "adv_max", self.adv_max, "must be > 0")
        check_choice("weighting", self.weighting, WEIGHTINGS)
        check(0 < self.ghuber_power <= 1, "ghuber_power", self.ghuber_power, "must be in (0, 1]")
        check_training_draws(
            "timesteps_per_sample", self.timesteps_per_sample, self.sigma_min, self.sigma_max
        )
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        check(self.ema_kl_coef >= 0, "ema_kl_coef", self.ema_kl_coef, "must be >= 0")
        check(0 <= self.old_ema < 1, "old_ema", self.old_ema, "must be in [0, 1)")
        check(
            not self.modality_credit,
            "modality_credit",
            self.modality_credit,
            "awm weighs whole samples by one scalar advantage; set it false (or use "
            "diffusion_nft or flow_grpo)",
        )

    def whole_batch_keys(self) -> tuple[str, ...]:
        return ("global_std",) if self.global_std else ()


def scaled_advantages(adv: Tensor, clip: float, most: float) -> Tensor:
    """clip(A, -clip, clip) * most / clip: the reference's advantage_max scaling."""
    return adv.clamp(-clip, clip) * (most / clip)


def prepare(scored: ScoredBatch, cfg: AWMConfig) -> TrainBatch:
    traj = scored.traj
    adv = group_advantages(scored.rewards, traj.group, scored.valid, global_std=cfg.global_std)
    adv = scaled_advantages(adv, cfg.adv_clip, cfg.adv_max)
    batch = train_batch(scored, advantages=adv, noise_key=group_key(traj))
    return batch.select(scored.valid.nonzero().squeeze(1))


def matching_weight(err: Tensor, sigma: Tensor, how: str, power: float) -> Tensor:
    """w(l, sigma) per sample, from (B,) flow-matching errors l and (B,) sigmas; in float64
    (as the reference), so ghuber's (l + 1e-10)^p keeps its small e."""
    err, sigma = err.double(), sigma.double()
    if how == "uniform":
        return err
    if how == "t":
        return sigma * err
    if how == "t2":
        return sigma.square() * err
    return sigma / power * ((err + GHUBER_EPS).pow(power) - GHUBER_EPS**power)


def fm_draws(
    batch: TrainBatch, k: int, lo: float, hi: float, shared: bool, gen: torch.Generator
) -> list[tuple[Tensor, Tensor]]:
    """k (sigma (B,), eps (B, *S)) draws of training noise, DiffusionNFT's (``training_noise``,
    the same generator order; ``shared``: keyed on each row's group)."""
    draw = NFTConfig(sigma_min=lo, sigma_max=hi, shared_noise=shared)
    return [training_noise(batch, draw, gen, j) for j in range(k)]


def velocity_gap(policy: Policy, v_theta: Tensor, x, sigma, batch, adapter) -> Tensor:
    """(B,) ||v_theta - v_adapter||^2 (mean over dimensions), the frozen side without grad."""
    with torch.no_grad():
        v = policy.velocity(x, sigma, batch.input_ids, adapter=adapter, cond=batch.cond)
    return (v_theta - v).pow(2).flatten(1).mean(1)


def loss(
    policy: Policy,
    batch: TrainBatch,
    cfg: AWMConfig,
    gen: torch.Generator,
    backward: Backward | None = None,
) -> tuple[Tensor, Metrics]:
    assert batch.advantages is not None, "prepare gives every row its advantage"
    x0, adv = batch.x0, batch.advantages.to(batch.x0)
    k = cfg.timesteps_per_sample
    draws = fm_draws(batch, k, cfg.sigma_min, cfg.sigma_max, cfg.shared_noise, gen)
    total = x0.new_zeros(())
    metrics: Metrics = {"awm/adv_abs": adv.abs().mean()}
    for sigma, eps in draws:
        x = noised(x0, sigma, eps)
        v_theta = policy.velocity(x, sigma, batch.input_ids, cond=batch.cond)
        err = (v_theta - (eps - x0)).pow(2).flatten(1).mean(1)  # (B,)
        w = matching_weight(err, sigma, cfg.weighting, cfg.ghuber_power)
        part = (adv.double() * w).mean().to(x0.dtype)
        parts = {"awm/fm_loss": err.detach().mean()}
        for key, coef, adapter in (("kl", cfg.kl_coef, None), ("ema_kl", cfg.ema_kl_coef, "old")):
            if coef > 0:
                gap = velocity_gap(policy, v_theta, x, sigma, batch, adapter).mean()
                part = part + coef * gap
                parts[f"awm/{key}"] = gap.detach()
        total = add_part(total, part / k, backward)
        for key, value in parts.items():
            metrics[key] = metrics.get(key, 0.0) + value / k
    return total, metrics


def train_cost(cfg: AWMConfig, batch: TrainBatch) -> TrainCost:
    """Per training draw: the policy's forward and backward, and a no-grad forward for each
    anchor (reference, EMA) in use."""
    anchors = (cfg.kl_coef > 0) + (cfg.ema_kl_coef > 0)
    k = cfg.timesteps_per_sample
    return TrainCost(forwards=k * (1 + anchors), backwards=k)


def weight_plan(step: int, cfg: AWMConfig) -> WeightPlan:
    """On policy: sample with the policy, synced every update; ``old`` follows it as an EMA
    when the EMA anchor is on."""
    return WeightPlan("default", refresh_old=cfg.old_ema if cfg.ema_kl_coef > 0 else None)


ALGORITHM = register_algorithm(
    Algorithm(
        name="awm",
        config_cls=AWMConfig,
        prepare=prepare,
        loss=loss,
        weight_plan=weight_plan,
        train_cost=train_cost,
        needs_logprobs=False,
        partial_backward=True,
    )
)
