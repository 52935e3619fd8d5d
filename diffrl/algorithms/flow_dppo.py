"""Flow-DPPO: FlowGRPO with PPO's ratio clip replaced by an asymmetric divergence mask
(Ping et al., 2026, "Flow-DPPO: Divergence Proximal Policy Optimization for Flow Matching
Models", arXiv:2606.11025).

A trained SDE step is a Gaussian with the same std under pi_theta and pi_old, so their
divergence is exact and cheap, where PPO's ratio is a one-sample estimate of it:

    D_t = ||mu_theta - mu_old||^2_mean / (2 std^2)          (mean over the latent's dims)
    rho_t = exp(logp_theta - logp_old)
    M_t = 0 if D_t > delta and ((A > 0 and rho_t > 1) or (A < 0 and rho_t < 1)), else 1
    L_t = -M_t * A * rho_t                                  (M_t detached; no clip)

An update is blocked only when the step is outside the trust region AND moving further out;
a corrective update stays on. FlowGRPO's group advantages, steps trained, KL to the
reference (``kl_coef``) and rollout correction's weights are kept (``flow_grpo.loss`` runs
this per-step objective in its loop); ``clip_range`` is unused.

What diffrl does differently from the paper's reference: pi_old is the update's start
weights, read off the update's own forward (``rollout_correction_bypass=true``, one optimizer
step per update, where D_t = 0 and the loss is the plain policy gradient -A rho) or, for the
multi-minibatch updates where the mask matters, recomputed under the ``old`` adapter
(``rollout_correction_bypass=false`` with ``actor.minibatches`` > 1, as the recipe runs);
the reference's x-space mask KL is the one used (mu is the step's mean in x); its v-space
option is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diffrl.algorithms import flow_grpo
from diffrl.algorithms.flow_grpo import GRPOConfig, StepTerms
from diffrl.algorithms.registry import (
    Metrics,
)
from diffrl.errors import check
from diffrl.models.family import broadcast


@dataclass(frozen=True)
class DPPOConfig(GRPOConfig):
    name: str = "flow_dppo"
    # delta: the per-step divergence past which an update moving further out is masked
    # (verl-omni's kl_mask_threshold)
    divergence_threshold: float = 1e-5

    def validate(self) -> None:
        super().validate()
        check(
            self.divergence_threshold > 0,
            "divergence_threshold",
            self.divergence_threshold,
            "must be > 0",
        )

    def clips(self) -> bool:
        return False  # the divergence mask takes the clip's place

    def uses_old_policy(self) -> bool:
        return True  # the mask reads pi_old's step mean


def divergence(terms: StepTerms) -> Tensor:
    """(n,) D_t, the Gaussian step's KL between pi_theta and pi_old (detached)."""
    old = terms.old
    assert old is not None, "Flow-DPPO anchors on pi_old"
    std = broadcast(terms.std, terms.mean)
    return ((terms.mean.detach() - old.mean) ** 2 / (2 * std**2)).flatten(1).mean(1)


def dppo_objective(
    terms: StepTerms, cfg: GRPOConfig, m: Metrics, share: float
) -> tuple[Tensor, Tensor]:
    assert isinstance(cfg, DPPOConfig)
    ratio = torch.exp(terms.logp - terms.anchor)
    d, r, adv = divergence(terms), ratio.detach(), terms.adv
    away = ((adv > 0) & (r > 1)) | ((adv < 0) & (r < 1))
    keep = (~((d > cfg.divergence_threshold) & away)).to(ratio.dtype)
    per_row = -keep * adv * ratio
    if terms.w is not None:
        per_row = terms.w * per_row
    m["dppo/masked_frac"] = m.get("dppo/masked_frac", 0.0) + (1 - keep).mean() * share
    m["dppo/divergence"] = m.get("dppo/divergence", 0.0) + d.mean() * share
    return per_row, ratio


ALGORITHM = flow_grpo.register_flow_grpo("flow_dppo", DPPOConfig, dppo_objective)
loss = ALGORITHM.loss  # FlowGRPO's loss with this objective, for direct calls
