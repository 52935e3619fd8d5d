"""How the pool combines its scorers' scores into one reward (``reward.aggregate``).

- ``sum`` (default): R_i = sum_k w_k s_k,i, the weighted sum.
- ``gdpo``: GDPO's group reward-decoupled normalisation (Liu et al. 2026, "GDPO: Group
  reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization",
  arXiv:2601.05242). Each reward is normalised within its group before they are combined,

      A_k,i = (s_k,i - mean_{j in g(i)} s_k,j) / (std_{j in g(i)} s_k,j + eps)
      R_i   = sum_k w_k A_k,i

  so a reward with a wide spread cannot drown one with a narrow spread, and distinct
  combinations of rewards keep distinct values (under ``sum`` then one GRPO normalisation, two
  rewards' (1, 0) and (0, 1) collapse to the same advantage). The paper then normalises R over
  the whole batch, (R - mean_B R) / (std_B R + eps); in diffrl that is the algorithm's batch-std
  option (``algorithm.global_std=true``, see recipes/shapes_grpo_pref.yaml), since the pool
  sees one micro-batch at a time.

What the reference (NVlabs/GDPO, its TRL trainer) does that diffrl does differently: it counts
a failed reward as 0 (``nan_to_num``) in the group's statistics; here the statistics run over
the group's valid samples only (a failed sample is missing, never 0), and a group with fewer
than two valid samples gets A = 0 (its std is undefined). std is the unbiased one and eps
1e-4, as the reference's; its batch step divides by the unbiased std where diffrl's
``global_std`` takes the population std, a constant factor sqrt((N-1)/N) on every advantage.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATES = ("sum", "gdpo")
GDPO_EPS = 1e-4  # the reference's


def gdpo_combine(
    scores: Tensor, weights: Tensor, group: Tensor, valid: Tensor, eps: float = GDPO_EPS
) -> Tensor:
    """scores (B, K) per scorer (anything where invalid), weights (K,), group (B,) int64,
    valid (B,) bool -> (B,) float64 sum_k w_k A_k (0 where invalid)."""
    s = torch.where(valid[:, None], scores.double(), torch.zeros((), dtype=torch.float64))
    w = valid.double()[:, None]  # (B, 1)
    _, g = torch.unique(group, return_inverse=True)  # dense ids: any group numbering
    n = int(g.max()) + 1 if len(g) else 0
    zeros = torch.zeros(n, s.shape[1], dtype=torch.float64)
    count = zeros[:, :1].index_add(0, g, w)  # (G, 1) valid samples per group
    mean = zeros.index_add(0, g, s * w) / count.clamp(min=1)  # (G, K)
    centered = (s - mean[g]) * w
    var = zeros.index_add(0, g, centered**2) / (count - 1).clamp(min=1)  # unbiased
    normed = centered / (var.sqrt()[g] + eps)
    normed = torch.where(count[g] > 1, normed, torch.zeros_like(normed))
    return (normed * weights.double()).sum(dim=1) * valid.double()
