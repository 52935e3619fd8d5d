"""End-to-end samples/s of two ways to run the default recipe, one after the other in one
process: the sync and the async controller (``--pair mode``), or the local and the Ray backend
(``--pair backend``), or the update batched after the rollout and streamed beside it
(``--pair stream``, ``run.stream_train``). The scorer is ShapesBench's verifier plus a fixed
``--delay`` per scored batch (an awaited sleep, as a remote or model scorer waits; 0 = none).

    python benchmarks/async_vs_sync.py --steps 12 --delay 0.2
    python benchmarks/async_vs_sync.py --pair backend --steps 12 --delay 0.2
    python benchmarks/async_vs_sync.py --pair backend --channel transferqueue --steps 12
    python benchmarks/async_vs_sync.py --pair stream --steps 12 --delay 0

Both runs use the same seed, steps and threads; async runs with ``run.max_staleness=1``; Ray
starts a local instance (all cores) for its run. samples/s is the run's own
``perf/samples_per_s`` at its last step (eval and start-up excluded: evals run only at step 0
and the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.reward.scorer import register_scorer
from diffrl.tasks.shapes.scorer import ShapesScorer


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


PAIRS = {"mode": ("sync", "async"), "backend": ("local", "ray"), "stream": ("batched", "streamed")}
SETTING = {
    "sync": "run.mode=sync", "async": "run.mode=async", "local": "run.backend=local",
    "ray": "run.backend=ray", "batched": "run.stream_train=false",
    "streamed": "run.stream_train=true",
}  # fmt: skip


def run(variant: str, args, out: str) -> dict:
    over = [
        SETTING[variant],
        "run.max_staleness=1",
        f"run.steps={args.steps}",
        f"run.eval_every={args.steps}",
        f"run.out_dir={out}",
        f"run.name={variant}",
        "run.tensorboard=false",
        f"reward.scorers=[{{name: slow_shapes, params: {{delay_s: {args.delay}}}}}]",
        f"ray.imports=[{Path(__file__).resolve()}]",  # the Ray hosts register slow_shapes too
        f"ray.channel={args.channel}",
    ]
    asyncio.run(train(load_config("recipes/shapes_nft.yaml", over)))
    rows = read_metrics(f"{out}/{variant}")
    last = rows[-1]
    return {"run": variant, "samples_per_s": round(last["perf/samples_per_s"], 3),
            "wall_s": round(last["perf/wall_s"], 1), "steps": last["step"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--delay", type=float, default=0.2, help="seconds of waiting per batch")
    p.add_argument("--pair", choices=sorted(PAIRS), default="mode")
    p.add_argument("--channel", choices=("object_store", "transferqueue"), default="object_store",
                   help="how the Ray run's trajectories travel")  # fmt: skip
    args = p.parse_args()
    base, other = PAIRS[args.pair]
    with tempfile.TemporaryDirectory() as out:
        rows = [run(variant, args, out) for variant in (base, other)]
    for r in rows:
        print(json.dumps(r))
    ratio = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    print(json.dumps({f"{other}_over_{base}": round(ratio, 3)}))


if __name__ == "__main__":
    main()
