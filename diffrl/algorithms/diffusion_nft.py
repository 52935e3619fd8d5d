"""DiffusionNFT: online diffusion RL with forward-process negative-aware finetuning
(Zheng et al., 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process").

With the frozen old policy v_old (the sampler of the data) and the trained policy v_theta:

    v+ = beta * v_theta + (1 - beta) * v_old          (implicit positive policy)
    v- = (1 + beta) * v_old - beta * v_theta          (implicit negative policy)
    L  = E_{x0, sigma, eps} [ r * ||v+ - v||^2 + (1 - r) * ||v- - v||^2 ] / beta

on freshly noised clean samples x_sigma = (1 - sigma) x0 + sigma eps with v = eps - x0, where the
optimality r in [0, 1] comes from group-normalised rewards: r = 1/2 + 1/2 * clip(A / Z, -1, 1).
Note v+ + v- = 2 v_old. "adaptive" weighting (the reference's) measures the error in x0 space,
x0_hat = x_sigma - sigma * v_pm, divided by its own detached mean absolute error per sample.
``old`` is refreshed from ``default`` every ``old_every`` steps (copy) or by EMA, and the
rollout samples with ``old``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from diffrl.algorithms.advantage import group_advantages, group_ranges
from diffrl.algorithms.modality import (
    credited_rewards,
    element_shares,
    modality_advantages,
    split_of,
)
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
    per_forward,
    register_algorithm,
)
from diffrl.errors import check, check_choice
from diffrl.models.family import broadcast, noised
from diffrl.types import MODALITIES, ScoredBatch, TrainBatch, host_to_device, train_batch

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self


@dataclass(frozen=True)
class NFTConfig(AlgorithmConfig):
    name: str = "diffusion_nft"
    beta: float = 1.0  # guidance strength of the implicit policies
    adv_clip: float = 2.0  # Z in r = 1/2 + 1/2 clip(A/Z, -1, 1)
    global_std: bool = False  # normalise advantages by the batch std instead of the group's
    weighting: str = "adaptive"  # adaptive (x0-space, self-normalised) | uniform (velocity MSE)
    timesteps_per_sample: int = 2  # fresh (sigma, eps) draws per sample per update
    sigma_min: float = 0.02  # training sigmas ~ U(sigma_min, sigma_max)
    sigma_max: float = 0.98
    kl_coef: float = 0.0  # optional anchor ||v_theta - v_ref||^2, ref = adapters disabled
    old_update: str = "copy"  # copy (delayed) | ema
    old_every: int = 2  # copy default -> old every N steps
    old_ema: float = 0.5  # ema: old <- old_ema * old + (1 - old_ema) * default, every step
    # drop groups whose rewards are all equal (r = 1/2 for every member: no policy signal,
    # only the pull towards v_old); saves their forward/backward passes (DAPO-style filter)
    skip_uniform_groups: bool = False
    # common random numbers: every member of a group is noised with the same (sigma, eps), so
    # the noise in the regression target cancels in the advantage-weighted sum over the group;
    # each sample's own (sigma, eps) keeps its distribution, so the gradient stays unbiased
    shared_noise: bool = False
    # the no-grad forwards (the old policy's, and the KL reference's) batched across the
    # sample's training timesteps: about this many samples per forward, computed before the
    # policy's passes (neither changes within an update). 0 = one of each per timestep beside
    # the policy's, as a diffusers training script does (the bench baseline)
    old_rows: int = 32

    def validate(self) -> None:
        check(self.beta > 0, "beta", self.beta, "must be > 0")
        check(self.old_rows >= 0, "old_rows", self.old_rows, "must be >= 0")
        check(self.adv_clip > 0, "adv_clip", self.adv_clip, "must be > 0")
        check_choice("weighting", self.weighting, ("adaptive", "uniform"))
        check_training_draws(
            "timesteps_per_sample", self.timesteps_per_sample, self.sigma_min, self.sigma_max
        )
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        check_choice("old_update", self.old_update, ("copy", "ema"))
        check(self.old_every >= 1, "old_every", self.old_every, "must be >= 1")
        check(0 <= self.old_ema < 1, "old_ema", self.old_ema, "must be in [0, 1)")

    def unbatched(self) -> Self:
        return replace(self, old_rows=0)

    def whole_batch_keys(self) -> tuple[str, ...]:
        return ("global_std",) if self.global_std else ()


def optimality(advantages: Tensor, z: float) -> Tensor:
    """r = 1/2 + 1/2 * clip(A / Z, -1, 1), in [0, 1]."""
    return 0.5 + 0.5 * (advantages / z).clamp(-1.0, 1.0)


def prepare(scored: ScoredBatch, cfg: NFTConfig) -> TrainBatch:
    traj = scored.traj
    if cfg.modality_credit:
        return prepare_by_modality(scored, cfg)
    adv = group_advantages(scored.rewards, traj.group, scored.valid, global_std=cfg.global_std)
    keep_mask = scored.valid
    if cfg.skip_uniform_groups:
        keep_mask = keep_mask & informative_groups(scored.rewards, traj.group, scored.valid)
    batch = train_batch(scored, optimality=optimality(adv, cfg.adv_clip), noise_key=group_key(traj))
    return batch.select(keep_mask.nonzero().squeeze(1))


def prepare_by_modality(scored: ScoredBatch, cfg: NFTConfig) -> TrainBatch:
    """algorithm.modality_credit: r per modality (``modality.py``), (B, 2); ``optimality``
    holds their mean (the logged r). A group is uniform only when both modalities' are."""
    traj = scored.traj
    r = optimality(modality_advantages(scored, cfg.global_std, cfg.modality_std), cfg.adv_clip)
    keep_mask = scored.valid
    if cfg.skip_uniform_groups:
        rewards = credited_rewards(scored)
        informative = [informative_groups(rewards[:, k], traj.group, scored.valid) for k in (0, 1)]
        keep_mask = keep_mask & (informative[0] | informative[1])
    batch = train_batch(
        scored, optimality=r.mean(1), modality_optimality=r, noise_key=group_key(traj)
    )
    return batch.select(keep_mask.nonzero().squeeze(1))


def informative_groups(rewards: Tensor, group: Tensor, valid: Tensor) -> Tensor:
    """(B,) bool: the sample's group has at least two distinct valid rewards."""
    return (group_ranges(rewards, group, valid) > 1e-6)[group] & valid


def training_noise(
    batch: TrainBatch, cfg: NFTConfig, gen: torch.Generator, j: int
) -> tuple[Tensor, Tensor]:
    """(sigma (B,), eps (B, *S)) for the j-th training timestep of each sample; with
    ``shared_noise`` the draws are keyed on the sample's group (``noise_key``), so every member
    of a group is noised alike (common random numbers)."""
    x0 = batch.x0
    if not cfg.shared_noise:
        sigma = torch.empty(len(x0)).uniform_(cfg.sigma_min, cfg.sigma_max, generator=gen)
        eps = torch.randn(x0.shape, generator=gen)
        return host_to_device(sigma, x0.device, x0.dtype), host_to_device(eps, x0.device, x0.dtype)
    assert batch.noise_key is not None, "shared_noise: prepare keys each row's noise"
    sigmas: list[Tensor] = []
    noises: list[Tensor] = []
    for key in batch.noise_key.tolist():  # the group's key: identical draws for its members
        g = torch.Generator().manual_seed((key * 31 + j) % (2**63 - 1))
        sigmas.append(torch.empty(()).uniform_(cfg.sigma_min, cfg.sigma_max, generator=g))
        noises.append(torch.randn(x0.shape[1:], generator=g))
    return (
        host_to_device(torch.stack(sigmas), x0.device, x0.dtype),
        host_to_device(torch.stack(noises), x0.device, x0.dtype),
    )


def implicit_policies(v_theta: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    return v_pos, v_neg


def _per_sample_error(
    v_pm: Tensor, v: Tensor, x: Tensor, x0: Tensor, sigma: Tensor, weighting: str
) -> Tensor:
    """(B,) error of one implicit policy against the target velocity."""
    if weighting == "uniform":
        return (v_pm - v).pow(2).flatten(1).mean(1)
    x0_hat = x - broadcast(sigma, x) * v_pm  # the implicit policy's clean-sample estimate
    scale = (x0_hat.detach() - x0).abs().flatten(1).mean(1).clamp(min=1e-5)
    return (x0_hat - x0).pow(2).flatten(1).mean(1) / scale


def _modality_errors(
    v_pm: Tensor, v: Tensor, x: Tensor, x0: Tensor, sigma: Tensor, weighting: str, split
) -> Tensor:
    """(B, 2) ``_per_sample_error`` split by modality (video, audio): each modality's elements'
    share of it, so the two add up to it (the adaptive scale stays the whole sample's)."""
    if weighting == "uniform":
        return element_shares((v_pm - v).pow(2).flatten(1), split)
    x0_hat = x - broadcast(sigma, x) * v_pm
    scale = (x0_hat.detach() - x0).abs().flatten(1).mean(1).clamp(min=1e-5)
    return element_shares((x0_hat - x0).pow(2).flatten(1), split) / scale[:, None]


def weighted_errors(
    batch: TrainBatch, r: Tensor, v_pos: Tensor, v_neg: Tensor, v: Tensor, x, sigma, cfg
) -> tuple[Tensor, Tensor, Tensor]:
    """(B,) r l+ + (1 - r) l-, and the (B,) errors l+ and l- (for the metrics); under
    modality credit each modality's elements weighted by its own r (``modality.py``)."""
    x0 = batch.x0
    if not cfg.modality_credit:
        l_pos = _per_sample_error(v_pos, v, x, x0, sigma, cfg.weighting)
        l_neg = _per_sample_error(v_neg, v, x, x0, sigma, cfg.weighting)
        return r * l_pos + (1 - r) * l_neg, l_pos, l_neg
    assert batch.modality_optimality is not None, "prepare gives every row its r per modality"
    split = split_of(batch, "diffusion_nft")
    r_m = batch.modality_optimality.to(x0)  # (B, 2)
    e_pos = _modality_errors(v_pos, v, x, x0, sigma, cfg.weighting, split)
    e_neg = _modality_errors(v_neg, v, x, x0, sigma, cfg.weighting, split)
    return (r_m * e_pos + (1 - r_m) * e_neg).sum(1), e_pos.sum(1), e_neg.sum(1)


def loss(
    policy: Policy,
    batch: TrainBatch,
    cfg: NFTConfig,
    gen: torch.Generator,
    backward: Backward | None = None,
) -> tuple[Tensor, Metrics]:
    assert batch.optimality is not None, "prepare gives every row its optimality r"
    x0, ids, r = batch.x0, batch.input_ids, batch.optimality.to(batch.x0)
    cond = batch.cond
    total = x0.new_zeros(())
    metrics: Metrics = {"nft/r_mean": r.mean()}
    if cfg.modality_credit and batch.modality_optimality is not None:
        for i, name in enumerate(MODALITIES):
            metrics[f"nft/r_mean_{name}"] = batch.modality_optimality[:, i].mean()
        # how far the modalities' credit differs per sample (0: the scalar run's r)
        r_m = batch.modality_optimality
        metrics["nft/r_modality_gap"] = (r_m[:, 0] - r_m[:, 1]).abs().mean()
    k = cfg.timesteps_per_sample
    draws = [training_noise(batch, cfg, gen, j) for j in range(k)]  # gen's order is unchanged
    inputs = [noised(x0, sigma, eps) for sigma, eps in draws]
    frozen = {}  # adapter -> its no-grad velocities, one per timestep, batched across them
    if cfg.old_rows > 0:
        for adapter in ("old", None) if cfg.kl_coef > 0 else ("old",):
            frozen[adapter] = batched_velocities(policy, inputs, draws, batch, adapter, cfg)
    for j in range(k):
        (sigma, eps), x = draws[j], inputs[j]
        v = eps - x0
        if "old" in frozen:
            v_old = frozen["old"][j]
        else:
            with torch.no_grad():
                v_old = policy.velocity(x, sigma, ids, adapter="old", cond=cond)
        v_theta = policy.velocity(x, sigma, ids, adapter="default", cond=cond)
        v_pos, v_neg = implicit_policies(v_theta, v_old, cfg.beta)
        weighted, l_pos, l_neg = weighted_errors(batch, r, v_pos, v_neg, v, x, sigma, cfg)
        step_loss = (weighted / cfg.beta).mean()
        if cfg.kl_coef > 0:
            if None in frozen:
                v_ref = frozen[None][j]
            else:
                with torch.no_grad():
                    v_ref = policy.velocity(x, sigma, ids, adapter=None, cond=cond)
            kl = (v_theta - v_ref).pow(2).mean()
            step_loss = step_loss + cfg.kl_coef * kl
            metrics["nft/kl"] = metrics.get("nft/kl", 0.0) + kl.detach() / cfg.timesteps_per_sample
        total = add_part(total, step_loss / cfg.timesteps_per_sample, backward)
        for key, value in (("nft/loss_pos", l_pos), ("nft/loss_neg", l_neg)):
            metrics[key] = metrics.get(key, 0.0) + value.detach().mean() / cfg.timesteps_per_sample
    return total, metrics


@torch.no_grad()
def batched_velocities(
    policy: Policy, inputs: list, draws: list, batch: TrainBatch, adapter, cfg: NFTConfig
) -> list[Tensor]:
    """``adapter``'s velocity at each timestep's noised inputs, in no-grad forwards of about
    ``cfg.old_rows`` samples (whole timesteps each): -> one (n, *S) tensor per timestep."""
    n, k = len(batch), len(inputs)
    per = per_forward(k, n, cfg.old_rows)
    ids, cond = batch.input_ids, batch.cond
    out: list[Tensor] = []
    for j0 in range(0, k, per):
        js = range(j0, min(k, j0 + per))
        x = torch.cat([inputs[j] for j in js])
        sigma = torch.cat([draws[j][0] for j in js])
        c = None if cond is None else cond.repeat(len(js), *([1] * (cond.ndim - 1)))
        v = policy.velocity(x, sigma, ids.repeat(len(js), 1), adapter=adapter, cond=c)
        out.extend(v.split(n))
    return out


def train_cost(cfg: NFTConfig, batch: TrainBatch) -> TrainCost:
    """Per training timestep: the old policy's forward and the policy's forward and backward,
    and the KL reference's forward when there is one."""
    kl = 1 if cfg.kl_coef > 0 else 0
    return TrainCost(
        forwards=cfg.timesteps_per_sample * (2 + kl), backwards=cfg.timesteps_per_sample
    )


def weight_plan(step: int, cfg: NFTConfig) -> WeightPlan:
    """Sample with ``old`` (as the reference implementation); refresh it by copy every
    ``old_every`` updates, or as an EMA after every update, and sync only then."""
    if cfg.old_update == "ema":
        return WeightPlan("old", refresh_old=cfg.old_ema)
    refresh = step % cfg.old_every == 0
    return WeightPlan("old", refresh_old=0.0 if refresh else None, sync=refresh)


def group_key(traj) -> Tensor:
    """(B,) int64: each row's group's first seed, a key shared by the group and distinct
    across groups and steps (the seeds are per-step draws)."""
    first = torch.full((int(traj.group.max()) + 1,), -1, dtype=torch.int64)
    for row in range(len(traj.group) - 1, -1, -1):  # ends holding each group's first row
        first[traj.group[row]] = traj.seeds[row]
    return first[traj.group]


ALGORITHM = register_algorithm(
    Algorithm(
        name="diffusion_nft",
        config_cls=NFTConfig,
        prepare=prepare,
        loss=loss,
        weight_plan=weight_plan,
        train_cost=train_cost,
        needs_logprobs=False,
        partial_backward=True,
    )
)
