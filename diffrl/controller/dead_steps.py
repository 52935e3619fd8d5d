"""No silent no-op: a run whose updates change nothing stops, naming why.

A step's update is *dead* when it cannot have moved the weights: the actor skipped it (no row
left to train on, or a NaN/inf loss or gradient), or its gradient norm is exactly 0 (every
advantage 0: each prompt's samples scored alike, a group of one, a zero reward weight).
``run.max_dead_steps`` dead steps running stop the run with ``NoProgress`` (exit status 2), so a
run that trains nothing never "succeeds". One live step resets the count; so does a resume (the
count lives in the process). Both loops (``controller/sync.py``, ``controller/async_.py``)
feed it each update's metrics, after the step's row is logged.
"""

from __future__ import annotations

import math

from diffrl.errors import DiffrlError


class NoProgress(DiffrlError):
    """``run.max_dead_steps`` updates running changed nothing; training stops."""


def dead_cause(metrics: dict[str, float]) -> str | None:
    """Why the update these metrics describe could not move the weights; None if it could, or
    if nothing says it could not (an engine that reports none of these keys is not judged).
    ``ActorEngine.train_step``'s keys: ``actor/grad_norm`` only for an optimizer step taken,
    averaged over the step's minibatches (so 0 means every one of them was 0), else
    ``actor/skipped_nonfinite`` or ``actor/skipped_empty``."""
    norm = metrics.get("actor/grad_norm")
    if norm is not None and math.isfinite(norm) and norm > 0:
        return None
    if norm == 0:
        tied = metrics.get("reward/tied_groups")
        why = f": reward/tied_groups={tied:g}" if tied is not None and math.isfinite(tied) else ""
        return (
            "the gradient norm was exactly 0: every advantage was 0 (each prompt's samples "
            f"scored alike{why})"
        )
    if norm is not None or metrics.get("actor/skipped_nonfinite"):
        return "the loss or gradients were NaN/inf, so the update was skipped"
    if metrics.get("actor/skipped_empty"):
        return "no sample was left to train on (all invalid, or filtered out), so no update"
    return None


class DeadSteps:
    """Counts dead updates running; ``observe`` raises ``NoProgress`` at ``limit`` (0 = off)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        cause = dead_cause(metrics)
        self.count = 0 if cause is None else self.count + 1
        if cause is None or not self.limit or self.count < self.limit:
            return
        raise NoProgress(
            f"steps {step - self.count + 1}..{step} trained nothing (run.max_dead_steps="
            f"{self.limit}); the last because {cause}. Check the scorers and their weights "
            "(reward/* in metrics.jsonl), rollout.group_size and actor.lr; where every group "
            "already scores alike there is nothing left to learn (run.max_dead_steps=0 runs on)"
        )
