"""GRPO-Guard: FlowGRPO with a normalised importance ratio and per-step gradient reweighting
(Wang et al., 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
Regulated Clipping", arXiv:2510.22319).

The paper's diagnosis: with x_{t+1} = mu_old + std * eps, FlowGRPO's log ratio is

    log rho_t = logp_theta - logp_old = eps . (mu_theta - mu_old) / std - b_t,
    b_t = ||mu_theta - mu_old||^2_mean / (2 std^2)

(means over the latent's dimensions, as diffrl's log-probs are), so the ratio is biased below
1 by b_t and its spread scales with 1 / std, which differs from step to step: the clip
(1 - eps, 1 + eps) rarely catches a positive-advantage sample and constrains each step
differently. RatioNorm removes the bias and the 1 / std scale, and the loss of each step is
reweighed by 1 / (-d sigma) so the steps' gradients are of one size:

    rho~_t = exp((logp_theta - logp_old + b_t) * std)
    L_t = 1 / (sigma_t - sigma_{t+1}) * max(-A rho~_t, -A clip(rho~_t, 1 - eps, 1 + eps))

(std = s * sqrt(-d sigma), the SDE step's Gaussian std; the formula as verl-omni's
``GRPOGuardLoss`` writes the paper's). Everything else is FlowGRPO's: the rollout, group
advantages, the steps trained, the KL to the reference, rollout correction's weights.

Why a registered algorithm that reuses FlowGRPO's loss loop rather than a FlowGRPO option: the
paper presents a different surrogate (its own ratio and step weights) on an unchanged rollout,
advantage and KL, and compares it against FlowGRPO as a method; a name selects it in a recipe
and in the benchmark table, while ``flow_grpo.loss`` takes its per-step objective so nothing of
FlowGRPO's loop is copied.

What diffrl does differently from the paper's reference: pi_old (logp_old, mu_old) is the
update's start weights, read off the update's own forward (``rollout_correction_bypass=true``,
one optimizer step per update: there b_t = 0 and rho~ = 1, so the guard acts as the step
reweighting and the ratio's gradient scale std) or recomputed under the ``old`` adapter
(``rollout_correction_bypass=false``, several minibatches: b_t and the normalised clip act as
the paper's multi-minibatch updates); the KL is diffrl's (the step means', FlowGRPO's);
std follows whichever SDE step the rollout recorded (the paper derives it for Flow-GRPO's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diffrl.algorithms import flow_grpo
from diffrl.algorithms.flow_grpo import GRPOConfig, StepTerms, clipped_objective
from diffrl.algorithms.registry import (
    Metrics,
)
from diffrl.models.family import broadcast


@dataclass(frozen=True)
class GuardConfig(GRPOConfig):
    name: str = "grpo_guard"

    def uses_old_policy(self) -> bool:
        return True  # RatioNorm reads pi_old's step mean


def guard_ratio(terms: StepTerms) -> tuple[Tensor, Tensor]:
    """(rho~ (n,), b (n,)): RatioNorm's ratio and the bias b_t it removes."""
    old = terms.old
    assert old is not None, "GRPO-Guard anchors on pi_old"
    std = broadcast(terms.std, terms.mean)
    b = ((terms.mean - old.mean) ** 2 / (2 * std**2)).flatten(1).mean(1)
    scale = torch.as_tensor(terms.std).expand_as(b)
    return torch.exp((terms.logp - terms.anchor + b) * scale), b


def guard_objective(
    terms: StepTerms, cfg: GRPOConfig, m: Metrics, share: float
) -> tuple[Tensor, Tensor]:
    ratio, b = guard_ratio(terms)
    per_row = clipped_objective(ratio, terms.adv, cfg.clip_range) / (terms.sigma - terms.sigma_next)
    if terms.w is not None:
        per_row = terms.w * per_row
    m["guard/bias"] = m.get("guard/bias", 0.0) + b.detach().mean() * share
    return per_row, ratio


ALGORITHM = flow_grpo.register_flow_grpo("grpo_guard", GuardConfig, guard_objective)
loss = ALGORITHM.loss  # FlowGRPO's loss with this objective, for direct calls
