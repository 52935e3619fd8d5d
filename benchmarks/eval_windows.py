"""Smooth the held-out curves that ``gpu_runs.sh`` prints: the mean eval accuracy of each run
over windows of steps (single evals on 208 samples carry +-3.4 points of sampling noise).

Usage: python benchmarks/eval_windows.py LOG [LOG ...] [--start 100 --width 40 --every 40 --n 7]
Prints a Markdown table: one row per run, one column per window [a, a + width], both ends
included (with --every equal to --width, neighbouring windows share their boundary eval).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def curves(log: Path) -> dict[str, list[tuple[int, float]]]:
    """{run name: [(step, accuracy)]} from the `name [(step, acc), ...] wall Ns` lines."""
    out = {}
    for line in log.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if rest.startswith("[("):
            out[name] = ast.literal_eval(rest[: rest.rindex("]") + 1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--start", type=int, default=100)
    ap.add_argument("--width", type=int, default=40)
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--n", type=int, default=7)
    a = ap.parse_args()
    starts = [a.start + k * a.every for k in range(a.n)]
    print("| run | " + " | ".join(f"{s}-{s + a.width}" for s in starts) + " | last (step) |")
    print("|---" * (len(starts) + 2) + "|")
    for log in a.logs:
        for name, ev in curves(log).items():
            cells = []
            for s in starts:
                v = [acc for step, acc in ev if s <= step <= s + a.width]
                cells.append(f"{sum(v) / len(v):.3f}" if v else "")
            print(f"| {name} | " + " | ".join(cells) + f" | {ev[-1][1]:.3f} ({ev[-1][0]}) |")


if __name__ == "__main__":
    main()
