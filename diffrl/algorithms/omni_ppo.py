"""Omni-PPO: token-level clipped PPO with group-relative advantages and no critic, for an
autoregressive (omni) family (``models/family.py`` ``ARFamily``): GRPO's objective (Shao et
al. 2024, "DeepSeekMath", arXiv:2402.03300) with DAPO's options (Yu et al. 2025, arXiv:2503.14476)
and GSPO's sequence-level ratio (Zheng et al. 2025, arXiv:2507.18071).

A prompt's G completions y_1..y_G have rewards R_i. With the behaviour policy's per-token
log-probs recorded at generation (``Trajectory.log_probs``: no recompute of the old policy,
the rollout samples with the current weights), for token t of completion i

    A_i      = (R_i - mean_g R) / (std_g R + 1e-4)                  (GRPO; no critic)
    r_it     = exp(log pi_theta(y_it | x, y_i<t) - log pi_old(y_it | ...))
    l_it     = -min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
    kl_it    = exp(q_it) - q_it - 1,  q_it = log pi_ref(y_it) - log pi_theta(y_it)   (k3)
    L        = sum_{i,t} (l_it + beta kl_it) / sum_i |y_i|          (loss_agg=token_mean)

The reference pi_ref is the base model (the LoRA adapters disabled). ``loss_agg=seq_mean`` is
GRPO's original mean over each completion's tokens, then over completions.

Options:
- ``clip_high`` > ``clip_low`` is DAPO's clip-higher (0.2 / 0.28 in the paper): a low-probability
  token with a positive advantage may rise further before its gradient is cut.
- ``dynamic_sampling``: DAPO drops the groups whose rewards all tie (every completion right, or
  every one wrong: A = 0, nothing to learn) and samples more prompts to refill the batch.
  diffrl drops them and trains on the rest (the step's mean is over the rows that remain).
- ``ratio=sequence`` is GSPO: one ratio per completion, the geometric mean of its tokens',
  s_i = exp(mean_t (log pi_theta - log pi_old)), and l_i = -min(s_i A_i, clip(s_i, 1 - eps_low,
  1 + eps_high) A_i), averaged over completions (the KL term stays per token). GSPO's clip
  ranges are far narrower than the token ratio's (3e-4 / 4e-4 in the paper); set them.

What the papers' references do that diffrl does differently: verl/DAPO aggregate the token
mean over the whole mini-batch; diffrl's actor weighs each micro-batch's token mean by its
share of the rows (the same when micro-batches hold equal token counts). The old policy's
log-probs are the rollout's own, recorded from the raw logits at temperature 1, instead of a
separate recompute (the first update's ratio is 1 up to kernel differences, logged as
``ppo/ratio_max``). DAPO's overlong reward shaping is left to the reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from diffrl.algorithms.advantage import group_advantages, group_ranges
from diffrl.algorithms.registry import (
    Algorithm,
    AlgorithmConfig,
    Backward,
    Metrics,
    TrainCost,
    WeightPlan,
    register_algorithm,
)
from diffrl.errors import check, check_choice
from diffrl.models.family import NO_TOKEN
from diffrl.types import ScoredBatch, TrainBatch, train_batch

TOKEN_STEP = "token"  # the StepSpec.kind of an autoregressive rollout (rollout/ar.py)


@dataclass(frozen=True)
class OmniPPOConfig(AlgorithmConfig):
    name: str = "omni_ppo"
    clip_low: float = 0.2  # eps_low: the ratio's floor is 1 - clip_low
    clip_high: float = 0.2  # eps_high: its ceiling is 1 + clip_high (DAPO's clip-higher: 0.28)
    kl_beta: float = 0.02  # weight of the k3 KL to the reference (the base model); 0 = none
    ratio: str = "token"  # token (PPO/GRPO) | sequence (GSPO: one ratio per completion)
    loss_agg: str = "token_mean"  # token_mean (DAPO) | seq_mean (GRPO: per completion, then mean)
    dynamic_sampling: bool = False  # DAPO: drop the groups whose rewards all tie
    global_std: bool = False  # scale advantages by the batch's reward std, not each group's

    def validate(self) -> None:
        check(0 < self.clip_low < 1, "clip_low", self.clip_low, "must be in (0, 1)")
        check(self.clip_high > 0, "clip_high", self.clip_high, "must be > 0")
        check(self.kl_beta >= 0, "kl_beta", self.kl_beta, "must be >= 0 (0 = no KL term)")
        check_choice("ratio", self.ratio, ("token", "sequence"))
        check_choice("loss_agg", self.loss_agg, ("token_mean", "seq_mean"))
        check(
            not self.modality_credit,
            "modality_credit",
            self.modality_credit,
            "omni_ppo trains a text answer's tokens; there are no video/audio latents to credit",
        )

    def whole_batch_keys(self) -> tuple[str, ...]:
        return ("global_std",) if self.global_std else ()


class TokenPolicy(Protocol):
    """What the loss calls: an autoregressive model's per-token log-probs under an adapter
    (None = the reference, adapters disabled); ``ActorEngine.token_log_probs``."""

    def token_log_probs(
        self,
        tokens: Tensor,
        temperature: Tensor | float,
        input_ids: Tensor,
        adapter: str | None = "default",
        cond: Tensor | None = None,
    ) -> Tensor: ...


def prepare(scored: ScoredBatch, cfg: OmniPPOConfig) -> TrainBatch:
    """Group-relative advantages on the valid rows; with ``dynamic_sampling`` only the rows of
    groups whose valid rewards differ are kept."""
    traj = scored.traj
    spec = traj.step_spec
    if spec is None or spec.kind != TOKEN_STEP or traj.log_probs is None:
        raise ValueError(
            "omni_ppo trains an autoregressive family's sampled tokens and their recorded "
            "log-probs (model.family qwen_omni); this trajectory has none"
        )
    if traj.sde_mask is None or not bool(traj.sde_mask.any()):
        raise ValueError(
            "omni_ppo needs sampled completions: set rollout.sampler=sde (ode is greedy decoding)"
        )
    adv = group_advantages(scored.rewards, traj.group, scored.valid, global_std=cfg.global_std)
    keep = scored.valid
    if cfg.dynamic_sampling:
        spread = group_ranges(scored.rewards, traj.group, scored.valid) > 1e-6  # (n_groups,)
        keep = keep & spread[traj.group]
    return train_batch(scored, advantages=adv).select(keep.nonzero().squeeze(1))


def token_surrogate(
    logp: Tensor, old: Tensor, adv: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic per-token loss -min(r A, clip(r, 1-lo, 1+hi) A), and whether each
    token's ratio was clipped; logp, old (B, T), adv (B,)."""
    ratio = (logp - old).exp()
    a = adv[:, None]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(-a * ratio, -a * clipped), (ratio != clipped)


def sequence_surrogate(
    logp: Tensor, old: Tensor, mask: Tensor, adv: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """GSPO's per-completion loss with s_i = exp(mean over its tokens of logp - old), and
    whether each s_i was clipped; (B,) each."""
    n = mask.sum(1).clamp(min=1)
    ratio = (((logp - old) * mask).sum(1) / n).exp()
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(-adv * ratio, -adv * clipped), (ratio != clipped)


def k3_kl(logp: Tensor, ref: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: e^q - q - 1, q = ref - logp
    (unbiased, >= 0)."""
    q = ref - logp
    return q.exp() - q - 1


def loss(
    policy: TokenPolicy,
    batch: TrainBatch,
    cfg: OmniPPOConfig,
    gen: torch.Generator,
    backward: Backward | None = None,
) -> tuple[Tensor, Metrics]:
    tokens, old, adv = batch.x0, batch.log_probs, batch.advantages
    assert old is not None and adv is not None and batch.step_spec is not None, "from prepare"
    mask = (tokens != NO_TOKEN).float()  # (B, T)
    temp = batch.step_spec.noise_level
    logp = policy.token_log_probs(tokens, temp, batch.input_ids, cond=batch.cond)
    if cfg.ratio == "token":
        per_token, clip = token_surrogate(logp, old, adv, cfg.clip_low, cfg.clip_high)
        total = aggregate(per_token, mask, cfg.loss_agg)
        clip_frac = aggregate(clip.float(), mask, "token_mean")
    else:  # GSPO: each completion's loss weighs one
        per_seq, clip = sequence_surrogate(logp, old, mask, adv, cfg.clip_low, cfg.clip_high)
        total, clip_frac = per_seq.mean(), clip.float().mean()
    metrics: Metrics = {}
    if cfg.kl_beta > 0:
        with torch.no_grad():
            ref = policy.token_log_probs(tokens, temp, batch.input_ids, None, batch.cond)
        kl = aggregate(k3_kl(logp, ref), mask, cfg.loss_agg)
        total = total + cfg.kl_beta * kl
        metrics["ppo/kl"] = kl.detach()
    metrics |= {
        "ppo/clip_frac": clip_frac.detach(),
        "ppo/ratio_max": ((logp - old).exp() * mask).detach().max(),
        "ppo/tokens": mask.sum(1).mean(),
    }
    return total, metrics


def aggregate(per_token: Tensor, mask: Tensor, how: str) -> Tensor:
    """token_mean: over every token of the micro-batch; seq_mean: over each completion's
    tokens, then over completions. (B, T) -> ()."""
    if how == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def train_cost(cfg: OmniPPOConfig, batch: TrainBatch) -> TrainCost:
    """The policy's forward and backward, and the reference's forward with the KL term."""
    return TrainCost(forwards=2.0 if cfg.kl_beta > 0 else 1.0, backwards=1.0)


def weight_plan(step: int, cfg: OmniPPOConfig) -> WeightPlan:
    """Samples with the current policy, synced after every update."""
    return WeightPlan("default")


ALGORITHM = register_algorithm(
    Algorithm(
        name="omni_ppo",
        config_cls=OmniPPOConfig,
        prepare=prepare,
        loss=loss,  # type: ignore[arg-type]  # a TokenPolicy: the actor is both kinds
        weight_plan=weight_plan,
        train_cost=train_cost,
        group_use="its advantages are each completion's reward minus its group's mean",
    )
)
