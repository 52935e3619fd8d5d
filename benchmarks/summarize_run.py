"""Summarise a run directory: base vs final held-out accuracy, wall time, samples/s.

Usage: python benchmarks/summarize_run.py runs/shapes_nft [more run dirs...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from diffrl.controller.run_dir import read_metrics


def summarize(run: Path) -> dict:
    rows = read_metrics(run)
    evals = [(r["step"], r["eval/overall"]) for r in rows if "eval/overall" in r]
    last = rows[-1]
    return {
        "run": run.name,
        "steps": last["step"],
        "base_acc": evals[0][1],
        "final_acc": evals[-1][1],
        "gain_pts": 100 * (evals[-1][1] - evals[0][1]),
        "best_acc": max(a for _, a in evals),
        "wall_min": last.get("perf/wall_s", float("nan")) / 60,
        "samples_per_s": last.get("perf/samples_per_s", float("nan")),
        "evals": evals,
        "final_categories": {
            k[5:]: round(v, 3) for k, v in rows[-1].items() if k.startswith("eval/")
        },
    }


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        s = summarize(Path(arg))
        print(json.dumps(s, default=lambda x: round(x, 4) if isinstance(x, float) else x))
