"""Prefetching step k+1's rollout during update k (DiffusionNFT between old-policy refreshes)
gives exactly the results of the strictly sequential loop."""

from __future__ import annotations

import asyncio

from tiny_runs import tiny_run

from diffrl.algorithms.diffusion_nft import NFTConfig, weight_plan
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics


def run(tiny_checkpoint, out_dir, prefetch: bool) -> list[dict]:
    extra = [
        "rollout.num_steps=2",
        "run.eval_every=2",
        f"run.prefetch={str(prefetch).lower()}",
        "actor.lr=1e-2",
    ]
    cfg = load_config("recipes/shapes_nft.yaml", tiny_run(tiny_checkpoint, out_dir, 4, *extra))
    root = asyncio.run(train(cfg))
    rows = read_metrics(root)
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"} for r in rows]


def test_prefetch_matches_sequential(tiny_checkpoint, tmp_path):
    assert run(tiny_checkpoint, tmp_path / "a", True) == run(tiny_checkpoint, tmp_path / "b", False)


def test_nft_says_when_its_rollout_weights_change():
    copy2 = NFTConfig(old_update="copy", old_every=2)
    assert [weight_plan(s, copy2).sync for s in (1, 2, 3, 4)] == [False, True, False, True]
    assert weight_plan(1, NFTConfig(old_update="ema")).sync
