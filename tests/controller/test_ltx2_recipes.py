"""LTX-2's FL2VA recipe and its I2AV form at tiny size on CPU: the per-prompt frame latents,
encoded once, frozen and hashed, ride from the prompts through the rollout (which holds each
prompt's first frame) and AVBench's scorer into the update's batch. (test_recipes.py runs
every recipe, ltx2_t2va_nft and ltx2_fl2va_nft included, for two steps of the loop.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from diffrl.config import load_config

pytest.importorskip("diffusers")

RECIPES = Path(__file__).parents[2] / "recipes"
# the recipes' own tiny command (AVBench clips need >= 10 frames; ltx2-tiny's own are 9)
TINY = [
    "model.preset=ltx2-tiny",
    "model.dtype=float32",
    "model.frames=11",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.num_steps=2",
    "data.eval_prompts=2",
    "data.eval_samples_per_prompt=1",
    "run.tensorboard=false",
    "probe.mode=off",
]
I2AV = ["data.task=avbench_i2av", "reward.scorers=[{name: avbench, params: {mode: partial}}]"]


@pytest.mark.parametrize("k, extra", [(2, []), (1, I2AV)], ids=["fl2va", "i2av"])
def test_the_frames_ride_frozen_into_the_update(k, extra, tmp_path) -> None:
    """The data stage's (prompts, K, C, 1, h, w) latents (K = 2 first/last, 1 first), hashed,
    through the rollout (each sample holds its prompt's first frame at latent frame 0) and the
    scorer (FL2VA's grades the frames) into the batch the update trains on."""
    from diffrl.build import build

    cfg = load_config(RECIPES / "ltx2_fl2va_nft.yaml", [*TINY, *extra, f"run.out_dir={tmp_path}"])
    assert cfg.algorithm.old_every == 2 and cfg.model.family == "ltx2"
    parts = build(cfg)
    try:
        prompts = parts.prompts.at(0)
        assert prompts.cond.shape == (2, k, 8, 1, 4, 4) and prompts.cond_hash is not None
        traj = asyncio.run(parts.rollout.generate(prompts, seed=0))
        video = traj.x0[:, : 8 * 6 * 4 * 4].reshape(-1, 8, 6, 4, 4)  # (C, F, h, w) at 11 frames
        torch.testing.assert_close(video[:, :, :1], traj.prompts.cond[:, 0], rtol=0, atol=1e-5)
        scored, metrics = asyncio.run(parts.rewards.score(traj))
        assert ("reward/avbench/frames" in metrics) == (k == 2)  # first and last frames graded
        batch = parts.algorithm.prepare(scored, parts.cfg.algorithm)
        torch.testing.assert_close(batch.cond, traj.prompts.cond, rtol=0, atol=0)
        assert batch.cond_hash == traj.prompts.cond_hash
    finally:
        asyncio.run(parts.aclose())
