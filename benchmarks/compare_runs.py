"""Compare run directories at equal wall time and at equal training samples.

For each run, the held-out accuracy of the last eval at or before the budget (wall minutes
from the run's start, or samples = steps * samples per step); "(stops at step N)" where the
run ended before spending the budget. Prints a Markdown table.

Usage: python benchmarks/compare_runs.py runs/a runs/b ... --minutes 11 20 --samples 4096 8192
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from diffrl.controller.run_dir import read_metrics


def evals(run: Path) -> tuple[list[tuple[int, float, float]], int]:
    """[(step, wall_s, accuracy)] for every eval row, and samples per step."""
    rows = read_metrics(run)
    wall = {r["step"]: r.get("perf/wall_s", 0.0) for r in rows}
    out = [
        (r["step"], wall.get(r["step"], 0.0), r["eval/overall"])
        for r in rows
        if "eval/overall" in r
    ]
    cfg = OmegaConf.load(run / "config.yaml")  # the resolved config the run wrote
    return out, cfg.data.prompts_per_step * cfg.rollout.group_size


def at_budget(points: list[tuple[int, float, float]], limit: float, spent: float) -> str:
    """Accuracy of the last (step, spent, accuracy) point with spent <= limit; a run that spent
    less than `limit` in all has no reading there."""
    if spent < limit:
        return f"(stops at step {points[-1][0]})"
    ok = [p for p in points if p[1] <= limit]
    return f"{ok[-1][2]:.3f} (step {ok[-1][0]})" if ok else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--minutes", nargs="*", type=float, default=[])
    ap.add_argument("--samples", nargs="*", type=int, default=[])
    args = ap.parse_args()
    head = ["run", "base"] + [f"after {m:g} min" for m in args.minutes]
    head += [f"after {s} samples" for s in args.samples] + ["last (step, min)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for run in args.runs:
        pts, per_step = evals(run)
        cells = [run.name, f"{pts[0][2]:.3f}"]
        last_step, wall, last_acc = pts[-1]
        cells += [at_budget(pts, 60 * m, wall) for m in args.minutes]
        by_samples = [(s, s * per_step, a) for s, _, a in pts]
        cells += [at_budget(by_samples, n, last_step * per_step) for n in args.samples]
        cells.append(f"{last_acc:.3f} ({last_step}, {wall / 60:.1f})")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
