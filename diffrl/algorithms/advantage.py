"""Group-relative advantages (GRPO, Shao et al. 2024; FlowGRPO, Liu et al. 2025).

A_i = (R_i - mean_g(R)) / (std + eps), the mean over the valid samples of sample i's group
(its prompt); std is the group's (default) or the whole batch's (``global_std``). Invalid
samples (a scorer failed) get A = 0 and are dropped by ``prepare``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor, group: Tensor, valid: Tensor, *, global_std: bool = False, eps: float = 1e-4
) -> Tensor:
    """rewards (B,), group (B,) int64, valid (B,) bool -> advantages (B,)."""
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).double()
    w = valid.double()
    n_groups = int(group.max()) + 1 if len(group) else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, w)
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, r * w) / count.clamp(
        min=1
    )
    centered = (r - mean[group]) * w
    if global_std:
        std = centered[valid].std(unbiased=False) if valid.sum() > 1 else torch.tensor(0.0)
        std = std.expand_as(r)
    else:
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, centered**2)
        std = (var / count.clamp(min=1)).sqrt()[group]
    return (centered / (std + eps)).float()


def group_ranges(rewards: Tensor, group: Tensor, valid: Tensor) -> Tensor:
    """(n_groups,) max - min of each group's valid rewards; NaN for a group with none."""
    n = int(group.max()) + 1 if len(group) else 0
    r = rewards.double()
    lo_fill, hi_fill = torch.full_like(r, torch.inf), torch.full_like(r, -torch.inf)
    hi = torch.full((n,), -torch.inf, dtype=r.dtype)
    hi = hi.scatter_reduce(0, group, torch.where(valid, r, hi_fill), "amax")
    lo = torch.full((n,), torch.inf, dtype=r.dtype)
    lo = lo.scatter_reduce(0, group, torch.where(valid, r, lo_fill), "amin")
    return torch.where(torch.isfinite(hi), hi - lo, torch.nan)


def tied_fraction(rewards: Tensor, group: Tensor, valid: Tensor) -> float:
    """The share of groups (with a valid sample) whose valid rewards all tie: their
    advantages are zero, so their rollouts teach the policy nothing."""
    span = group_ranges(rewards, group, valid)
    span = span[~span.isnan()]
    return float((span <= 1e-6).double().mean()) if len(span) else float("nan")
