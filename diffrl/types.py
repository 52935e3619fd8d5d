"""Typed records on each edge of the data flow (DESIGN.md §1):

    PromptBatch ─▶ Trajectory ─▶ ScoredBatch ─▶ TrainBatch
     (data)        (rollout)      (reward)       (algorithm.prepare)

Shapes are in the comments: B samples, L text tokens, T sampler steps, (C, H, W) an image.
Media that a scorer may need (decoded images, video frames, audio) ride in ``extra_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from diffrl.errors import ContractError


@dataclass(frozen=True)
class PromptBatch:
    """Prompts tokenized once, in the data stage; the same ``input_ids`` travel everywhere."""

    texts: tuple[str, ...]  # (B,)
    input_ids: Tensor  # (B, L) int64, right-padded
    ids_hash: tuple[str, ...]  # (B,) stable per-row hash of input_ids (token-drift check)
    prompt_ids: Tensor  # (B,) int64 index of each prompt in its prompt set

    def __post_init__(self) -> None:
        n = len(self.texts)
        if self.input_ids.ndim != 2 or self.input_ids.shape[0] != n:
            raise ValueError(f"input_ids must be (B={n}, L), got {tuple(self.input_ids.shape)}")
        if len(self.ids_hash) != n or self.prompt_ids.shape != (n,):
            raise ValueError("ids_hash and prompt_ids must have one entry per prompt")

    def __len__(self) -> int:
        return len(self.texts)

    def repeat(self, g: int) -> PromptBatch:
        """Each prompt ``g`` times in a row: [p0]*g + [p1]*g + ... (a group per prompt)."""
        return PromptBatch(
            texts=tuple(t for t in self.texts for _ in range(g)),
            input_ids=self.input_ids.repeat_interleave(g, dim=0),
            ids_hash=tuple(h for h in self.ids_hash for _ in range(g)),
            prompt_ids=self.prompt_ids.repeat_interleave(g),
        )

    def select(self, index: Tensor) -> PromptBatch:
        idx = index.tolist()
        return PromptBatch(
            texts=tuple(self.texts[i] for i in idx),
            input_ids=self.input_ids[index],
            ids_hash=tuple(self.ids_hash[i] for i in idx),
            prompt_ids=self.prompt_ids[index],
        )


@dataclass(frozen=True)
class StepSpec:
    """How a trajectory's stochastic steps were taken; training recomputes log-probs with
    exactly these settings (carried with the data, so they cannot drift apart)."""

    kind: str  # "flow_grpo" | "cps" (see diffrl.rollout.samplers.STOCHASTIC_STEPS)
    noise_level: float
    cfg_scale: float  # classifier-free guidance used at every step (1 = off)
    null_id: int  # token id of the empty prompt (for the unconditional branch of CFG)


@dataclass(frozen=True)
class Trajectory:
    """What the rollout engine produced for B = n_prompts * G samples."""

    prompts: PromptBatch  # B rows, grouped: rows [k*G, (k+1)*G) share a prompt
    group: Tensor  # (B,) int64 group id (one per prompt in this batch)
    seeds: Tensor  # (B,) int64 seed of each sample's initial noise and SDE noise
    x0: Tensor  # (B, C, H, W) final clean sample, canonical model space ([-1, 1] pixels)
    sigmas: Tensor  # (T+1,) the sampler's sigma schedule, 1 -> 0
    policy_version: int  # version of the weights that sampled this trajectory
    latents: Tensor | None = None  # (B, T+1, C, H, W) x at each sigma (kept when asked)
    log_probs: Tensor | None = None  # (B, T) per-step Gaussian log-prob (SDE steps; 0 for ODE)
    sde_mask: Tensor | None = None  # (T,) bool: steps taken stochastically (with log-probs)
    step_spec: StepSpec | None = None  # how the stochastic steps were taken
    extra_fields: dict[str, Tensor] = field(default_factory=dict)  # media, e.g. "image"

    def __len__(self) -> int:
        return self.x0.shape[0]

    def with_fields(self, **fields: Tensor) -> Trajectory:
        return replace(self, extra_fields={**self.extra_fields, **fields})

    @staticmethod
    def concat(parts: list[Trajectory]) -> Trajectory:
        """Join micro-batches (each holding whole groups) back into one trajectory."""
        first = parts[0]
        if len(parts) == 1:
            return first
        if len({p.policy_version for p in parts}) != 1:
            raise ValueError("cannot concat trajectories sampled by different policy versions")
        if len({p.step_spec for p in parts}) != 1 or any(
            (p.sde_mask is None) != (first.sde_mask is None)
            or (p.sde_mask is not None and not torch.equal(p.sde_mask, first.sde_mask))
            for p in parts
        ):
            raise ValueError("cannot concat trajectories sampled with different SDE settings")

        def cat(get):
            vals = [get(p) for p in parts]
            return None if vals[0] is None else torch.cat(vals)

        pb = [p.prompts for p in parts]
        prompts = PromptBatch(
            texts=sum((b.texts for b in pb), ()),
            input_ids=torch.cat([b.input_ids for b in pb]),
            ids_hash=sum((b.ids_hash for b in pb), ()),
            prompt_ids=torch.cat([b.prompt_ids for b in pb]),
        )
        return Trajectory(
            prompts=prompts,
            group=cat(lambda p: p.group),
            seeds=cat(lambda p: p.seeds),
            x0=cat(lambda p: p.x0),
            sigmas=first.sigmas,
            policy_version=first.policy_version,
            latents=cat(lambda p: p.latents),
            log_probs=cat(lambda p: p.log_probs),
            sde_mask=first.sde_mask,
            step_spec=first.step_spec,
            extra_fields={
                k: torch.cat([p.extra_fields[k] for p in parts]) for k in first.extra_fields
            },
        )


@dataclass(frozen=True)
class ScoredBatch:
    """A trajectory plus rewards. Samples whose optional scorer failed are ``valid=False``
    and are excluded from advantages; they are never scored 0."""

    traj: Trajectory
    rewards: Tensor  # (B,) float32 weighted sum over scorers
    per_scorer: dict[str, Tensor]  # name -> (B,) raw score (NaN where missing)
    valid: Tensor  # (B,) bool

    def __len__(self) -> int:
        return self.rewards.shape[0]

    @staticmethod
    def concat(parts: list[ScoredBatch]) -> ScoredBatch:
        return ScoredBatch(
            traj=Trajectory.concat([p.traj for p in parts]),
            rewards=torch.cat([p.rewards for p in parts]),
            per_scorer={
                k: torch.cat([p.per_scorer[k] for p in parts]) for k in parts[0].per_scorer
            },
            valid=torch.cat([p.valid for p in parts]),
        )


@dataclass(frozen=True)
class TrainBatch:
    """What the actor trains on; ``algorithm.prepare`` fills the fields its loss reads."""

    input_ids: Tensor  # (B, L) int64, the same tensor the rollout saw
    ids_hash: tuple[str, ...]  # (B,) hashes from the data stage
    x0: Tensor  # (B, C, H, W) clean samples
    weights: Tensor  # (B,) per-sample coefficient: NFT optimality r in [0,1], GRPO advantage
    seeds: Tensor  # (B,) for reproducible training noise
    group: Tensor | None = None  # (B,) group id (for pair construction)
    latents: Tensor | None = None  # (B, T+1, C, H, W) (algorithms that need the path)
    log_probs: Tensor | None = None  # (B, T) rollout log-probs
    sigmas: Tensor | None = None  # (T+1,)
    pairs: Tensor | None = None  # (P, 2) int64 (winner, loser) row indices
    sde_mask: Tensor | None = None  # (T,) bool, from the trajectory
    step_spec: StepSpec | None = None  # from the trajectory

    def __len__(self) -> int:
        return self.x0.shape[0]


def check_token_hashes(batch: TrainBatch, hash_fn) -> None:
    """Contract 3: the actor sees exactly the ids the data stage produced."""
    recomputed = hash_fn(batch.input_ids)
    bad = [i for i, (a, b) in enumerate(zip(recomputed, batch.ids_hash, strict=True)) if a != b]
    if bad:
        raise ContractError(
            f"token drift: input_ids of rows {bad[:8]} changed between the data stage and the "
            "actor (hash mismatch); prompts must be tokenized once and travel unchanged"
        )


def images_from_uint8(x: Tensor) -> Tensor:
    """(B, H, W, C) uint8 -> (B, C, H, W) float in [-1, 1], the model's space (the inverse of
    ``images_to_uint8`` up to rounding)."""
    return x.permute(0, 3, 1, 2).float() / 127.5 - 1


def images_to_uint8(x: Tensor) -> Tensor:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, C) uint8, the form scorers read."""
    return (
        ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    )
