"""Direct Group Preference Optimization (Luo, Hu and Tang, 2025, "Reinforcing Diffusion Models
by Direct Group Preference Optimization", arXiv:2510.08425, ICLR 2026).

DPO between the two halves of a prompt's group: G+ (advantage A > 0) is preferred to G-
(A < 0), each sample weighted by |A|, which balances the halves so the partition function
cancels (the A of a group sum to zero). With the flow-matching stand-in for the log-ratio,
log p_theta(x) / p_ref(x) ~ -(l_theta(x) - l_ref(x)), l = ||v(x_sigma, sigma) - v||^2 (mean
over dimensions) on x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0:

    R(G+) - R(G-) = -S,   S = beta / |G| * sum_{x in G} A(x) * (l_theta(x) - l_ref(x))
    L_DGPO = -log sigmoid(-S)

whose gradient is sigmoid(S) * beta / |G| * sum_x A(x) grad l_theta(x). As the reference, diffrl
trains on a surrogate with that direction (the mean over groups of L_DGPO has beta times its
gradient, for groups of equal size),

    L = mean_x [ sg(sigmoid(S_g(x))) * A(x) * l_theta(x) ] + kl_coef * ||v_theta - v_base||^2

(``dgpo/group_loss`` logs L_DGPO itself). A group whose policy already ranks it well past the
reference (S << 0) stops pulling; one ranked the wrong way pulls at full weight. The reference
is the base model (adapters disabled, ``reference=base``) or the ``old`` adapter as an EMA of
the policy (``reference=ema``, old <- ref_ema * old + (1 - ref_ema) * policy every update). A is
the group-normalised advantage clipped to +-``adv_clip``. Members of a group share their
training noise (``shared_noise``, as the reference) so the noise cancels in S. The rollout
samples with the policy (ODE by default: DGPO needs no stochastic policy) and syncs each update.

S needs every member of a group: ``prepare`` keeps groups whole (a sample whose scorer failed
stays, with A = 0), ``actor.micro_batch`` must be a multiple of ``rollout.group_size`` (checked
with the config), and the loss refuses a micro-batch that splits a group all the same.

What the reference does that diffrl does differently:
- It adds a PPO-style clip of the matching loss against a fast EMA ``clip_range`` (1e-3..1e-5)
  and switches the sampler to that EMA after some steps; diffrl trains each sample once, on
  policy (the clip is inactive at the first optimizer step), and has no sampler switch.
- Its training timesteps are the sampler's discrete grid within a fraction of the schedule,
  one shared draw across all GPUs; here sigma ~ U(sigma_min, sigma_max), shared within a group.
- CFG on the reference branch (``kl_cfg``) is not offered: the tiny models train CFG-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from diffrl.algorithms.advantage import group_advantages
from diffrl.algorithms.awm import fm_draws, velocity_gap
from diffrl.algorithms.diffusion_nft import group_key
from diffrl.algorithms.registry import (
    Algorithm,
    AlgorithmConfig,
    Backward,
    Metrics,
    Policy,
    Setup,
    TrainCost,
    WeightPlan,
    add_part,
    check_training_draws,
    register_algorithm,
)
from diffrl.errors import ConfigError, check, check_choice
from diffrl.models.family import noised
from diffrl.types import ScoredBatch, TrainBatch, train_batch


@dataclass(frozen=True)
class DGPOConfig(AlgorithmConfig):
    name: str = "dgpo"
    beta: float = 100.0  # the DPO temperature of the group preference (the reference's beta_dpo)
    adv_clip: float = 5.0  # A clipped to [-adv_clip, adv_clip]
    global_std: bool = False  # normalise advantages by the batch std instead of the group's
    reference: str = "base"  # base (adapters disabled) | ema (the old adapter, an EMA)
    ref_ema: float = 0.3  # reference=ema: old <- ref_ema * old + (1 - ref_ema) * policy
    kl_coef: float = 0.0  # ||v_theta - v_base||^2 (the reference's beta, 1e-3 in its recipes)
    timesteps_per_sample: int = 1  # fresh (sigma, eps) draws per sample per update
    sigma_min: float = 0.02  # training sigmas ~ U(sigma_min, sigma_max)
    sigma_max: float = 0.98
    shared_noise: bool = True  # one (sigma, eps) per group and draw: the noise cancels in S

    def validate(self) -> None:
        check(self.beta > 0, "beta", self.beta, "must be > 0")
        check(self.adv_clip > 0, "adv_clip", self.adv_clip, "must be > 0")
        check_choice("reference", self.reference, ("base", "ema"))
        check(0 <= self.ref_ema < 1, "ref_ema", self.ref_ema, "must be in [0, 1)")
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        check_training_draws(
            "timesteps_per_sample", self.timesteps_per_sample, self.sigma_min, self.sigma_max
        )
        check(
            not self.modality_credit,
            "modality_credit",
            self.modality_credit,
            "dgpo splits each group by one scalar advantage; set it false (or use "
            "diffusion_nft or flow_grpo)",
        )

    def whole_batch_keys(self) -> tuple[str, ...]:
        return ("global_std",) if self.global_std else ()


@dataclass(frozen=True)
class GroupPreference(Algorithm[DGPOConfig]):
    """Beyond every algorithm's rules: an actor micro-batch of whole groups, refused with the
    config rather than at the first update (the actor splits a step's rows, groups in order,
    into micro-batches of ``actor.micro_batch``)."""

    def validate(self, cfg: Setup) -> None:
        super().validate(cfg)
        micro = getattr(getattr(cfg, "actor", None), "micro_batch", None)  # a full Config's
        g = cfg.rollout.group_size
        if isinstance(micro, int) and micro % g:
            raise ConfigError(
                f"config key 'actor.micro_batch' = {micro}: dgpo scores each group as a whole, "
                f"so a micro-batch must hold whole groups; set it to a multiple of "
                f"rollout.group_size ({g})"
            )


def prepare(scored: ScoredBatch, cfg: DGPOConfig) -> TrainBatch:
    """Every row, groups whole (rollout order keeps a group's rows together); a failed
    sample's A is 0, so it weighs nothing in S or in the preference term."""
    traj = scored.traj
    adv = group_advantages(scored.rewards, traj.group, scored.valid, global_std=cfg.global_std)
    adv = torch.where(scored.valid, adv.clamp(-cfg.adv_clip, cfg.adv_clip), 0.0)
    return train_batch(scored, advantages=adv, noise_key=group_key(traj))


def group_weights(
    adv: Tensor, err: Tensor, ref_err: Tensor, group: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """Per row, its group's S_g = beta / |g| * sum_g A (l_theta - l_ref), over the groups in
    ``group`` (B,) -> (sigmoid(S_g) per row (B,), the mean over groups of L_DGPO =
    -log sigmoid(-S_g) ()). Through a (B, B) same-group matrix rather than ``unique``, so
    nothing waits on the device (a micro-batch is tens of rows)."""
    same = (group[:, None] == group[None, :]).to(err.dtype)  # (B, B)
    size = same.sum(1)  # (B,) rows of each row's group
    s = same @ (beta * adv * (err - ref_err)) / size
    # each group's L_DGPO once: its rows' mean weighs 1/|g| per row
    group_loss = (-F.logsigmoid(-s) / size).sum() / (1 / size).sum()
    return torch.sigmoid(s), group_loss


def whole_groups(group: Tensor) -> None:
    """Refuse a micro-batch that splits a group (its S would miss members): the groups a
    micro-batch holds all have as many rows. Checked on the host only: on an accelerator it
    would wait on the device every micro-batch, and the config's ``actor.micro_batch`` rule
    (``GroupPreference.validate``) holds there."""
    if group.device.type != "cpu":
        return
    counts = group.unique(return_counts=True)[1]
    if len(counts) and bool((counts != counts.max()).any()):
        raise ValueError(
            "dgpo micro-batches must hold whole groups: set actor.micro_batch to a multiple of "
            "rollout.group_size"
        )


def loss(
    policy: Policy,
    batch: TrainBatch,
    cfg: DGPOConfig,
    gen: torch.Generator,
    backward: Backward | None = None,
) -> tuple[Tensor, Metrics]:
    assert batch.advantages is not None and batch.group is not None, "prepare sets both"
    whole_groups(batch.group)
    x0, adv, group = batch.x0, batch.advantages.to(batch.x0), batch.group.to(batch.x0.device)
    k = cfg.timesteps_per_sample
    draws = fm_draws(batch, k, cfg.sigma_min, cfg.sigma_max, cfg.shared_noise, gen)
    ref = "old" if cfg.reference == "ema" else None
    total = x0.new_zeros(())
    metrics: Metrics = {}
    for sigma, eps in draws:
        x, v = noised(x0, sigma, eps), eps - x0
        v_theta = policy.velocity(x, sigma, batch.input_ids, cond=batch.cond)
        err = (v_theta - v).pow(2).flatten(1).mean(1)  # (B,)
        with torch.no_grad():
            v_ref = policy.velocity(x, sigma, batch.input_ids, adapter=ref, cond=batch.cond)
            ref_err = (v_ref - v).pow(2).flatten(1).mean(1)
        weight, group_loss = group_weights(adv, err.detach(), ref_err, group, cfg.beta)
        part = (weight * adv * err).mean()
        parts = {"dgpo/group_loss": group_loss, "dgpo/weight": weight.mean()}
        if cfg.kl_coef > 0:
            gap = velocity_gap(policy, v_theta, x, sigma, batch, None).mean()
            part = part + cfg.kl_coef * gap
            parts["dgpo/kl"] = gap.detach()
        total = add_part(total, part / k, backward)
        for key, value in parts.items():
            metrics[key] = metrics.get(key, 0.0) + value / k
    return total, metrics


def train_cost(cfg: DGPOConfig, batch: TrainBatch) -> TrainCost:
    """Per training draw: the policy's forward and backward, the preference reference's
    forward, and the KL anchor's when it is on."""
    k = cfg.timesteps_per_sample
    return TrainCost(forwards=k * (2 + (cfg.kl_coef > 0)), backwards=k)


def weight_plan(step: int, cfg: DGPOConfig) -> WeightPlan:
    """Sample with the policy, synced every update; ``reference=ema`` moves ``old`` towards it."""
    return WeightPlan("default", refresh_old=cfg.ref_ema if cfg.reference == "ema" else None)


ALGORITHM = register_algorithm(
    GroupPreference(
        name="dgpo",
        config_cls=DGPOConfig,
        prepare=prepare,
        loss=loss,
        weight_plan=weight_plan,
        train_cost=train_cost,
        needs_logprobs=False,
        partial_backward=True,
        group_use="it prefers the group's above-mean half to its below-mean half",
    )
)
