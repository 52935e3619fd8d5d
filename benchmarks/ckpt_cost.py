"""What activation checkpointing (`actor.activation_checkpointing`) costs and saves on one
training pass: forward and backward of a random-weight SD3.5-Medium (bf16, 512 px, eager),
frozen weights with a gradient on the input (what a LoRA update back-propagates through), over
ROWS rows, with and without the transformer's checkpointing, in one process.

    python benchmarks/ckpt_cost.py [--rows 16] [--repeats 3]

Prints one JSON row: seconds per pass and peak GPU memory each way, and their ratios.
``--smoke`` runs the sd35-tiny preset on the CPU (to test the script).
"""

from __future__ import annotations

import argparse
import json

import torch

from diffrl.actor.engine import enable_checkpointing
from diffrl.bench.mfu import sync
from diffrl.models.registry import ModelConfig, load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    preset, res, dtype = ("sd35-tiny", 64, "float32") if args.smoke else ("sd35-medium", 512,
                                                                          "bfloat16")  # fmt: skip
    model = load_model(ModelConfig(preset=preset, dtype=dtype, resolution=res), dev)
    model.requires_grad_(False)
    fam = model.family
    ids = fam.tokenize(["a red bicycle leaning against a brick wall"] * args.rows).input_ids
    x0 = torch.randn(args.rows, *fam.latent_shape(), device=dev, dtype=getattr(torch, dtype))
    sigma = torch.full((args.rows,), 0.5, device=dev)

    def one_pass() -> None:
        x = x0.clone().requires_grad_(True)
        model(x, sigma, ids).float().square().mean().backward()

    row = {"preset": preset, "resolution": res, "rows": args.rows, "device": str(dev)}
    for mode in ("plain", "checkpointed"):
        if mode == "checkpointed":
            enable_checkpointing(model, True)
        one_pass()  # warm-up (and the text conditions into the cache)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = sync(dev)
        for _ in range(args.repeats):
            one_pass()
        secs = (sync(dev) - t) / args.repeats
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
        row[mode] = {"seconds": round(secs, 4), "peak_gib": round(peak, 2)}
    row["time_ratio"] = round(row["checkpointed"]["seconds"] / row["plain"]["seconds"], 3)
    if dev.type == "cuda":
        row["memory_ratio"] = round(row["checkpointed"]["peak_gib"] / row["plain"]["peak_gib"], 3)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
