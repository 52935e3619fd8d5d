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
