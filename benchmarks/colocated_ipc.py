"""The actor and the rollout as two processes on one device, weights over IPC after every
update, against the one-process run, in one script run (issue 39's "Measured" item).

    python benchmarks/colocated_ipc.py --algo nft --steps 6      # SD3.5-M, random weights, 1 GPU
    python benchmarks/colocated_ipc.py --algo grpo --steps 6
    python benchmarks/colocated_ipc.py --tiny --steps 2          # CPU smoke check (sd35-tiny)

- ``one_process``: ``run.backend=local``, every engine in this process (today's default).
- ``ipc``: ``run.backend=ray`` with the actor and rollout pools on half a GPU each, so Ray puts
  both hosts on the one GPU and ``placement.weights=auto`` resolves to CUDA IPC
  (``backends/ray.py``: ``weight_path``); with ``--tiny`` both run on the CPU and the weights
  go through shared memory (``placement.weights=ipc``). The reward pool takes no GPU.

Reports one JSON line per variant: s/epoch (the mean step time after the first step:
start-up, compilation and the first evaluation excluded), and the peak device memory of every
process that held the GPU during the run (``nvidia-smi``'s per-process figure, sampled every
0.2 s: the CUDA context and the caching allocator's reserve included, as the driver sees it;
"n/a" on the CPU). The reward is a weight-free scorer (JPEG incompressibility) so nothing is
downloaded. Not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
import threading
import time

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics

RECIPES = {"nft": "recipes/sd35_nft.yaml", "grpo": "recipes/sd35_grpo.yaml"}


class GpuPeaks:
    """The peak ``used_memory`` (MiB) of each process on the GPUs, sampled in a thread."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.peaks: dict[int, int] = {}
        self.every_s, self.stop = every_s, threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def poll(self) -> None:
        query = [
            "nvidia-smi",
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ]
        while not self.stop.is_set():
            out = subprocess.run(query, capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                pid, mib = (int(x) for x in line.split(","))
                self.peaks[pid] = max(self.peaks.get(pid, 0), mib)
            self.stop.wait(self.every_s)

    def __enter__(self) -> GpuPeaks:
        if shutil.which("nvidia-smi"):
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def overrides(variant: str, args, out: str) -> list[str]:
    over = [
        f"run.steps={args.steps}",
        f"run.eval_every={10 * args.steps}",  # evaluations only at the start and the end
        f"run.save_every={10 * args.steps}",
        f"run.out_dir={out}",
        f"run.name={variant}",
        "run.tensorboard=false",
        "reward.scorers=[{name: jpeg_incompressibility}]",
    ]
    if args.tiny:
        over += ["model.preset=sd35-tiny", "model.resolution=64", "model.dtype=float32",
                 "run.device=cpu", "data.prompts_per_step=2", "rollout.group_size=2"]  # fmt: skip
    else:
        over += ["model.preset=sd35-medium", f"model.resolution={args.resolution}"]
    if variant == "one_process":
        return [*over, "run.backend=local"]
    gpus = 0.0 if args.tiny else 0.5
    return [
        *over, "run.backend=ray", f"placement.actor.gpus={gpus}",
        f"placement.rollout.gpus={gpus}", "placement.reward.gpus=0",
        f"placement.weights={args.weights or ('ipc' if args.tiny else 'auto')}",
    ]  # fmt: skip


def run(variant: str, args, out: str) -> dict:
    with GpuPeaks() as peaks:
        asyncio.run(train(load_config(RECIPES[args.algo], overrides(variant, args, out))))
    rows = [r for r in read_metrics(f"{out}/{variant}") if "perf/wall_s" in r]
    walls = [r["perf/wall_s"] for r in rows]
    s_per_epoch = (walls[-1] - walls[0]) / max(1, len(walls) - 1)
    return {
        "run": variant,
        "algo": args.algo,
        "steps": len(rows),
        "s_per_epoch": round(s_per_epoch, 2),
        "peak_gpu_mib_per_process": peaks.peaks or "n/a",
        "synced_version": rows[-1].get("sync/version"),
        "rewards": [round(r["reward/mean"], 6) for r in rows if "reward/mean" in r],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algo", choices=sorted(RECIPES), default="nft")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--tiny", action="store_true", help="sd35-tiny on the CPU: a smoke check")
    p.add_argument("--weights", default="", help="the two-process run's placement.weights")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        for variant in ("one_process", "ipc"):
            start = time.time()
            row = run(variant, args, out)
            print(json.dumps({**row, "total_s": round(time.time() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
