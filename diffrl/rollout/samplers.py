"""Sampler steps as pure functions over tensors, in diffrl's convention
(sigma=1 noise -> sigma=0 data, x_sigma = (1-sigma) x0 + sigma eps, v = eps - x0).

A step moves x from ``sigma`` to ``sigma_next < sigma`` (so d_sigma = sigma_next - sigma < 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from diffrl.types import host_to_device


def noise_from_seeds(seeds: Tensor, shape: tuple[int, ...], device) -> Tensor:
    """(B, *shape) standard normal; row i depends only on seeds[i] (batching-invariant)."""
    rows = [torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(rows).to(device)


def sigma_schedule(num_steps: int, shift: float = 1.0, device=None) -> Tensor:
    """(T+1,) sigmas from 1 to 0; ``shift`` > 1 spends more steps at high noise (SD3's
    time shift sigma' = shift*sigma / (1 + (shift-1)*sigma))."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, device=device)
    return shift * s / (1 + (shift - 1) * s)


def _bcast(t: Tensor, like: Tensor) -> Tensor:
    """(B,) or scalar -> broadcastable against (B, C, H, W)."""
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.view(-1, *([1] * (like.ndim - 1))) if t.ndim == 1 else t


def euler_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """Deterministic probability-flow ODE step: x' = x + v * (sigma_next - sigma)."""
    return x + v * _bcast(sigma_next - sigma, x)


def sde_std(sigma: Tensor, noise_level: float, sigma_cap: float | Tensor) -> Tensor:
    """FlowGRPO's diffusion scale s = a * sqrt(sigma / (1 - sigma)); at sigma=1 (where it is
    infinite) sigma is replaced by ``sigma_cap`` (the schedule's second sigma; per row, (B,),
    when rows follow schedules of their own)."""
    sigma = torch.as_tensor(sigma)
    safe = torch.where(sigma >= 1.0, torch.as_tensor(sigma_cap, dtype=sigma.dtype), sigma)
    return noise_level * torch.sqrt(safe / (1 - safe))


def sde_mean(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, s: Tensor) -> Tensor:
    """mu = x + [v + s^2 / (2 sigma) * (x + (1 - sigma) v)] * d_sigma (FlowGRPO, eq. 9)."""
    sig, ds, s = _bcast(sigma, x), _bcast(sigma_next - sigma, x), _bcast(s, x)
    return x + (v + s.pow(2) / (2 * sig) * (x + (1 - sig) * v)) * ds


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Per-sample log N(x; mean, std^2), averaged (not summed) over all non-batch dims, so the
    number is comparable across image sizes. Rollout and training both use this: (B,)."""
    std = _bcast(std, x)
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(dim=1)


def modality_log_probs(x: Tensor, mean: Tensor, std: Tensor, split: tuple[int, int]) -> Tensor:
    """(B, 2): ``gaussian_log_prob`` split by modality over a flat (B, D) x whose first
    ``split[0]`` elements are the video's and the rest the audio's, each the mean over its own
    elements (so a per-modality ratio keeps the joint one's scale, and the clip range its
    meaning). The Gaussian's log-density is a sum over elements, so the element-weighted sum
    (n_v lp_v + n_a lp_a) / D is the joint log-prob."""
    std = _bcast(std, x)
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    video, audio = lp.flatten(1).split(split, dim=1)
    return torch.stack([video.mean(1), audio.mean(1)], 1)


def sde_step_with_logprob(
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    noise_level: float,
    sigma_cap: float | Tensor,
    noise: Tensor | None = None,
    x_next: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One FlowGRPO SDE step: x' = mu + s * sqrt(-d_sigma) * eps.

    Give ``noise`` to sample x', or ``x_next`` to score a stored x' (training).
    Returns (x_next, log_prob (B,), mean, std (B,) or scalar)."""
    s = sde_std(sigma, noise_level, sigma_cap).to(x)
    mean = sde_mean(x, v, sigma, sigma_next, s)
    std = s * torch.sqrt((sigma - sigma_next).to(x))
    if x_next is None:
        if noise is None:
            raise ValueError("sde_step_with_logprob needs noise (to sample) or x_next (to score)")
        x_next = mean + _bcast(std, x) * noise
    return x_next, gaussian_log_prob(x_next, mean, std), mean, std


def cps_step_with_logprob(
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    noise_level: float,
    sigma_cap: float | Tensor = 0.0,
    noise: Tensor | None = None,
    x_next: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Coefficients-preserving sampling (Wang et al., 2025, "Coefficients-Preserving Sampling
    for Reinforcement Learning with Flow Matching"): with the model's own estimates
    x0_hat = x - sigma v and eps_hat = x + (1 - sigma) v, and eta = ``noise_level`` in [0, 1],

        x' = (1 - sigma') x0_hat + sigma' [cos(eta pi/2) eps_hat + sin(eta pi/2) eps]

    so x' keeps the coefficients (1 - sigma', sigma') of the forward process exactly (the total
    noise variance stays sigma'^2) instead of adding excess noise. Mean (1 - sigma') x0_hat +
    sigma' cos(eta pi/2) eps_hat, std sigma' sin(eta pi/2); eta = 0 is the Euler step.
    ``sigma_cap`` is unused (no singularity at sigma=1); same signature as the FlowGRPO step."""
    sig, sig_n = _bcast(sigma, x), _bcast(sigma_next, x)
    x0_hat, eps_hat = x - sig * v, x + (1 - sig) * v
    angle = 0.5 * math.pi * noise_level
    mean = (1 - sig_n) * x0_hat + sig_n * math.cos(angle) * eps_hat
    std = torch.as_tensor(sigma_next).to(x) * math.sin(angle)
    if x_next is None:
        if noise is None:
            raise ValueError("cps_step_with_logprob needs noise (to sample) or x_next (to score)")
        x_next = mean + _bcast(std, x) * noise
    return x_next, gaussian_log_prob(x_next, mean, std), mean, std


# The stochastic steps a rollout may use; each returns (x_next, log_prob, mean, std).
STOCHASTIC_STEPS = {"flow_grpo": sde_step_with_logprob, "cps": cps_step_with_logprob}


def sde_window(
    num_steps: int,
    size: int,
    mode: str,
    start: int,
    every: int,
    iteration: int,
    seed: int,
    end: int = -1,
) -> Tensor:
    """(T,) bool: which of the T sampler steps are stochastic (the rest are Euler/ODE).

    The last step (to sigma=0) is always deterministic, so at most T-1 steps are SDE. ``size``
    0 means every one of them (plain FlowGRPO). Otherwise a window of ``size`` consecutive
    steps (Flow-GRPO-Fast / MixGRPO): ``fixed`` at ``start``; ``random``, its start drawn per
    iteration from ``seed``, uniformly in [start, end]; ``sliding``, starting at ``start`` and
    moving one step later every ``every`` iterations, back to ``start`` after ``end``. ``end``
    -1 is the last start that fits."""
    n_sde = max(num_steps - 1, 0)
    mask = torch.zeros(num_steps, dtype=torch.bool)
    if size == 0 or size >= n_sde:
        mask[:n_sde] = True
        return mask
    last = n_sde - size  # the last possible window start
    end = last if end < 0 or mode == "fixed" else end
    if not start <= end <= last:
        raise ValueError(
            f"a window of {size} steps of {num_steps} cannot start at step {max(start, end)}: "
            f"its start must lie in [0, {last}] (and sde_window_start <= sde_window_end)"
        )
    if mode == "fixed":
        lo = start
    elif mode == "random":
        gen = torch.Generator().manual_seed(seed)
        lo = start + int(torch.randint(end - start + 1, (1,), generator=gen))
    elif mode == "sliding":
        lo = start + (iteration // every) % (end - start + 1)
    else:
        raise ValueError(f"unknown SDE window mode {mode!r}; expected fixed, random or sliding")
    mask[lo : lo + size] = True
    return mask


def tree_noise_blocks(mask: Tensor, group_size: int) -> list[int]:
    """Tree-structured rollouts (BranchGRPO-style branching): for each SDE step of ``mask``, in
    order, how many consecutive members of a group share that step's noise. The group splits
    in two at each SDE step but the last (blocks of g/2, g/4, ...), and at the last every
    member draws its own noise, so a group that starts from one shared noise becomes a binary
    tree whose 2, 4, ... inner nodes end in g leaves."""
    k = int(mask.sum())
    if k and group_size % 2 ** (k - 1):
        raise ValueError(
            f"a tree over {k} SDE steps needs a group_size divisible by 2^{k - 1} = "
            f"{2 ** (k - 1)}, got {group_size}"
        )
    return [group_size >> (p + 1) for p in range(k - 1)] + [1] * min(k, 1)


_NULL_ROWS: dict[tuple, Tensor] = {}  # (null ids, dtype, device) -> the row, made once


def null_row(null_ids: Sequence[int] | Tensor, like: Tensor) -> Tensor:
    """The empty prompt's ids (L,) in ``like``'s dtype and device; from a tuple, made once per
    dtype and device (not copied to the GPU at every guided step)."""
    if isinstance(null_ids, Tensor):
        return null_ids.to(like.device, like.dtype)
    key = (tuple(int(i) for i in null_ids), like.dtype, like.device)
    row = _NULL_ROWS.get(key)
    if row is None:
        if len(_NULL_ROWS) > 64:
            _NULL_ROWS.clear()
        row = _NULL_ROWS[key] = host_to_device(torch.tensor(key[0], dtype=like.dtype), like.device)
    return row


def guided_velocity(
    velocity: Callable[..., Tensor],
    x: Tensor,
    sigma: Tensor,
    ids: Tensor,
    scale: float,
    null_ids: Sequence[int] | Tensor,
    cond: Tensor | None = None,
) -> Tensor:
    """Classifier-free guidance v_u + scale (v_c - v_u), the unconditional branch on the empty
    prompt's ids ``null_ids`` (L,), both branches in one batched call; scale 1 = one call.
    ``cond`` (per-row conditions beyond the text, e.g. FL2VA keyframes) goes to both branches:
    guidance is on the text."""

    def call(x_, s_, ids_, c_):
        return velocity(x_, s_, ids_) if c_ is None else velocity(x_, s_, ids_, c_)

    if scale == 1.0:
        return call(x, sigma, ids, cond)
    null = null_row(null_ids, ids)
    if null.shape != ids.shape[1:]:
        raise ValueError(f"null prompt ids {tuple(null.shape)} do not fit ids {tuple(ids.shape)}")
    null = null.expand_as(ids)
    both = None if cond is None else torch.cat([cond, cond])
    v_c, v_u = call(
        torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([ids, null]), both
    ).chunk(2)
    return v_u + scale * (v_c - v_u)


def coarse_tail(sigmas: Tensor, mask: Tensor, tail_steps: int, shift: float = 1.0):
    """(sigmas, mask) with the ODE steps after the last SDE step re-gridded to ``tail_steps``
    Euler steps down to sigma=0 (MixGRPO-Flash's cheap ODE tail: those steps carry no log-prob
    and are never trained, so the rollout only needs their end point for the reward). Returned
    unchanged when there is no SDE step, ``tail_steps`` is 0, or the tail is already that short.
    The tail is spaced as ``sigma_schedule(tail_steps, shift)``, scaled to start at the sigma the
    window ends on (uniform in sigma for shift 1)."""
    if tail_steps <= 0 or not mask.any():
        return sigmas, mask
    end = int(mask.nonzero().max()) + 1  # sigmas[end]: where the last SDE step lands
    if len(mask) - end <= tail_steps:
        return sigmas, mask
    tail = sigmas[end] * sigma_schedule(tail_steps, shift, sigmas.device)[1:]
    return torch.cat([sigmas[: end + 1], tail]), torch.cat(
        [mask[:end], torch.zeros(tail_steps, dtype=torch.bool)]
    )
