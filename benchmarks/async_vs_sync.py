"""End-to-end samples/s of the sync and the async controller, one after the other in one
process, on the default recipe with a slow scorer: ShapesBench's verifier plus a fixed
``--delay`` per scored batch (an awaited sleep, as a remote or model scorer waits).

    python benchmarks/async_vs_sync.py --steps 12 --delay 0.2

Both runs use the same seed, steps and threads; async runs with ``run.max_staleness=1``.
samples/s is the run's own ``perf/samples_per_s`` at its last step (eval excluded: evals run
only at step 0 and the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile

from diffrl.config import load_config
from diffrl.controller.run_dir import read_metrics
from diffrl.controller.sync import train
from diffrl.reward.scorer import register_scorer
from diffrl.reward.scorers.shapes import ShapesScorer


@register_scorer("slow_shapes")
class SlowShapes(ShapesScorer):
    """ShapesBench's verifier, then ``delay_s`` of waiting per batch."""

    def __init__(self, mode: str = "overall", delay_s: float = 0.2) -> None:
        super().__init__(mode)
        self.name, self.delay_s = "slow_shapes", delay_s

    async def score(self, traj):
        result = await super().score(traj)
        await asyncio.sleep(self.delay_s)
        return result


def run(mode: str, args, out: str) -> dict:
    over = [
        f"run.mode={mode}",
        "run.max_staleness=1",
        f"run.steps={args.steps}",
        f"run.eval_every={args.steps}",
        f"run.out_dir={out}",
        f"run.name={mode}",
        "run.tensorboard=false",
        f"reward.scorers=[{{name: slow_shapes, params: {{delay_s: {args.delay}}}}}]",
    ]
    asyncio.run(train(load_config("recipes/shapes_nft.yaml", over)))
    rows = read_metrics(f"{out}/{mode}")
    last = rows[-1]
    return {"mode": mode, "samples_per_s": round(last["perf/samples_per_s"], 3),
            "wall_s": round(last["perf/wall_s"], 1), "steps": last["step"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--delay", type=float, default=0.2, help="seconds of waiting per batch")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        rows = [run(mode, args, out) for mode in ("sync", "async")]
    for r in rows:
        print(json.dumps(r))
    print(
        json.dumps(
            {"async_over_sync": round(rows[1]["samples_per_s"] / rows[0]["samples_per_s"], 3)}
        )
    )


if __name__ == "__main__":
    main()
