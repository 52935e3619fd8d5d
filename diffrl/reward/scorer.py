"""The scorer protocols and the registry's table (``register_scorer``; built by name in
``diffrl.reward.scorers``, which imports the built-in scorers).

Two kinds of scorer: a ``Scorer`` grades each sample on its own (``score``: any rows, each
row's score depends on that row only, so the pool may score rows as they are decoded); a
``GroupScorer`` (``groupwise = True``) grades the G samples of one prompt together
(``score_group``: exactly one whole group, one score per sample, e.g. win rates within the
group), so the pool calls it once a group's samples are all decoded.

A scorer declares which trajectory fields it reads (``needs``, e.g. {"image"}); the pool checks
them at start-up against what the rollout produces, and again on every batch, so a missing
field is an error naming the field and its producer rather than a silent zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from diffrl.types import MODALITIES, Trajectory

# what a reward may grade: one modality, or both ("joint", shared by both under modality credit)
REWARD_MODALITIES = (*MODALITIES, "joint")

# which engine sets which extra field (for error messages)
PRODUCERS = {
    "image": "the rollout engine (decoded x0)",
    "video": "the rollout engine (omni)",
    "fps": "the rollout engine (omni, with video)",
    "audio": "the rollout engine (omni audio decoder)",
    "sample_rate": "the rollout engine (omni, with audio)",
}


def audio_rate(traj: Trajectory, configured: int) -> int:
    """The rate of ``traj``'s audio: its ``extra_fields["sample_rate"]`` (one rate per batch),
    which a configured rate may only repeat; ``configured`` (0 = none) where it has none."""
    if "sample_rate" not in traj.extra_fields:
        if not configured:
            raise KeyError(
                "the trajectory's audio has no 'sample_rate' field and the scorer no "
                "sample_rate param: set one of them (the rollout of an omni family sets it)"
            )
        return configured
    rates = {int(r) for r in traj.extra_fields["sample_rate"].reshape(-1).tolist()}
    if len(rates) != 1:
        raise ValueError(f"one audio rate per batch expected, got {sorted(rates)}")
    rate = rates.pop()
    if configured and configured != rate:
        raise ValueError(
            f"the scorer's sample_rate param is {configured} Hz but the trajectory's audio is "
            f"{rate} Hz; drop the param (the trajectory's rate is used) or fix it"
        )
    return rate


def producers_of(missing: list[str]) -> str:
    """ "'audio' is set by the rollout engine (...); ..." for an error message."""
    return "; ".join(f"{m!r} is set by {PRODUCERS.get(m, 'an unknown producer')}" for m in missing)


@dataclass(frozen=True)
class ScoreResult:
    scores: Tensor  # (B,) float32; NaN where a sample could not be scored
    valid: Tensor  # (B,) bool; False = missing (excluded from advantages, never treated as 0)
    metrics: dict[str, float] = field(default_factory=dict)  # scorer-specific, e.g. accuracy
    # optional split of ``scores`` by modality ("video", "audio", "joint") -> (B,), summing to
    # it: the scorer's own declaration of what each part grades (AVBench's verifiers), read
    # by ``reward.scorers[*].modality=auto`` under algorithm.modality_credit
    parts: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scores.ndim != 1 or self.valid.shape != self.scores.shape:
            raise ValueError(
                f"scores must be (B,) with a matching valid mask, got "
                f"{tuple(self.scores.shape)} and {tuple(self.valid.shape)}"
            )
        for name, part in self.parts.items():
            if name not in REWARD_MODALITIES or part.shape != self.scores.shape:
                raise ValueError(
                    f"a scorer's part {name!r} of shape {tuple(part.shape)}: parts are named "
                    f"one of {REWARD_MODALITIES}, each of the scores' shape "
                    f"{tuple(self.scores.shape)}"
                )


@runtime_checkable
class Scorer(Protocol):
    name: str
    needs: frozenset[str]

    async def score(self, traj: Trajectory) -> ScoreResult: ...


@runtime_checkable
class GroupScorer(Protocol):
    name: str
    needs: frozenset[str]
    groupwise: bool  # True: the pool hands it whole groups, one at a time

    async def score_group(self, traj: Trajectory) -> ScoreResult: ...


def is_group_scorer(scorer: object) -> bool:
    """Whether the pool must hand ``scorer`` whole groups (``score_group``)."""
    return bool(getattr(scorer, "groupwise", False))


def missing_fields(needs: frozenset[str], available: set[str]) -> list[str]:
    return sorted(needs - available)


def check_fields(scorer: Scorer | GroupScorer, traj: Trajectory) -> None:
    missing = missing_fields(scorer.needs, set(traj.extra_fields))
    if missing:
        who = producers_of(missing)
        raise KeyError(
            f"scorer {scorer.name!r} needs extra_fields {missing} that the trajectory "
            f"lacks ({who}); present: {sorted(traj.extra_fields)}"
        )


def finite_result(scores: Tensor) -> ScoreResult:
    """Wrap raw scores; NaN/inf become invalid (never 0)."""
    scores = scores.float()
    return ScoreResult(scores, torch.isfinite(scores))


_SCORERS: dict[str, Callable[..., Scorer | GroupScorer]] = {}


def register_scorer(name: str):
    def deco(factory):
        _SCORERS[name] = factory
        return factory

    return deco


def build_scorer(name: str, params: dict[str, Any] | None = None) -> Scorer | GroupScorer:
    if name not in _SCORERS:
        raise KeyError(
            f"unknown scorer {name!r}; registered: {sorted(_SCORERS)} (a task's own scorer, "
            "e.g. shapes or avbench, is registered by importing diffrl.tasks)"
        )
    try:
        return _SCORERS[name](**(params or {}))
    except TypeError as e:
        raise ValueError(f"bad params for scorer {name!r}: {e}") from None
