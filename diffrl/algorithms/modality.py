"""Credit per modality (``algorithm.modality_credit``): a video+audio model trained on one scalar
reward credits both branches alike for what only one of them did (a clip whose beeps are off
but whose ball is right pushes the video away from a good picture). Under modality credit each
modality is trained on its own rewards plus the joint ones.

Rewards are declared per modality by the reward pool (``reward.scorers[*].modality``, or the
scorer's own split: ``ScoredBatch.modality_rewards``, R_video + R_audio + R_joint = R). The rule:

    A_video = norm(R_video + R_joint)        A_audio = norm(R_audio + R_joint)

each centred on its group's mean and scaled by one std per group pooled over both modalities'
centred rewards (``algorithm.modality_std=pooled``, the default; the batch's with
``global_std``), or by each modality's own group std (``own``: groupnorm per modality, the
``group_advantages`` of each column). Pooled keeps what one modality did apart from what both
did: on AVBench a broken ball also breaks the sync (joint), and with each modality's own std a
group's one failing clip gets the same advantage in both modalities whatever the size of each
one's loss (a group-normalised single outlier is always -sqrt(G-1)); pooled gives the audio only
its share (the sync). It stays finite where the scalar's std is 0 because the modalities moved
in opposite directions (the scalar then teaches nothing; pooled gives them opposite
advantages). Each advantage then weights only its modality's elements of the
flat latent x = [video | audio] (``TrainBatch.modality_split``):

- DiffusionNFT: r_m = 1/2 + 1/2 clip(A_m / Z, -1, 1) weights the v+/v- errors of modality m's
  elements; the per-sample error is a mean over all D elements, so it splits exactly into
  e_video + e_audio (each a sum over the modality's elements / D), and the loss is
  sum_m [r_m e+_m + (1 - r_m) e-_m] / beta;
- FlowGRPO: the Gaussian step log-prob is a sum over elements, split into each modality's mean
  (``samplers.modality_log_probs``; the rollout records both), so each modality has its own
  ratio rho_m, clipped on its own, and its own KL (the KL is also a sum over elements); the
  clipped objectives are weighed by the modality's share of the elements, D_m / D, so that with
  A_video = A_audio and unclipped ratios the gradient is the joint loss's.

With only joint rewards both advantages are the scalar one and the losses are the joint ones.
Diffusion-DPO (pairs ranked by one scalar) refuses the key, and so does a family without two
modalities (``check_family``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffrl.algorithms.advantage import group_advantages
from diffrl.errors import ConfigError, ContractError
from diffrl.models.family import HasModalities
from diffrl.types import MODALITIES, ScoredBatch, TrainBatch

KEY = "algorithm.modality_credit"


def credited_rewards(scored: ScoredBatch) -> Tensor:
    """(B, 2) each modality's reward (video, audio): its own plus the joint ones."""
    by = scored.modality_rewards
    if not by:  # the pool always fills it (all joint at least): a record on the way lost it
        raise ContractError(
            f"{KEY}: the scored batch carries no rewards per modality (the reward pool sums "
            "them into ScoredBatch.modality_rewards; something between it and prepare dropped "
            "them)"
        )
    joint = by.get("joint", torch.zeros_like(scored.rewards))
    zero = torch.zeros_like(scored.rewards)
    return torch.stack([by.get(m, zero) + joint for m in MODALITIES], 1)


def modality_advantages(
    scored: ScoredBatch, global_std: bool, std: str = "pooled", eps: float = 1e-4
) -> Tensor:
    """(B, 2) A_video, A_audio: each column of ``credited_rewards`` centred on its group's
    mean, over ``std``: "pooled", one std per group over both columns' centred values (the
    batch's with ``global_std``); "own", each column's own (``group_advantages`` per column)."""
    traj, rewards, valid = scored.traj, credited_rewards(scored), scored.valid
    if std == "own":
        columns = [
            group_advantages(rewards[:, k], traj.group, valid, global_std=global_std, eps=eps)
            for k in range(len(MODALITIES))
        ]
        return torch.stack(columns, 1)
    group, w = traj.group, valid.double()
    r = torch.where(valid[:, None], rewards, torch.zeros_like(rewards)).double()
    n_groups = int(group.max()) + 1 if len(group) else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, w).clamp(min=1)
    mean = torch.zeros(n_groups, 2, dtype=torch.float64).index_add_(0, group, r * w[:, None])
    centered = (r - (mean / count[:, None])[group]) * w[:, None]
    if global_std:
        spread = centered[valid].flatten()
        scale = spread.std(unbiased=False) if len(spread) > 1 else torch.tensor(0.0)
    else:
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(
            0, group, centered.pow(2).sum(1)
        )
        scale = (var / (2 * count)).sqrt()[group][:, None]
    return (centered / (scale + eps)).float()


def split_of(batch: TrainBatch, algorithm: str) -> tuple[int, int]:
    """The batch's (n_video, n_audio), checked against its flat x."""
    split = batch.modality_split
    if split is None:
        raise ContractError(
            f"{KEY}: {algorithm} got a batch without a modality split (the rollout of a "
            "video+audio family records it on the trajectory)"
        )
    if batch.x0[0].numel() != sum(split) or batch.x0.ndim != 2:
        raise ContractError(
            f"{KEY}: the batch's x0 {tuple(batch.x0.shape)} is not the flat (B, {sum(split)}) "
            f"latent its modality split {split} describes"
        )
    return split


def element_shares(err: Tensor, split: tuple[int, int]) -> Tensor:
    """(B, D) element errors -> (B, 2): each modality's sum over its elements / D, so the two
    add up to the per-sample mean ``err.mean(1)``."""
    video, audio = err.split(split, dim=1)
    d = err.shape[1]
    return torch.stack([video.sum(1) / d, audio.sum(1) / d], 1)


def check_family(modality_credit: bool, family) -> None:
    """Refuse modality credit for a family whose latent is not video + audio."""
    if modality_credit and not isinstance(family, HasModalities):
        raise ConfigError(
            f"config key '{KEY}' = true: model family {family.name!r} has one modality; "
            "credit per modality needs a video+audio family (its latent split into video and "
            "audio parts: minimax_h3, ltx2); set algorithm.modality_credit=false"
        )
