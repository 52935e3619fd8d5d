"""Reward/rollout overlap on the default recipe with a slow scorer.

The sync controller streams each rollout micro-batch through the channel into the reward
pool, so scoring micro-batch i overlaps generating micro-batch i+1 (on-policy semantics are
unchanged: every sample of step k is generated with the same weights, and the update waits
for all scores). This script measures generate+score wall time per step with and without
that overlap, using the ShapesBench verifier behind an artificial per-call latency.

With ``--loop N`` it also times N whole training steps (rollout, scoring, NFT update) with
and without cross-step prefetch: between old-policy refreshes the next step's rollout and
scoring run while the current update trains.

Usage: python benchmarks/overlap.py [--latency 0.2] [--steps 3] [--max-batch 32] [--loop 6]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from diffrl.build import build
from diffrl.channel import Channel
from diffrl.config import load_config
from diffrl.controller.run_dir import read_metrics
from diffrl.controller.sync import rollout_and_score
from diffrl.reward.scorer import register_scorer
from diffrl.tasks.shapes.scorer import ShapesScorer


@register_scorer("slow_shapes")
class SlowShapes(ShapesScorer):
    """The ShapesBench verifier plus a fixed network-like latency per call."""

    def __init__(self, latency_s: float = 0.2, mode: str = "partial") -> None:
        super().__init__(mode)
        self.name, self.latency_s = "slow_shapes", latency_s

    async def score(self, traj):
        await asyncio.sleep(self.latency_s)
        return await super().score(traj)


async def sequential(parts, step: int):
    """Baseline: generate every micro-batch first, then score them one by one."""
    channel = Channel()
    await parts.rollout.stream(parts.prompts.at(step), seed=step, channel=channel)
    return [await parts.rewards.score(t) async for t in channel]


async def main(args) -> None:
    scorer = f"[{{name: slow_shapes, params: {{latency_s: {args.latency}}}}}]"
    cfg = load_config(
        "recipes/shapes_nft.yaml",
        [f"reward.scorers={scorer}", f"rollout.max_batch={args.max_batch}", "probe.mode=off"],
    )
    parts = build(cfg)
    adapter = parts.algorithm.weight_plan(1, cfg.algorithm).rollout_adapter
    parts.rollout.load_weights(parts.actor.export_weights(adapter))
    await rollout_and_score(parts, 999)  # warm-up
    times = {"sequential": [], "overlapped": []}
    for step in range(args.steps):
        for name, fn in (("sequential", sequential), ("overlapped", rollout_and_score)):
            t = time.perf_counter()
            await fn(parts, step)
            times[name].append(time.perf_counter() - t)
    seq, ovl = (sum(times[k]) / len(times[k]) for k in ("sequential", "overlapped"))
    chunks = -(-cfg.data.prompts_per_step * cfg.rollout.group_size // args.max_batch)
    print(
        f"latency {args.latency}s/call, {chunks} micro-batches of {args.max_batch}: "
        f"sequential {seq:.2f}s/step, overlapped {ovl:.2f}s/step, saved {seq - ovl:.2f}s "
        f"({100 * (seq - ovl) / seq:.0f}%)"
    )


def loop(args) -> None:
    """Whole training steps, prefetch off vs on (fresh run directories each)."""
    import tempfile

    from diffrl.controller.loop import train

    scorer = f"[{{name: slow_shapes, params: {{latency_s: {args.latency}}}}}]"
    for prefetch in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(
                "recipes/shapes_nft.yaml",
                [
                    f"reward.scorers={scorer}",
                    f"rollout.max_batch={args.max_batch}",
                    f"run.steps={args.loop}",
                    "run.eval_every=1000",
                    "run.save_every=1000",
                    f"run.out_dir={tmp}",
                    "run.tensorboard=false",
                    f"run.prefetch={prefetch}",
                ],
            )
            root = asyncio.run(train(cfg))
            rows = read_metrics(root)
            wall = [r["perf/wall_s"] for r in rows if "perf/wall_s" in r]
        per_step = (wall[-1] - wall[0]) / (len(wall) - 1)  # steps 2..N: no eval, no start-up
        print(f"loop, prefetch={prefetch}: {per_step:.2f} s/step (steps 2..{args.loop})")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--latency", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--loop", type=int, default=0, help="also time N whole training steps")
    a = p.parse_args()
    asyncio.run(main(a))
    if a.loop:
        loop(a)
