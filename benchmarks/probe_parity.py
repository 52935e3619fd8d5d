"""Contract 1's start-up probe at real size, random weights in bf16, one GPU: for each preset,
the pipeline-parity probe (the family's own diffusers pipeline against diffrl's rollout path,
two transformer calls each) and the reconstruction probe (synthetic images through the
family's encoder), timed against the model's build time.

    python benchmarks/probe_parity.py --presets sd35-medium flux1-dev qwen-image wan2.1-1.3b
    python benchmarks/probe_parity.py --smoke   # the tiny presets on the CPU

Each preset runs in its own process (one real-size model at a time, all memory returned in
between); one JSON line per preset goes to ``--out`` and stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

# preset -> (square px, frames): the recipes' sizes (real_size.py, real_size_omni.py)
SHAPE = {
    "sd35-medium": (512, 0),
    "flux1-dev": (512, 0),
    "qwen-image": (512, 0),
    "wan2.1-1.3b": (480, 33),
    "ltx2": (512, 121),
    "minimax-h3": (352, 124),
}
SMOKE = {
    "sd35-tiny": (0, 0),
    "flux1-tiny": (0, 0),
    "qwen-image-tiny": (0, 0),
    "wan-tiny": (0, 0),
    "ltx2-tiny": (32, 9),
    "h3-tiny": (32, 8),
}
STEPS, SHIFT = 10, 3.0  # the image and video recipes' rollout (num_steps, shift)


def run_one(preset: str, dtype: str, reconstruction: bool = True) -> dict:
    from diffrl.build import reconstruction_probe
    from diffrl.models.probe import pipeline_parity
    from diffrl.models.registry import ModelConfig, load_model
    from diffrl.rollout.samplers import euler_step, sigma_schedule
    from diffrl.tasks import TaskConfig, build_task

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    res, frames = {**SHAPE, **SMOKE}[preset]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = time.perf_counter()
    dtype = dtype or ("bfloat16" if cuda else "float32")
    model = load_model(ModelConfig(preset=preset, dtype=dtype, resolution=res, frames=frames), dev)
    sync()
    build_s = time.perf_counter() - t
    row = {"preset": preset, "dtype": dtype, "build_s": round(build_s, 2), "device": str(dev)}
    row["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
    t = time.perf_counter()
    report = pipeline_parity(model, sigma_schedule, euler_step, STEPS, SHIFT, "a red bicycle")
    sync()
    row |= {
        "parity_s": round(time.perf_counter() - t, 2),
        "parity_calls": report.calls,
        "parity_worst_frac": round(report.worst, 4),
        "parity_inputs": list(report.inputs),
    }
    if not reconstruction:
        return row
    t = time.perf_counter()
    recon = reconstruction_probe(build_task(TaskConfig(task="prompts")), model)
    sync()
    row["reconstruction_s"] = round(time.perf_counter() - t, 2)
    row["reconstruction_conclusive"] = bool(recon and recon.conclusive)
    if cuda:
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    row["probe_over_build"] = round((row["parity_s"] + row["reconstruction_s"]) / build_s, 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=list(SHAPE))
    p.add_argument("--smoke", action="store_true", help="the tiny presets on the CPU")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # the per-preset child
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--dtype", default="", help="bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--parity-only", action="store_true", help="skip the reconstruction probe")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.one:
        row = run_one(args.one, args.dtype, not args.parity_only)
        print("ROW " + json.dumps(row), flush=True)
        return
    presets = list(SMOKE) if args.smoke else args.presets
    for preset in presets:
        cmd = [sys.executable, __file__, "--one", preset, "--dtype", args.dtype]
        cmd += ["--parity-only"] if args.parity_only else []
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            rows = [ln[4:] for ln in done.stdout.splitlines() if ln.startswith("ROW ")]
            row = (
                json.loads(rows[-1])
                if rows
                else {"preset": preset, "error": (done.stderr or done.stdout)[-1500:]}
            )
        except subprocess.TimeoutExpired:
            row = {"preset": preset, "error": f"timed out after {args.timeout} s"}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
