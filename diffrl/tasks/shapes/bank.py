"""ShapesBench's pre-training data: banks of ground-truth renders per caption, with optional
near-miss captions (one word changed) standing in for loosely captioned web data, so a base
model learns image quality but follows prompts only partly (``diffrl pretrain``)."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from diffrl.tasks.shapes.prompts import ShapesPrompt, all_prompts
from diffrl.tasks.shapes.render import render


def near_misses(prompt: ShapesPrompt) -> list[ShapesPrompt]:
    """Prompts of the same category whose text differs from ``prompt`` in exactly one word."""
    words = prompt.text.split()
    return [
        q
        for q in all_prompts()
        if q.category == prompt.category
        and q != prompt
        and len(qw := q.text.split()) == len(words)
        and sum(a != b for a, b in zip(words, qw, strict=True)) == 1
    ]


def _render_many(args) -> np.ndarray:
    prompt, n, seed, noise = args
    rng = np.random.default_rng(seed)
    misses = near_misses(prompt) if noise > 0 else []
    drawn = [
        misses[rng.integers(len(misses))] if misses and rng.random() < noise else prompt
        for _ in range(n)
    ]
    return np.stack([render(p, rng) for p in drawn])


def render_bank(
    prompts, per_prompt: int, seed: int, workers: int, caption_noise: float = 0.0
) -> torch.Tensor:
    """(len(prompts), per_prompt, H, W, 3) uint8 images for each caption, rendered in parallel
    once so the training loop is not bound by the (CPU) renderer."""
    jobs = [(p, per_prompt, seed * 100_003 + i, caption_noise) for i, p in enumerate(prompts)]
    workers = workers or os.cpu_count() or 1
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(_render_many, jobs, chunksize=4))
    else:
        parts = [_render_many(j) for j in jobs]
    return torch.from_numpy(np.stack(parts))
