"""Held-out evaluation on ShapesBench: fixed eval prompts, fixed noise, ODE sampling."""

from __future__ import annotations

import numpy as np

from diffrl.data.prompts import PromptSet
from diffrl.data.shapes import category_accuracy, parse_prompt, score_batch
from diffrl.rollout.engine import RolloutEngine


async def evaluate(
    engine: RolloutEngine, eval_set: PromptSet, samples_per_prompt: int, seed: int, num_steps: int
):
    """-> (metrics {"eval/overall", "eval/<category>"}, images (N,H,W,3), texts, ok)."""
    traj = await engine.generate(
        eval_set.all(), seed, group_size=samples_per_prompt, sampler="ode", num_steps=num_steps
    )
    images = traj.extra_fields["image"].numpy()
    prompts = [parse_prompt(t) for t in traj.prompts.texts]
    verdicts = score_batch(images, prompts)
    acc = category_accuracy(verdicts, prompts)
    metrics = {f"eval/{k}": float(v) for k, v in acc.items()}
    return metrics, images, list(traj.prompts.texts), [bool(v.overall) for v in verdicts]


def grid_pick(texts: list[str], per_prompt: int, n: int = 32) -> np.ndarray:
    """One sample per prompt (the first of its group), at most n: indices into the batch."""
    return np.arange(0, len(texts), per_prompt)[:n]
