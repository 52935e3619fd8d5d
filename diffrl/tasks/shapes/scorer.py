"""The ShapesBench verifier as a scorer: an exact program, no weights."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from diffrl.errors import check_choice
from diffrl.reward.scorer import ScoreResult
from diffrl.tasks.shapes.prompts import parse_prompt
from diffrl.tasks.shapes.verify import verify
from diffrl.types import Trajectory

CONSTRAINTS = ("color", "count", "shape", "position")


class ShapesScorer:
    """mode="partial": 0.5 * overall + 0.5 * mean of the four constraints (denser signal);
    mode="graded": as partial, but each constraint counts the share of its checks that pass
    (two of three circles right is 2/3 of "shape", not 0), which separates more of a group's
    samples on prompts with several objects; the same as partial on one-object prompts;
    mode="overall": 1 if every constraint holds else 0 (GenEval's strict score)."""

    needs = frozenset({"image"})

    def __init__(self, mode: str = "partial") -> None:
        check_choice("mode", mode, ("partial", "graded", "overall"))
        self.name = "shapes"
        self.mode = mode

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    def score_sync(self, traj: Trajectory) -> ScoreResult:
        images = traj.extra_fields["image"].numpy()  # (B, H, W, 3) uint8
        overall, held = [], []  # held: the mean share of the constraints met
        parsed = {t: parse_prompt(t) for t in set(traj.prompts.texts)}
        for img, text in zip(images, traj.prompts.texts, strict=True):
            v = verify(np.ascontiguousarray(img), parsed[text])
            overall.append(float(v.overall))
            per_constraint = v.fractions if self.mode == "graded" else v.constraints
            held.append(float(np.mean([per_constraint[c] for c in CONSTRAINTS])))
        overall_t, held_t = torch.tensor(overall), torch.tensor(held)
        scores = overall_t if self.mode == "overall" else 0.5 * overall_t + 0.5 * held_t
        return ScoreResult(
            scores.float(),
            torch.ones(len(scores), dtype=torch.bool),
            {"accuracy": float(overall_t.mean())},
        )
