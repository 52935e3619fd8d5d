"""Async FlowGRPO with rollouts that survive a weight sync (``run.async_sync=step``: an update
that arrives mid-rollout is applied at the next denoising step) against async that finishes
each rollout under the old weights (``batch``), at max_staleness 1 and 2: four runs through
the normal ``diffrl train`` path (``load_config`` + ``controller.loop.train``), one after the
other in one process, one JSON line each.

    PYTHONPATH=. python3 benchmarks/async_midsync.py --steps 8 --staleness 1   # H200, SD3.5-M
    PYTHONPATH=. python3 benchmarks/async_midsync.py --steps 8 --staleness 2   # (one call each)
    PYTHONPATH=. python3 benchmarks/async_midsync.py --smoke                   # CPU, sd35-tiny

The GPU runs use ``benchmarks/recipes/sd35m_grpo_epoch.yaml`` (SD3.5-Medium preset with random
weights, 512 px, 10 steps, CFG 4.5, 8 prompts x 8 images, a rule reward). Per run: images/s
(``perf/samples_per_s`` at the last step: start-up and the evals at step 0 and the end
excluded), the rollout work kept (``async/kept_share``: records trained / records the rollout
finished; ``async/produced``, ``async/dropped``), the mean staleness of the trained records
and of their steps (``async/step_staleness_mean``: how fresh a mid-rollout sync keeps them),
and FlowGRPO's truncated-IS weights (``grpo/tis_*``, step mode only).

A sync lands mid-rollout only when the actor publishes while the rollout samples, i.e. when
the rollout is the longer loop. With all 9 SDE steps trained (the epoch recipe) the update
outlasts the rollout, which then waits at the staleness gate and takes every update between
batches, so both modes would measure the same thing; the runs here train 3 of the 9 steps
(``algorithm.timestep_fraction=0.34``, Flow-GRPO-Fast's budget), ``--set`` overrides it. In
step mode, ``step_staleness_mean`` below ``staleness_mean`` shows that syncs did land mid-rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from statistics import mean

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics

RECIPE = "benchmarks/recipes/sd35m_grpo_epoch.yaml"
SMOKE = [
    "model.preset=sd35-tiny", "model.resolution=64", "model.dtype=float32", "run.device=cpu",
    "data.prompts_per_step=2", "rollout.group_size=2", "rollout.num_steps=3",
    "rollout.max_batch=2", "actor.micro_batch=2",
]  # fmt: skip


def run(sync: str, staleness: int, args, out: str) -> dict:
    name = f"{sync}_s{staleness}"
    over = [
        "run.mode=async",
        f"run.async_sync={sync}",
        f"run.max_staleness={staleness}",
        f"run.steps={args.steps}",
        f"run.eval_every={args.steps}",
        f"run.save_every={args.steps}",
        f"run.out_dir={out}",
        f"run.name={name}",
        "run.tensorboard=false",
        "run.resume=false",
        "algorithm.timestep_fraction=0.34",
        *(SMOKE if args.smoke else []),
        *args.set,
    ]
    asyncio.run(train(load_config(RECIPE, over)))
    rows = [r for r in read_metrics(f"{out}/{name}") if r["step"] > 0]
    last = rows[-1]

    def avg(key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return round(mean(vals), 4) if vals else None

    return {
        "async_sync": sync,
        "max_staleness": staleness,
        "steps": last["step"],
        "images_per_s": round(last["perf/samples_per_s"], 3),
        "wall_s": round(last["perf/wall_s"], 1),
        "kept_share": round(last["async/kept_share"], 4),
        "produced": last["async/produced"],
        "dropped": last["async/dropped"],
        "staleness_mean": round(last["async/staleness_mean"], 4),
        "step_staleness_mean": avg("async/step_staleness_mean"),
        "tis_weight_mean": avg("grpo/tis_weight_mean"),
        "tis_stale_frac": avg("grpo/tis_stale_frac"),
        "reward_mean": avg("reward/mean"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    p.add_argument("--syncs", nargs="+", default=["batch", "step"], choices=["batch", "step"])
    p.add_argument("--smoke", action="store_true", help="CPU, sd35-tiny at 64 px, tiny batches")
    p.add_argument("--out", default="", help="run directories here (default: a temp dir)")
    p.add_argument("--set", nargs="*", default=[], help="more key=value overrides")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in args.staleness:
            for sync in args.syncs:
                print(json.dumps(run(sync, staleness, args, args.out or tmp)), flush=True)


if __name__ == "__main__":
    main()
