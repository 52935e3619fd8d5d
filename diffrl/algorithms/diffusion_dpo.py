"""Diffusion-DPO in flow-matching form (Wallace et al., 2024, "Diffusion Model Alignment Using
Direct Preference Optimization"; flow form as in Liu et al., 2025, "Improving Video
Generation with Human Feedback").

Pairs (winner w, loser l) come from each rollout group. Each pair shares sigma and eps:
x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0, and with m = ||v_theta - v||^2 and
r = ||v_ref - v||^2 (means over dimensions),

    L = -log sigmoid( -beta / 2 * [ (m_w - m_l) - (r_w - r_l) ] ),

averaged over ``timesteps_per_pair`` draws of sigma ~ U(sigma_min, sigma_max) per pair.

Offline mode keeps the reference fixed (the base model, adapters disabled); online mode uses
the ``old`` adapter as reference and refreshes it from ``default`` every ``ref_every`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

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
from diffrl.types import ScoredBatch, TrainBatch, host_to_device, train_batch


@dataclass(frozen=True)
class DPOConfig(AlgorithmConfig):
    name: str = "diffusion_dpo"
    beta: float = 1000.0  # KL strength; large because m and r are per-dimension means
    pairs: str = "best_worst"  # best_worst (one pair per group) | margin (all pairs > margin)
    margin: float = 0.0  # reward gap a pair needs (both modes)
    mode: str = "online"  # online (reference = old adapter, refreshed) | offline (base model)
    ref_every: int = 4  # online: copy default -> old every N steps
    timesteps_per_pair: int = 1  # fresh shared (sigma, eps) draws per pair per update
    sigma_min: float = 0.0  # training sigmas ~ U(sigma_min, sigma_max), shared within a pair
    sigma_max: float = 1.0

    def validate(self) -> None:
        check(self.beta > 0, "beta", self.beta, "must be > 0")
        check_training_draws(
            "timesteps_per_pair", self.timesteps_per_pair, self.sigma_min, self.sigma_max
        )
        check_choice("pairs", self.pairs, ("best_worst", "margin"))
        check(self.margin >= 0, "margin", self.margin, "must be >= 0")
        check_choice("mode", self.mode, ("online", "offline"))
        check(self.ref_every >= 1, "ref_every", self.ref_every, "must be >= 1")
        check(
            not self.modality_credit,
            "modality_credit",
            self.modality_credit,
            "diffusion_dpo ranks whole samples into pairs by one scalar reward, so it has no "
            "per-modality credit; set it false (or use diffusion_nft or flow_grpo)",
        )


def make_pairs(rewards: Tensor, group: Tensor, valid: Tensor, how: str, margin: float) -> Tensor:
    """(P, 2) int64 (winner, loser) row indices, within groups, reward gap > margin."""
    out = []
    for g in group.unique().tolist():
        rows = ((group == g) & valid).nonzero().squeeze(1)
        if len(rows) < 2:
            continue
        r = rewards[rows]
        if how == "best_worst":
            w, l_ = rows[r.argmax()], rows[r.argmin()]
            if rewards[w] - rewards[l_] > margin:
                out.append((int(w), int(l_)))
        else:
            for i in range(len(rows)):
                for j in range(len(rows)):
                    if r[i] - r[j] > margin:
                        out.append((int(rows[i]), int(rows[j])))
    return torch.tensor(out, dtype=torch.long).reshape(-1, 2)


def prepare(scored: ScoredBatch, cfg: DPOConfig) -> TrainBatch:
    traj = scored.traj
    pairs = make_pairs(scored.rewards, traj.group, scored.valid, cfg.pairs, cfg.margin)
    batch = replace(train_batch(scored, rewards=scored.rewards), pairs=pairs)
    return batch.select(pairs.flatten())  # the batch holds [w0, l0, w1, l1, ...]


def dpo_loss(m_w: Tensor, m_l: Tensor, r_w: Tensor, r_l: Tensor, beta: float) -> Tensor:
    """-log sigmoid(-beta/2 * ((m_w - m_l) - (r_w - r_l))), per pair."""
    return -F.logsigmoid(-0.5 * beta * ((m_w - m_l) - (r_w - r_l)))


def loss(
    policy: Policy,
    batch: TrainBatch,
    cfg: DPOConfig,
    gen: torch.Generator,
    backward: Backward | None = None,
) -> tuple[Tensor, Metrics]:
    x0 = batch.x0  # rows alternate winner, loser (micro-batches keep pairs whole)
    if len(x0) % 2:
        raise ValueError("diffusion_dpo micro-batches must hold whole pairs (even size)")
    n_pairs, steps = len(x0) // 2, cfg.timesteps_per_pair
    total = x0.new_zeros(())
    acc: Tensor | float = 0.0
    for _ in range(steps):
        per_pair, implicit_acc = _pair_terms(policy, batch, cfg, gen, n_pairs)
        total, acc = add_part(total, per_pair.mean() / steps, backward), acc + implicit_acc / steps
    return total, {"dpo/pairs": float(n_pairs), "dpo/implicit_acc": acc}


def _pair_terms(
    policy: Policy, batch: TrainBatch, cfg: DPOConfig, gen: torch.Generator, n_pairs: int
) -> tuple[Tensor, Tensor]:
    """One shared (sigma, eps) draw per pair: (per-pair loss (P,), implicit accuracy ())."""
    x0 = batch.x0
    span = cfg.sigma_max - cfg.sigma_min
    sigma = (torch.rand(n_pairs, generator=gen) * span + cfg.sigma_min).repeat_interleave(2)
    sigma = host_to_device(sigma, x0.device, x0.dtype)
    eps = torch.randn((n_pairs, *x0.shape[1:]), generator=gen).repeat_interleave(2, 0)
    eps = host_to_device(eps, x0.device, x0.dtype)
    x, v = noised(x0, sigma, eps), eps - x0
    ids, cond = batch.input_ids, batch.cond
    m = (policy.velocity(x, sigma, ids, cond=cond) - v).pow(2).flatten(1).mean(1)
    with torch.no_grad():
        ref = "old" if cfg.mode == "online" else None
        r = (policy.velocity(x, sigma, ids, adapter=ref, cond=cond) - v).pow(2).flatten(1).mean(1)
    per_pair = dpo_loss(m[0::2], m[1::2], r[0::2], r[1::2], cfg.beta)
    # share of pairs the policy prefers the winner in, relative to the reference; a tie (as
    # right after a reference refresh, when policy == reference) counts as a coin flip
    gap_w, gap_l = m[0::2] - r[0::2], m[1::2] - r[1::2]
    implicit_acc = ((gap_w < gap_l).float() + 0.5 * (gap_w == gap_l).float()).mean()
    return per_pair, implicit_acc


def train_cost(cfg: DPOConfig, batch: TrainBatch) -> TrainCost:
    """Per draw of a pair, for each of its samples: the policy's forward and backward, and the
    reference's forward."""
    return TrainCost(forwards=2 * cfg.timesteps_per_pair, backwards=cfg.timesteps_per_pair)


def weight_plan(step: int, cfg: DPOConfig) -> WeightPlan:
    """Samples with the current policy (synced every update); online mode refreshes the
    reference (``old``) every ``ref_every`` updates."""
    refresh = cfg.mode == "online" and step % cfg.ref_every == 0
    return WeightPlan("default", refresh_old=0.0 if refresh else None)


ALGORITHM = register_algorithm(
    Algorithm(
        name="diffusion_dpo",
        config_cls=DPOConfig,
        prepare=prepare,
        loss=loss,
        weight_plan=weight_plan,
        train_cost=train_cost,
        needs_logprobs=False,
        partial_backward=True,
        group_use="it trains on (winner, loser) pairs of samples of one prompt",
    )
)
