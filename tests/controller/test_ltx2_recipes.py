"""LTX-2's AVBench recipes (T2VA, FL2VA) at tiny size on CPU through the real loop: two
DiffusionNFT steps train the adapter with finite numbers; FL2VA and its I2AV form carry the
per-prompt frame latents, encoded once, frozen and hashed, from the prompts to the update."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics

pytest.importorskip("diffusers")

RECIPES = Path(__file__).parents[2] / "recipes"
# the recipes' own tiny command (AVBench clips need >= 10 frames; ltx2-tiny's own are 9)
TINY = [
    "model.preset=ltx2-tiny",
    "model.dtype=float32",
    "model.frames=11",
    "run.steps=2",
    "run.eval_every=2",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.num_steps=2",
    "rollout.eval_num_steps=2",
    "data.eval_prompts=2",
    "data.eval_samples_per_prompt=1",
    "run.tensorboard=false",
    "probe.mode=off",  # the parity probe is test_ltx2's; random weights cannot decide the other
]
I2AV = ["data.task=avbench_i2av", "reward.scorers=[{name: avbench, params: {mode: partial}}]"]


@pytest.mark.parametrize(
    "recipe, frames_check", [("ltx2_t2va_nft", False), ("ltx2_fl2va_nft", True)]
)
def test_two_steps_of_the_ltx2_recipes(recipe, frames_check, tmp_path) -> None:
    cfg = load_config(RECIPES / f"{recipe}.yaml", [*TINY, f"run.out_dir={tmp_path}"])
    assert cfg.algorithm.old_every == 2 and cfg.model.family == "ltx2"
    root = asyncio.run(train(cfg))
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:  # non-finite values are written as null, so None fails here too
        numbers = {k: v for k, v in row.items() if k.startswith(("actor/", "nft/", "reward/"))}
        assert numbers and all(v is not None and math.isfinite(v) for v in numbers.values()), row
        assert row["actor/grad_norm"] > 0  # the adapter received gradient
    for row in (rows[0], rows[2]):  # held-out eval before training and at the end
        assert 0.0 <= row["eval/overall"] <= 1.0
        assert ("eval/frames" in row) == frames_check


@pytest.mark.parametrize("k, extra", [(2, []), (1, I2AV)], ids=["fl2va", "i2av"])
def test_the_frames_ride_frozen_into_the_update(k, extra, tmp_path) -> None:
    """The data stage's (prompts, K, C, 1, h, w) latents (K = 2 first/last, 1 first), hashed,
    through the rollout (each sample holds its prompt's first frame at latent frame 0) into
    the batch the update trains on."""
    from diffrl.build import build

    over = [*TINY, *extra, f"run.out_dir={tmp_path}"]
    parts = build(load_config(RECIPES / "ltx2_fl2va_nft.yaml", over))
    try:
        prompts = parts.prompts.at(0)
        assert prompts.cond.shape == (2, k, 8, 1, 4, 4) and prompts.cond_hash is not None
        traj = asyncio.run(parts.rollout.generate(prompts, seed=0))
        video = traj.x0[:, : 8 * 6 * 4 * 4].reshape(-1, 8, 6, 4, 4)  # (C, F, h, w) at 11 frames
        torch.testing.assert_close(video[:, :, :1], traj.prompts.cond[:, 0], rtol=0, atol=1e-5)
        scored, _ = asyncio.run(parts.rewards.score(traj))
        batch = parts.algorithm.prepare(scored, parts.cfg.algorithm)
        torch.testing.assert_close(batch.cond, traj.prompts.cond, rtol=0, atol=0)
        assert batch.cond_hash == traj.prompts.cond_hash
    finally:
        asyncio.run(parts.aclose())
