"""A mixed stream through the training rollout on a real-size SD3.5-Medium (random weights,
bf16, one GPU): requests of 3 resolutions and 2 step counts, each one prompt's group of G
samples, sampled as FlowGRPO samples them (SDE steps with per-step log-probs, latents kept,
CFG, every image decoded), three ways in one process:

- ``packed``: the scheduler with ``rollout.packed``: every shape in one forward (sequence
  packing, block-diagonal attention), one token budget;
- ``bucketed``: the scheduler with a bucket per shape (the budget per bucket, one bucket per
  forward), fed the same stream in its order;
- ``pre-grouped``: the ceiling: the bucketed scheduler fed the stream sorted by shape and step
  count, so every forward is a full batch of one kind.

    python benchmarks/mixed_stream.py                 # the GPU run (H100/H200)
    python benchmarks/mixed_stream.py --smoke         # tiny SD3 on the CPU, to test the script

Each mode first runs the stream once untimed (warm-up: kernels, allocator, encoder cache).
How much packing gains depends on how full each shape's bucket gets (requests per shape in
flight against the budget): the row records the stream's composition with the figures.
The packed mode's trajectories are compared with the bucketed mode's (same seeds): the largest
difference of latents and of log-probs is printed, with the attention backend that ran. The
last line is one JSON row: images/s per mode and the ratios the issue's bars are about
(``packed_over_bucketed`` >= 1.5, ``packed_over_pre_grouped`` >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's diffrl

from diffrl.bench.mfu import sync  # noqa: E402
from diffrl.models.registry import ModelConfig, load_model  # noqa: E402
from diffrl.rollout.engine import RolloutConfig, RolloutEngine, sample_seeds  # noqa: E402
from diffrl.rollout.scheduled import step_plan, training_request  # noqa: E402
from diffrl.rollout.scheduler import Finished, Request  # noqa: E402

TEXTS = [
    "a red bicycle leaning against a brick wall",
    "an owl on a branch under the moon",
    "a bowl of ramen on a wooden table",
    "a lighthouse on a cliff in a storm",
]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stream(engine: RolloutEngine, args, scale: int) -> list[Request]:
    """``args.requests`` FlowGRPO requests of G samples, cycling through every (resolution,
    step count) pair in a fixed shuffled order; ``scale``: pixels per latent position."""
    fam = engine.family
    ids = fam.tokenize(TEXTS).input_ids
    c = fam.latent_shape()[0]
    kinds = [(r, s) for r in args.resolutions for s in args.steps]
    order = [kinds[k % len(kinds)] for k in range(args.requests)]
    random.Random(0).shuffle(order)
    plans = {s: step_plan(engine, s, "sde", iteration=0, seed=0) for s in args.steps}
    return [
        training_request(
            engine,
            ids[k % len(TEXTS)],
            sample_seeds(1000 + k, args.group),
            (c, r // scale, r // scale),
            *plans[s],
            rid=k,
        )  # fmt: skip
        for k, (r, s) in enumerate(order)
    ]


def requests(engine: RolloutEngine, args, scale: int, grouped: bool) -> list[Request]:
    """The stream, fresh (requests are consumed), or sorted by (shape, step count)."""
    s = stream(engine, args, scale)
    return sorted(s, key=lambda r: (r.shape, r.num_steps)) if grouped else s


def run(engine: RolloutEngine, reqs: list[Request], budget: int, packed: bool):
    batcher = engine.batcher(token_budget=budget, packed=packed)
    for r in reqs:
        batcher.submit(r)
    t = sync(DEV)
    done: dict[int, Finished] = {f.request.rid: f for f in batcher.run()}
    return sync(DEV) - t, batcher.forwards, done


def main() -> None:
    p = argparse.ArgumentParser()
    # default: two of the FlowGRPO epochs (8 prompts x 8 images), spread over 3
    # resolutions and 2 step counts
    p.add_argument("--requests", type=int, default=16, help="prompts (groups) in the stream")
    p.add_argument("--group", type=int, default=8, help="G samples per prompt")
    p.add_argument("--resolutions", type=int, nargs="+", default=[256, 384, 512])
    p.add_argument("--steps", type=int, nargs="+", default=[10, 6])
    p.add_argument("--cfg", type=float, default=4.5)
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--budget", type=int, default=16 * 64 * 64,
                   help="latent positions per forward (default: 16 samples at 512 px)")  # fmt: skip
    p.add_argument("--attention", default="bylength", help="rollout.packed_attention")
    p.add_argument("--modes", nargs="+", default=["packed", "bucketed", "pre-grouped"])
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="tiny SD3 on the CPU, to test the script")
    args = p.parse_args()
    preset, res, dtype = "sd35-medium", 512, "bfloat16"
    if args.smoke:
        preset, res, dtype = "sd35-tiny", 32, "float32"
        args.requests, args.group, args.resolutions, args.steps = 4, 2, [32, 48, 64], [3, 2]
        args.budget = 4 * 8 * 8
    # as the other SD3.5 benchmarks: FlashAttention through SDPA, both modes alike
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    base = load_model(ModelConfig(preset=preset, dtype=dtype, resolution=res), DEV)
    cfg = RolloutConfig(
        sampler="sde", noise_level=args.noise_level, cfg_scale=args.cfg, keep_latents=True,
        packed_attention=args.attention,
    )  # fmt: skip
    engine = RolloutEngine(base, cfg, [], DEV)  # fused-QKV serving layout, as training runs
    scale = res // base.family.latent_shape()[1]
    row: dict = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        "preset": preset, "requests": args.requests, "group": args.group,
        "resolutions": args.resolutions, "steps": args.steps, "cfg": args.cfg,
        "budget": args.budget, "attention": args.attention, "sampler": "sde (flow_grpo)",
    }  # fmt: skip
    got = {}
    for mode in args.modes:
        packed = mode == "packed"

        grouped = mode == "pre-grouped"
        warm_s, _, _ = run(engine, requests(engine, args, scale, grouped), args.budget, packed)
        reqs = requests(engine, args, scale, grouped)
        secs, forwards, done = run(engine, reqs, args.budget, packed)
        images = args.requests * args.group
        row[mode] = {"seconds": round(secs, 3), "images_per_s": round(images / secs, 3),
                     "forwards": forwards, "warmup_s": round(warm_s, 2)}  # fmt: skip
        got[mode] = done
        print(mode, json.dumps(row[mode]), flush=True)
    if "packed" in got and "bucketed" in got:
        a, b = got["packed"], got["bucketed"]
        row["max_abs_x0_diff"] = max(float((a[k].x0 - b[k].x0).abs().max()) for k in a)
        row["max_abs_log_prob_diff"] = max(
            float((a[k].log_probs - b[k].log_probs).abs().max())
            for k in a  # type: ignore[operator]
        )
        row["max_abs_x0"] = max(float(b[k].x0.abs().max()) for k in b)
    ips = {m: row[m]["images_per_s"] for m in args.modes}
    if "packed" in ips:
        for m in ips:
            if m != "packed":
                row[f"packed_over_{m.replace('-', '_')}"] = round(ips["packed"] / ips[m], 3)
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
