"""FlowGRPO: online RL for flow matching through an SDE sampler with exact log-probs
(Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL").

Rollout with the SDE step x' = mu + s sqrt(-d_sigma) eps, s = a sqrt(sigma / (1 - sigma)),
mu = x + [v + s^2 / (2 sigma) (x + (1 - sigma) v)] d_sigma, keeping every x and the per-step
Gaussian log-prob (mean over dimensions, the same function at rollout and training). Then

    rho_t = exp(logp_theta(x_{t+1} | x_t) - logp_rollout(x_{t+1} | x_t))
    L = E_t [ max(-A rho_t, -A clip(rho_t, 1 - eps, 1 + eps)) ] + beta_kl * KL_t

with A the group-normalised, clipped advantage and KL_t = ||mu_theta - mu_ref||^2 / (2 std^2)
(mean over dims) against the reference policy (adapters disabled). Trains on a fraction of
the SDE steps (shuffled per sample or in order).

The family, as rollout options (the loss reads what the trajectory recorded, so rollout and
training cannot disagree): ``rollout.sde_step=cps`` (coefficients-preserving step, Wang et
al., 2025), ``rollout.sde_window`` + ``sde_window_mode`` (Flow-GRPO-Fast / MixGRPO: SDE only in
a window of k steps, ODE elsewhere, trained only there; ``rollout.ode_tail_steps`` runs the ODE
steps after the window on a coarser grid), ``rollout.shared_init_noise``
(DanceGRPO: one initial noise per group; with a one-step window the group branches at that
step), ``rollout.antithetic_noise`` (mirrored SDE noise in pairs), ``rollout.cfg_scale`` (CFG in
rollout and in the recomputed log-probs alike). Where a group's members share their input at a
trained step (shared initial noise, up to and at the step where they branch), the loss runs one
forward per group and spreads it over the members: the same loss and gradient, for less work.

Rollouts that survive a weight sync (``run.async_sync=step``): a trajectory's steps may come
from different policy versions (``TrainBatch.step_versions``). A trained step taken by a
version older than the actor's at the update's start (``TrainBatch.prox_version``) is weighed
by its own truncated importance weight, as in rollout correction (decoupled PPO):

    w_t = min(pi_prox(x_{t+1} | x_t) / mu_{v_t}(x_{t+1} | x_t), C)   (detached; C = tis_cap)

mu_{v_t} the log-prob the rollout recorded under version v_t, pi_prox the actor's policy at
the update's start; the PPO ratio then anchors on pi_prox, rho_t = pi_theta / pi_prox. A step
the current version took keeps w_t = 1 and the ratio against its recorded log-prob, so
staleness 0 is the plain loss. pi_prox is read off the update's own forward (detached): before
the update's only optimizer step (``actor.minibatches=1``, which the config requires here) the
policy's weights are the update's start weights, so it costs no extra forward.

Rollout correction (``algorithm.rollout_correction=is|rs``, default off), as verl's: every
trained step, not only the stale ones, is weighed against the log-prob mu the rollout recorded
(``Trajectory.log_probs``), with the PPO ratio anchored on pi_old (the update's start weights):

    is: w_t = min(pi_old / mu, C)          rs: w_t = 1[1/C <= pi_old / mu <= C]   (C = tis_cap)
    L_t = w_t * max(-A rho_t, -A clip(rho_t, 1 - eps, 1 + eps)),   rho_t = pi_theta / pi_old

pi_old comes from one of two places. ``rollout_correction_bypass=true`` (the default) reads it
off the update's own forward, detached, as the stale-step weights above do: exact under one
optimizer step per update (``actor.minibatches=1``, which the config then requires) and free.
``rollout_correction_bypass=false`` recomputes it, one no-grad forward per trained step under
the ``old`` adapter, which the weight plan copies from ``default`` after every update so that it
holds the update's start weights (valid with several minibatches). That forward is the
old-log-prob recompute verl runs before every update; its share of the update's time is logged
as ``perf/old_logp_frac`` (and ``perf/old_logp_s_per_sample``): what the bypass saves per step.
What verl does differently: its bypass sets pi_old := mu (so its weights turn trivial), where
diffrl's keeps pi_old exact, so the weights still measure the rollout-vs-train mismatch; its
weights may also be per sequence (a product over tokens) and its rejection bounds asymmetric,
where diffrl weighs each denoising step alone (a step is the token's analogue) within [1/C, C].
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from diffrl.algorithms.advantage import group_advantages
from diffrl.algorithms.modality import element_shares, modality_advantages, split_of
from diffrl.algorithms.registry import (
    Algorithm,
    AlgorithmConfig,
    Backward,
    Metrics,
    Policy,
    TrainCost,
    WeightPlan,
    add_part,
    per_forward,
    register_algorithm,
)
from diffrl.errors import ContractError, check, check_choice
from diffrl.models.family import broadcast
from diffrl.rollout.samplers import STOCHASTIC_STEPS, guided_velocity, modality_log_probs
from diffrl.types import MODALITIES, ScoredBatch, TrainBatch, host_to_device, train_batch

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self

# the rollout's path fields are Optional on a TrainBatch; FlowGRPO's validate makes the rollout
# keep them (needs_logprobs), so a batch without them is a bug upstream
ROLLOUT_CORRECTIONS = ("off", "is", "rs")  # algorithm.rollout_correction
NO_PATH = "a FlowGRPO batch carries the rollout's path (latents, log_probs, sde_mask, step_spec)"


@dataclass(frozen=True)
class GRPOConfig(AlgorithmConfig):
    name: str = "flow_grpo"
    clip_range: float = 1e-4  # epsilon of the clipped ratio (FlowGRPO uses a small one)
    adv_clip: float = 5.0  # advantages clipped to [-adv_clip, adv_clip]
    global_std: bool = False
    kl_coef: float = 0.04  # beta of the KL to the reference policy
    timestep_fraction: float = 0.6  # fraction of SDE steps trained per sample
    timestep_order: str = "shuffled"  # shuffled (per sample) | ordered (first steps first)
    # the KL reference's forwards (no grad, adapters disabled) batched across the trained steps:
    # about this many samples per forward, all computed before the policy's passes (the
    # reference does not change within an update). 0 = one reference forward per step beside
    # the policy's, as a diffusers training script does (the bench baseline)
    ref_rows: int = 32
    # the first-step gate: on this process's first update, before it changes any weight, the
    # rollout's and the policy's log-probs of the first trained step (the first micro-batch)
    # may differ by at most this much (log-probs are means over the latent's dimensions), and
    # the importance ratio by at most expm1 of it. 0 = the default for the policy's compute
    # dtype (FIRST_STEP_MAX_GAP); < 0 = off
    first_step_max_gap: float = 0.0
    # C of the truncated importance weights min(pi_prox / mu_v, C) of steps an older policy
    # version took (run.async_sync=step only; see the module docstring)
    tis_cap: float = 2.0
    # rollout correction against the rollout's recorded log-probs (module docstring):
    # off | is (truncated importance weights, capped at tis_cap) | rs (rejection outside
    # [1/tis_cap, tis_cap])
    rollout_correction: str = "off"
    # pi_old read off the update's own forward (no extra forward; needs actor.minibatches=1)
    # instead of recomputed by a no-grad forward under the ``old`` adapter
    rollout_correction_bypass: bool = True

    def validate(self) -> None:
        check(self.clip_range > 0, "clip_range", self.clip_range, "must be > 0")
        check(self.adv_clip > 0, "adv_clip", self.adv_clip, "must be > 0")
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        check(
            0 < self.timestep_fraction <= 1,
            "timestep_fraction",
            self.timestep_fraction,
            "must be in (0, 1]",
        )
        check_choice("timestep_order", self.timestep_order, ("shuffled", "ordered"))
        check(self.ref_rows >= 0, "ref_rows", self.ref_rows, "must be >= 0")
        check(
            math.isfinite(self.tis_cap) and self.tis_cap >= 1,
            "tis_cap",
            self.tis_cap,
            "must be a finite number >= 1 (the largest importance weight of a step an older "
            "policy version took; 1 = never up-weight)",
        )
        check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        check(
            not (self.modality_credit and self.uses_old_policy()),
            "modality_credit",
            self.modality_credit,
            f"is not supported with {self.name}'s pi_old (rollout correction, GRPO-Guard, "
            "Flow-DPPO): set algorithm.modality_credit=false or algorithm.rollout_correction=off",
        )

    def clips(self) -> bool:
        """Whether the loss clips its ratio at ``clip_range`` (logged as grpo/clip_frac)."""
        return True

    def uses_old_policy(self) -> bool:
        """Whether the loss anchors on pi_old, the update's start weights (module docstring)."""
        return self.rollout_correction != "off"

    def recomputes_old(self) -> bool:
        """Whether pi_old costs a no-grad forward under ``old`` (else: the update's own)."""
        return self.uses_old_policy() and not self.rollout_correction_bypass

    def one_step_reason(self) -> str | None:
        if self.uses_old_policy() and self.rollout_correction_bypass:
            return (
                "algorithm.rollout_correction_bypass reads pi_old off the update's own forward, "
                "which holds only before its first optimizer step; set actor.minibatches=1 or "
                "algorithm.rollout_correction_bypass=false"
            )
        return None

    def unbatched(self) -> Self:
        return replace(self, ref_rows=0)

    def whole_batch_keys(self) -> tuple[str, ...]:
        return ("global_std",) if self.global_std else ()


def prepare(scored: ScoredBatch, cfg: GRPOConfig) -> TrainBatch:
    traj = scored.traj
    if traj.latents is None or traj.sde_mask is None or not traj.sde_mask.any():
        raise ValueError(
            "flow_grpo needs stochastic trajectories with latents: set rollout.sampler=sde, "
            "rollout.noise_level > 0 and rollout.keep_latents=true"
        )
    keep = scored.valid.nonzero().squeeze(1)
    if cfg.modality_credit:  # A per modality (modality.py); ``advantages`` their mean, logged
        if traj.modality_log_probs is None:
            raise ValueError(
                "algorithm.modality_credit: flow_grpo needs the rollout's log-probs per "
                "modality, which the rollout of a video+audio family records at its SDE steps"
            )
        adv_m = modality_advantages(scored, cfg.global_std, cfg.modality_std)
        adv_m = adv_m.clamp(-cfg.adv_clip, cfg.adv_clip)
        return train_batch(scored, advantages=adv_m.mean(1), modality_advantages=adv_m).select(keep)
    adv = group_advantages(scored.rewards, traj.group, scored.valid, global_std=cfg.global_std)
    adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)
    return train_batch(scored, advantages=adv).select(keep)


def train_steps(sde_steps: Tensor, batch: int, cfg: GRPOConfig, gen: torch.Generator) -> Tensor:
    """(batch, k) indices of the SDE steps each sample trains on, drawn from ``sde_steps`` (the
    trajectory's stochastic steps, in order): a ``timestep_fraction`` of them."""
    n_sde = len(sde_steps)
    k = max(1, round(cfg.timestep_fraction * n_sde))
    if cfg.timestep_order == "ordered":
        return sde_steps[:k].expand(batch, k)
    # each sample's draw in step order: its loss is the same sum, and the rows that share an
    # input (see shared_rows) line up in the same pass, e.g. all of them when k = n_sde
    draws = [torch.randperm(n_sde, generator=gen)[:k].sort().values for _ in range(batch)]
    return sde_steps[torch.stack(draws)]


def clipped_objective(ratio: Tensor, adv: Tensor, clip_range: float) -> Tensor:
    """PPO's pessimistic surrogate, per sample: max(-A rho, -A clip(rho, 1-eps, 1+eps))."""
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))


def step_logprob(
    policy: Policy,
    batch: TrainBatch,
    j: Tensor,
    adapter: str | None = "default",
    rows: Tensor | None = None,
):
    """Log-prob of the stored x_{j+1} given x_j under ``adapter``, with the step kind, noise
    level and CFG scale the rollout recorded: (logp (b,), mean, std). ``j`` (b,) is each
    row's step; ``rows`` (b,), host indices into the batch, say which sample each row is
    (default: every sample once, in order)."""
    spec, x, sigmas = batch.step_spec, batch.latents, batch.sigmas
    assert spec is not None and x is not None and sigmas is not None, NO_PATH
    sig = host_to_device(sigmas, x.device, batch.x0.dtype)
    ids, cond = batch.input_ids, batch.cond  # (ids on the host for a diffusers net)
    if rows is None:
        at = torch.arange(len(j), device=x.device)
    else:
        at = host_to_device(rows, x.device)
        ids = ids[rows if ids.device.type == "cpu" else host_to_device(rows, ids.device)]
        cond = None if cond is None else cond[at]
    x_t, x_next = x[at, j], x[at, j + 1]
    sigma, sigma_next = sig[j], sig[j + 1]

    def velocity(x_, s_, ids_, cond_=None):
        return policy.velocity(x_, s_, ids_, adapter=adapter, cond=cond_)

    # the input alone decides (no group ids needed); rows with conditions are not merged, and
    # a rollout whose samples never share an input is not searched (torch.unique waits for
    # the GPU)
    may_share = cond is None and spec.shares_inputs
    shared = shared_rows(x_t, ids.to(x_t.device), j) if may_share else None
    if shared is None:
        v = guided_velocity(velocity, x_t, sigma, ids, spec.cfg_scale, spec.null_ids, cond)
    else:  # one forward per distinct input; the gradient sums back over the copies
        first, inverse = shared
        ids_first = ids[first.to(ids.device)]
        v = guided_velocity(
            velocity, x_t[first], sigma[first], ids_first, spec.cfg_scale, spec.null_ids
        )[inverse]
    _, logp, mean, std = STOCHASTIC_STEPS[spec.kind](
        x_t, v, sigma, sigma_next, spec.noise_level, float(sigmas[1]), x_next=x_next
    )
    return logp, mean, std


def shared_rows(x: Tensor, ids: Tensor, key: Tensor) -> tuple[Tensor, Tensor] | None:
    """Rows whose forward input is bitwise the same (``key``, e.g. the step, ``ids`` and ``x``):
    a group that shares its trajectory up to a step (DanceGRPO's shared initial noise, before
    or at its first SDE step, e.g. Flow-GRPO-Fast's branching step; a tree's inner nodes, see
    ``rollout.tree_noise``) needs one forward per distinct input, not one per member.
    -> (first, inverse): x[first][inverse] == x; None when every row is distinct."""
    n, flat = len(key), x.flatten(1)
    # rows are grouped by a random projection (torch.unique over whole rows is slow on CUDA),
    # then checked bitwise: after a collision nothing is merged; equal rows project equally
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(flat.shape[1] + ids.shape[1], generator=gen).to(flat)
    code = torch.stack(
        [key.to(flat), flat @ proj[: flat.shape[1]], ids.to(flat) @ proj[-ids.shape[1] :]], 1
    )
    uniq, inverse = torch.unique(code, dim=0, return_inverse=True)
    if len(uniq) == n:
        return None
    index = torch.arange(n, device=key.device)
    first = torch.full((len(uniq),), n, device=key.device).scatter_reduce(0, inverse, index, "amin")
    same = all(torch.equal(t[first][inverse], t) for t in (x, ids, key))
    return (first, inverse) if same else None


def truncated_is(
    logp: Tensor,
    rollout_logp: Tensor,
    behind: Tensor,
    cap: float,
    mode: str = "is",
    base: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per row of one trained step: (anchor, w). Where ``behind`` (an older version took the
    step, or rollout correction weighs every step), the anchor is pi_prox's log-prob, ``logp``
    detached (the policy at the update's start), and w = min(pi_prox / mu, cap) against the
    rollout's ``rollout_logp`` mu (``mode="is"``), or w = 1[1/cap <= pi_prox / mu <= cap]
    (``mode="rs"``); elsewhere the anchor is ``base`` (default mu) and w = 1 exactly."""
    prox = logp.detach()
    anchor = torch.where(behind, prox, rollout_logp if base is None else base)
    r = torch.exp(prox - rollout_logp)
    if mode == "rs":
        kept = (r >= 1 / cap) & (r <= cap)
        w = torch.where(behind & ~kept, torch.zeros_like(prox), torch.ones_like(prox))
    else:
        w = torch.where(behind, r.clamp(max=cap), torch.ones_like(prox))
    return anchor, w


@dataclass(frozen=True)
class OldStep:
    """pi_old at one trained step, per row (detached): its log-prob and its step mean."""

    logp: Tensor  # (n,)
    mean: Tensor  # (n, *S)


def old_step(
    policy: Policy, batch: TrainBatch, j: Tensor, logp: Tensor, mean: Tensor, cfg: GRPOConfig
) -> tuple[OldStep, float]:
    """pi_old at trained steps ``j`` (n,), given the update's own forward (``logp``, ``mean``):
    read off it (bypass), or recomputed by a no-grad forward under ``old`` (which the weight
    plan keeps at the update's start weights). -> (pi_old, seconds the recompute took)."""
    if not cfg.recomputes_old():
        return OldStep(logp.detach(), mean.detach()), 0.0
    on_gpu = mean.device.type == "cuda"
    if on_gpu:  # time the recompute alone, not the queued work before it
        torch.cuda.synchronize(mean.device)
    start = time.perf_counter()
    with torch.no_grad():
        logp_old, mean_old, _ = step_logprob(policy, batch, j, adapter="old")
    if on_gpu:
        torch.cuda.synchronize(mean.device)
    return OldStep(logp_old, mean_old), time.perf_counter() - start


@dataclass(frozen=True)
class StepTerms:
    """What a per-step surrogate sees of one trained step, per row (``n`` samples)."""

    logp: Tensor  # (n,) pi_theta's log-prob, with grad
    anchor: Tensor  # (n,) the log-prob the ratio is taken against (detached)
    w: Tensor | None  # (n,) importance / rejection weights (detached); None = all 1
    adv: Tensor  # (n,)
    mean: Tensor  # (n, *S) pi_theta's step mean, with grad
    old: OldStep | None  # pi_old, for losses that read its mean (GRPO-Guard, Flow-DPPO)
    std: Tensor  # (n,) or () the step's Gaussian std
    sigma: Tensor  # (n,) sigma at the step
    sigma_next: Tensor  # (n,)


# a per-step surrogate other than FlowGRPO's clipped one: (terms, cfg, metrics, 1 / k) ->
# ((n,) per-row loss, (n,) the ratio to log the clip fraction of)
StepObjective = Callable[[StepTerms, "GRPOConfig", Metrics, float], tuple[Tensor, Tensor]]


def modality_objective(
    batch: TrainBatch,
    j: Tensor,
    mean: Tensor,
    std: Tensor,
    behind: Tensor | None,
    cfg: GRPOConfig,
    m: Metrics,
    k: int,
) -> Tensor:
    """algorithm.modality_credit: (n,) the clipped objective of one trained step with a ratio
    per modality, rho_m = exp(logp_m - logp_m(rollout)) from the step's Gaussian split by
    modality, each clipped on its own against its own advantage A_m, weighed by the modality's
    share of the elements D_m / D (``modality.py``). ``behind`` (n,) bool: rows whose step an
    older version took, weighed by their own truncated importance weight per modality."""
    split = split_of(batch, "flow_grpo")
    x, rollout_m, adv_m = batch.latents, batch.modality_log_probs, batch.modality_advantages
    assert x is not None and rollout_m is not None and adv_m is not None, NO_PATH
    at = torch.arange(len(j), device=j.device)
    logp_m = modality_log_probs(x[at, j + 1], mean, std, split)  # (n, 2)
    mu_m = rollout_m.to(logp_m)[at, j]  # (n, 2)
    share = torch.tensor(split, dtype=logp_m.dtype, device=logp_m.device) / sum(split)
    if behind is None:
        ratio = torch.exp(logp_m - mu_m)
        w = torch.ones_like(ratio)
    else:
        anchor, w = truncated_is(logp_m, mu_m, behind[:, None].expand_as(logp_m), cfg.tis_cap)
        ratio = torch.exp(logp_m - anchor)
    objective = w * clipped_objective(ratio, adv_m.to(ratio), cfg.clip_range)  # (n, 2)
    clipped = ((ratio.detach() - 1).abs() > cfg.clip_range).float().mean(0)
    for i, name in enumerate(MODALITIES):
        key = f"grpo/clip_frac_{name}"
        m[key] = m.get(key, 0.0) + clipped[i] / k
    return (objective * share).sum(1)


def loss(
    policy: Policy,
    batch: TrainBatch,
    cfg: GRPOConfig,
    gen: torch.Generator,
    backward: Backward | None = None,
    objective: StepObjective | None = None,
) -> tuple[Tensor, Metrics]:
    """FlowGRPO's loss over a micro-batch; ``objective`` swaps the per-step clipped surrogate
    for another one on the same steps, weights and KL (GRPO-Guard, Flow-DPPO)."""
    mask, rollout_logp, adv = batch.sde_mask, batch.log_probs, batch.advantages
    sigmas = batch.sigmas
    assert mask is not None and rollout_logp is not None and adv is not None, NO_PATH
    assert sigmas is not None, NO_PATH
    started = time.perf_counter()
    n, sde_steps = len(batch), mask.nonzero().squeeze(1)
    steps = host_to_device(train_steps(sde_steps, n, cfg, gen), batch.x0.device)  # (n, k)
    total = batch.x0.new_zeros(())
    m: Metrics = {"grpo/ratio_dev": 0.0, "grpo/kl": 0.0}
    if cfg.clips():
        m["grpo/clip_frac"] = 0.0
    # |log ratio| per trained (sample, step): the rollout-vs-train gap before the step's
    # optimizer step (actor.minibatches = 1), logged, never used in the loss
    m["check/logp_gap_mean"], gap_max = 0.0, rollout_logp.new_zeros((), device=batch.x0.device)
    refs = None
    if cfg.kl_coef > 0 and cfg.ref_rows > 0:
        refs = reference_means(policy, batch, steps, cfg.ref_rows)
    versions, prox = batch.step_versions, batch.prox_version
    tis = prox is not None
    corrected = cfg.rollout_correction != "off"  # every step weighed against its mu
    if tis or corrected:
        assert not tis or versions is not None, "a batch with prox_version carries step_versions"
        m["grpo/tis_weight_mean"], m["grpo/tis_stale_frac"] = 0.0, 0.0
        w_max = rollout_logp.new_zeros((), device=batch.x0.device)
    recompute_s = 0.0
    k = steps.shape[1]
    for c in range(k):
        j = steps[:, c]
        at = torch.arange(n, device=j.device)
        mu = rollout_logp[at, j]
        logp, mean, std = step_logprob(policy, batch, j)
        log_ratio = logp - mu
        ratio = torch.exp(log_ratio)
        gap = log_ratio.detach().abs()
        m["check/logp_gap_mean"] += gap.mean() / steps.shape[1]
        gap_max = torch.maximum(gap_max, gap.max().to(gap_max))
        old, w = None, None
        if cfg.uses_old_policy():
            old, seconds = old_step(policy, batch, j, logp, mean, cfg)
            recompute_s += seconds
        if tis or corrected:  # each step weighed by its own truncated importance weight
            if corrected:
                behind = torch.ones_like(mu, dtype=torch.bool)
            else:
                assert versions is not None and prox is not None
                behind = versions.to(j.device)[at, j] < prox
            mode = cfg.rollout_correction if corrected else "is"
            prox_logp = logp if old is None else old.logp
            base = None if old is None else old.logp
            anchor, w = truncated_is(prox_logp, mu, behind, cfg.tis_cap, mode, base)
            ratio = torch.exp(logp - anchor)
            m["grpo/tis_weight_mean"] += w.mean() / steps.shape[1]
            m["grpo/tis_stale_frac"] += behind.float().mean() / steps.shape[1]
            w_max = torch.maximum(w_max, w.max().to(w_max))
        elif old is not None:
            anchor = old.logp
            ratio = torch.exp(logp - anchor)
        else:
            anchor = mu
        if objective is not None:
            sig = host_to_device(sigmas, j.device, batch.x0.dtype)
            terms = StepTerms(logp, anchor, w, adv, mean, old, std, sig[j], sig[j + 1])
            per_row, ratio = objective(terms, cfg, m, 1 / steps.shape[1])
            step_loss = per_row.mean()
        elif cfg.modality_credit:
            behind_m = behind if tis else None
            step_loss = modality_objective(batch, j, mean, std, behind_m, cfg, m, k).mean()
        elif w is not None:
            step_loss = (w * clipped_objective(ratio, adv, cfg.clip_range)).mean()
        else:
            step_loss = clipped_objective(ratio, adv, cfg.clip_range).mean()
        if cfg.kl_coef > 0:
            if refs is not None:
                mean_ref = refs[c]
            else:
                with torch.no_grad():
                    _, mean_ref, _ = step_logprob(policy, batch, j, adapter=None)
            std_b = broadcast(std, mean)
            kl_elements = ((mean - mean_ref) ** 2 / (2 * std_b**2)).flatten(1)
            kl = kl_elements.mean(1).mean()
            step_loss = step_loss + cfg.kl_coef * kl
            m["grpo/kl"] += kl.detach() / steps.shape[1]
            if cfg.modality_credit:  # the KL is a sum over elements: each modality's share
                shares = element_shares(kl_elements.detach(), split_of(batch, "flow_grpo"))
                for i, name in enumerate(MODALITIES):
                    key = f"grpo/kl_{name}"
                    m[key] = m.get(key, 0.0) + shares[:, i].mean() / steps.shape[1]
        total = add_part(total, step_loss / steps.shape[1], backward)
        r = ratio.detach()
        if cfg.clips():
            clipped = ((r - 1).abs() > cfg.clip_range).float().mean()
            m["grpo/clip_frac"] += clipped / steps.shape[1]
        m["grpo/ratio_dev"] += (r - 1).abs().mean() / steps.shape[1]
    m["check/logp_gap_max"] = gap_max  # the actor keeps the largest over the step
    if tis or corrected:
        m["grpo/tis_weight_max"] = w_max
    if cfg.recomputes_old():  # what the bypass saves: the recompute's share of the update
        m["perf/old_logp_frac"] = recompute_s / max(time.perf_counter() - started, 1e-9)
        m["perf/old_logp_s_per_sample"] = recompute_s / max(n, 1)
    return total, m


@torch.no_grad()
def reference_means(policy: Policy, batch: TrainBatch, steps: Tensor, max_rows: int) -> list:
    """The KL reference's step means (adapters disabled) for every (sample, trained step) of
    ``steps`` (n, k), batched across steps: about ``max_rows`` samples per no-grad forward
    (x2 with CFG) instead of one forward of n per step. The reference never changes during
    an update, so this is the same quantity the per-step forward computes; -> k tensors
    (n, *S), one per column of ``steps``."""
    n, k = steps.shape
    per = per_forward(k, n, max_rows)
    out: list[Tensor] = []
    for c0 in range(0, k, per):
        cols = min(per, k - c0)
        rows = torch.arange(n).repeat(cols)  # step-major: column c0's samples, then c0 + 1's
        j = steps[:, c0 : c0 + cols].t().reshape(-1)
        _, mean, _ = step_logprob(policy, batch, j, adapter=None, rows=rows)
        out.extend(mean.split(n))
    return out


@torch.no_grad()
def consistency(policy: Policy, batch: TrainBatch, cfg: GRPOConfig) -> dict[str, float]:
    """Before any update (same weights as the rollout): recompute the log-prob of the first
    trained SDE step and compare with the rollout's. ~0 in fp32; a large value means rollout
    and training disagree (sampler settings, weights not synced, non-determinism)."""
    mask, rollout_logp = batch.sde_mask, batch.log_probs
    assert mask is not None and rollout_logp is not None, NO_PATH
    j0 = int(mask.nonzero()[0])
    logp, _, _ = step_logprob(policy, batch, torch.full((len(batch),), j0, device=batch.x0.device))
    log_ratio = logp - rollout_logp[:, j0].to(logp)
    diff = log_ratio.abs()
    return {
        "grpo/logp_diff_max": float(diff.max()),
        "grpo/logp_diff_mean": float(diff.mean()),
        "grpo/ratio_dev_first": float(torch.expm1(log_ratio).abs().max()),
    }


class FirstStepGap(ContractError):
    """On the first step, before any update, training does not reproduce the rollout's
    log-probs: the importance ratio is not 1."""


# The first-step gate's default threshold per compute dtype. Measured on the CPU, first SDE
# steps of every tiny preset and of sd3-shapes (docs/contracts.md): fp32 reproduces the
# rollout's log-probs to 0, or to 6e-8 when rollout and training batch differently; bf16 to at
# most 6e-3. The defaults leave ~1000x and ~8x of room; real-size models on a GPU were not
# measured (algorithm.first_step_max_gap sets the threshold)
FIRST_STEP_MAX_GAP = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def first_step_gate(diag: dict[str, float], cfg: GRPOConfig, dtype: torch.dtype) -> None:
    """Raise FirstStepGap unless the first step's rollout-vs-train log-prob gap is under the
    threshold and the ratio is 1 within expm1 of it (a NaN fails)."""
    limit = cfg.first_step_max_gap or FIRST_STEP_MAX_GAP.get(
        dtype, FIRST_STEP_MAX_GAP[torch.float32]
    )
    if limit < 0:
        return
    gap, ratio_dev = diag["grpo/logp_diff_max"], diag["grpo/ratio_dev_first"]
    ratio_tol = math.expm1(limit)
    if not (gap <= limit and ratio_dev <= ratio_tol):
        raise FirstStepGap(
            f"first FlowGRPO step, before any update: the policy's log-prob of the rollout's "
            f"first SDE step differs from the rollout's by {gap:.3g} (max over the first "
            f"micro-batch; mean {diag['grpo/logp_diff_mean']:.3g}), threshold {limit:.3g} "
            f"for {str(dtype).removeprefix('torch.')}; importance ratio off 1 by "
            f"{ratio_dev:.3g} (tolerance {ratio_tol:.3g}). Rollout and training disagree: "
            "the rollout samples with other weights (a sync not applied), other sampler "
            "settings, or non-deterministic kernels. algorithm.first_step_max_gap sets the "
            "threshold (< 0: off)"
        )


def train_cost(cfg: GRPOConfig, batch: TrainBatch) -> TrainCost:
    """Per trained SDE step (a ``timestep_fraction`` of the trajectory's, as ``train_steps``
    draws): the policy's forward and backward, and the KL reference's forward when there is
    one; x2 when the rollout ran CFG, whose two branches the loss runs too."""
    mask, spec = batch.sde_mask, batch.step_spec
    assert mask is not None and spec is not None, NO_PATH
    trained = max(1, round(cfg.timestep_fraction * int(mask.sum())))
    rows = 1 if spec.cfg_scale == 1 else 2
    kl = 1 if cfg.kl_coef > 0 else 0
    old = 1 if cfg.recomputes_old() else 0  # pi_old's no-grad forward under ``old``
    return TrainCost(forwards=trained * (1 + kl + old) * rows, backwards=trained * rows)


def weight_plan(step: int, cfg: GRPOConfig) -> WeightPlan:
    """On-policy: sample with the current policy, sync every update. When pi_old is
    recomputed, ``old`` becomes a copy of the updated weights, i.e. the next update's start."""
    return WeightPlan("default", refresh_old=0.0 if cfg.recomputes_old() else None)


def register_flow_grpo(name: str, config_cls: type, objective=None) -> Algorithm:
    """FlowGRPO under ``name``, or a variant of it that changes only the per-step
    ``objective`` (GRPO-Guard, Flow-DPPO): its prepare, weight plan, costs, diagnostics and
    first-step gate, and its loss with that objective."""

    def variant_loss(
        policy: Policy,
        batch: TrainBatch,
        cfg: GRPOConfig,
        gen: torch.Generator,
        backward: Backward | None = None,
    ) -> tuple[Tensor, Metrics]:
        return loss(policy, batch, cfg, gen, backward, objective=objective)

    return register_algorithm(
        Algorithm(
            name=name,
            config_cls=config_cls,
            prepare=prepare,
            loss=loss if objective is None else variant_loss,
            weight_plan=weight_plan,
            train_cost=train_cost,
            needs_logprobs=True,
            diagnostics=consistency,
            first_step_gate=first_step_gate,
            partial_backward=True,
        )
    )


ALGORITHM = register_flow_grpo("flow_grpo", GRPOConfig)
