"""Credit per modality on AVBench, side by side: one scalar reward against
``algorithm.modality_credit=true``, at equal samples (the same recipe, steps, prompts and group
size), seeds 0 and 1, with the held-out accuracy of each modality's verifiers.

Four runs of ``recipes/av_t2va_nft.yaml`` (or ``--recipe``), named ``<credit>_seed<K>``:

    diffrl train recipes/av_t2va_nft.yaml run.seed=K algorithm.modality_credit=false \\
        run.name=scalar_seedK run.out_dir=OUT run.max_minutes=0
    diffrl train recipes/av_t2va_nft.yaml run.seed=K algorithm.modality_credit=true \\
        run.name=credit_seedK run.out_dir=OUT run.max_minutes=0

then a Markdown table (and, with matplotlib, OUT/modality_credit.png) of each run's eval/* at
the base (step 0) and at its last eval: audio (``eval/text_audio``: pitch and beep count),
video (``eval/visual``: colour and bounce count), joint (``eval/av_sync``) and all
(``eval/overall``), and the two seeds' mean per arm.

Usage:
  python benchmarks/modality_credit.py run OUT [--recipe R] [--seeds 0 1] [--jobs 2] [-- k=v ...]
  python benchmarks/modality_credit.py summary OUT
  python benchmarks/modality_credit.py commands OUT [...]   (print the commands, run nothing)
Overrides after ``--`` go to every run (e.g. run.steps=4 rollout.compile=false for a smoke).
The recipe's 200 steps run whole (its 19.5-minute CPU budget is lifted for equal samples); on a
GPU add ``-- run.device=cuda rollout.compile=false actor.compile=false`` (the recipe's compile
fails on the GPU image, issue 40) and ``--jobs 4`` to run the four side by side.

Smoke run (tiny, 3 steps, CPU), what was checked: the four runs train and the summary and figure
are written; its numbers say nothing about the method (8 held-out clips):
  python benchmarks/modality_credit.py run /tmp/mc_smoke --jobs 2 -- run.steps=3 \
      run.eval_every=3 data.prompts_per_step=2 rollout.group_size=4 rollout.num_steps=4 \
      rollout.eval_num_steps=4 data.eval_samples_per_prompt=2 data.eval_prompts=4 \
      rollout.compile=false actor.compile=false run.threads=1
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from diffrl.controller.run_dir import read_metrics

ARMS = {"scalar": "false", "credit": "true"}
COLUMNS = {  # what each verifier grades, and the key of its held-out accuracy
    "audio": "eval/text_audio",
    "video": "eval/visual",
    "joint": "eval/av_sync",
    "all": "eval/overall",
}
REPO = Path(__file__).resolve().parents[1]


def commands(out: Path, recipe: str, seeds: list[int], extra: list[str]) -> list[list[str]]:
    """One ``diffrl train`` argv per (arm, seed); the arms differ only in the key. The
    recipe's wall budget is lifted (run.max_minutes=0), so both arms run every step: equal
    samples, whatever each step costs."""
    cmds = []
    for seed in seeds:
        for arm, flag in ARMS.items():
            cmds.append(
                [sys.executable, "-m", "diffrl.cli", "train", recipe, f"run.seed={seed}",
                 f"algorithm.modality_credit={flag}", f"run.name={arm}_seed{seed}",
                 f"run.out_dir={out}", "run.max_minutes=0", *extra]
            )  # fmt: skip
    return cmds


def run_all(cmds: list[list[str]], jobs: int) -> None:
    """``jobs`` runs at a time (each run's log under OUT/<name>.log); fails if any run does."""
    pending, running, failed = list(cmds), [], []
    while pending or running:
        while pending and len(running) < jobs:
            cmd = pending.pop(0)
            name = next(a.split("=", 1)[1] for a in cmd if a.startswith("run.name="))
            out = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("run.out_dir=")))
            out.mkdir(parents=True, exist_ok=True)
            log = (out / f"{name}.log").open("w")
            running.append((name, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log), log))
        name, proc, log = running.pop(0)
        if proc.wait() != 0:
            failed.append(name)
        log.close()
    if failed:
        raise SystemExit(f"runs failed (see their .log): {failed}")


def readings(run: Path) -> tuple[dict[str, float], dict[str, float], int]:
    """(base, last) eval/* accuracies of one run, and the last eval's step."""
    evals = [r for r in read_metrics(run) if COLUMNS["all"] in r]
    if not evals:
        raise SystemExit(f"{run}: no held-out eval in metrics.jsonl")
    base = {k: float(evals[0].get(key, float("nan"))) for k, key in COLUMNS.items()}
    last = {k: float(evals[-1].get(key, float("nan"))) for k, key in COLUMNS.items()}
    return base, last, int(evals[-1]["step"])


def summary(out: Path) -> str:
    runs = sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists())
    head = ["run", "step"] + [f"{k} (base -> last)" for k in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    means: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for run in runs:
        base, last, step = readings(run)
        cells = [run.name, str(step)] + [f"{base[k]:.3f} -> {last[k]:.3f}" for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
        arm = run.name.split("_seed")[0]
        if arm in means:
            means[arm].append({k: last[k] - base[k] for k in COLUMNS})
    for arm, gains in means.items():
        if gains:
            mean = {k: sum(g[k] for g in gains) / len(gains) for k in COLUMNS}
            cells = [f"{arm} (mean gain, {len(gains)} seeds)", ""]
            cells += [f"{mean[k]:+.3f}" for k in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    figure(out, runs)
    return "\n".join(lines)


def figure(out: Path, runs: list[Path]) -> None:
    """OUT/modality_credit.png: each column's held-out accuracy over steps, one panel per
    column, scalar vs credit (solid vs dashed), one colour per seed; skipped without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(COLUMNS), figsize=(4 * len(COLUMNS), 3.2), sharey=True)
    for run in runs:
        evals = [r for r in read_metrics(run) if COLUMNS["all"] in r]
        arm, _, seed = run.name.partition("_seed")
        for ax, (col, key) in zip(axes, COLUMNS.items(), strict=True):
            steps = [r["step"] for r in evals if key in r]
            ax.plot(
                steps,
                [r[key] for r in evals if key in r],
                linestyle="-" if arm == "scalar" else "--",
                color=f"C{seed or 0}",
                label=run.name,
            )
            ax.set_title(f"{col} ({key})")
            ax.set_xlabel("step")
    axes[0].set_ylabel("held-out accuracy")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "modality_credit.png", dpi=120)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("run", "summary", "commands"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--recipe", default="recipes/av_t2va_nft.yaml")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    cmds = commands(out, args.recipe, args.seeds, extra)
    if args.what == "commands":
        for cmd in cmds:
            print("diffrl " + " ".join(cmd[3:]))
        return
    if args.what == "run":
        run_all(cmds, args.jobs)
    print(summary(out))


if __name__ == "__main__":
    main()
