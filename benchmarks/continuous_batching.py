"""Continuous batching on a real-size SD3.5-Medium (random weights, bf16, one GPU): a stream of
single-image requests at mixed resolutions, four ways, in one process:

- ``scheduler``: ``RolloutEngine.batcher`` (continuous batching) fed the stream in its order;
- ``pre-grouped``: the same engine and budget, the requests sorted by shape (full batches);
- ``per-request``: the same engine one request at a time (token budget 1);
- ``diffusers``: ``StableDiffusion3Pipeline`` built from the same components, one call per
  request (it encodes the prompt and the empty negative prompt every call, as it does).

    python benchmarks/continuous_batching.py --requests 256

All four take 10 Euler steps with CFG 4.5 and decode every image with the VAE. Each mode is
warmed up on one request per resolution first. The scheduler's latents are compared with the
per-request mode's (same seeds).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from diffrl.bench.mfu import sync
from diffrl.models.registry import ModelConfig, load_model
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.rollout.scheduler import Request

TEXTS = [
    "a red bicycle leaning against a brick wall",
    "an owl on a branch under the moon",
    "a bowl of ramen on a wooden table",
    "a lighthouse on a cliff in a storm",
]


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def now() -> float:
    return sync(DEV)


def make_requests(fam, n: int, resolutions: list[int], steps: int, scale: int, seed: int):
    """``n`` one-image requests cycling through ``resolutions`` in a fixed shuffled order;
    ``scale``: pixels per latent position (8 for SD3's VAE)."""
    ids = fam.tokenize(TEXTS).input_ids
    c = fam.latent_shape()[0]
    order = [resolutions[k % len(resolutions)] for k in range(n)]
    random.Random(seed).shuffle(order)
    return [
        Request(ids[k % len(TEXTS)], torch.tensor([1000 + k]), (c, r // scale, r // scale), steps)
        for k, r in enumerate(order)
    ]


def fresh(reqs: list[Request]) -> list[Request]:
    return [Request(r.input_ids, r.seeds, r.shape, r.num_steps, rid=k) for k, r in enumerate(reqs)]


def run_batcher(engine: RolloutEngine, reqs: list[Request], budget: int) -> tuple[float, dict]:
    batcher = engine.batcher(token_budget=budget)
    t = now()
    for r in reqs:
        batcher.submit(r)
    out = {f.request.rid: f.x0 for f in batcher.run()}
    return now() - t, {"forwards": batcher.forwards, "x0": out}


def diffusers_pipeline(base, shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    f, toks = base.net.frozen, base.family.tokenizers
    pipe = StableDiffusion3Pipeline(
        transformer=base.net.transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=base.family.vae,
        text_encoder=f.clip_l,
        tokenizer=toks[0],
        text_encoder_2=f.clip_g,
        tokenizer_2=toks[1],
        text_encoder_3=f.t5,
        tokenizer_3=toks[2],
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(
    pipe, base, reqs: list[Request], cfg: float, scale: int, max_seconds: float = 0.0
) -> tuple[float, int]:
    """Seconds and requests done: one pipeline call per request, in the stream's order; with
    ``max_seconds`` > 0 it stops after the call that passes it (a per-request loop's rate over
    a prefix of the shuffled stream stands for the whole)."""
    null = torch.tensor(base.family.null_ids())[None].to(DEV)
    t = now()
    done = 0
    for r in reqs:
        if max_seconds and done and now() - t > max_seconds:
            break
        emb, pooled = base.net.encode_uncached(r.input_ids[None].to(DEV))
        n_emb, n_pooled = base.net.encode_uncached(null)
        side = r.shape[1] * scale
        g = torch.Generator(DEV.type).manual_seed(int(r.seeds[0]))
        pipe(
            prompt_embeds=emb.to(pipe.transformer.dtype),
            pooled_prompt_embeds=pooled.to(pipe.transformer.dtype),
            negative_prompt_embeds=n_emb.to(pipe.transformer.dtype),
            negative_pooled_prompt_embeds=n_pooled.to(pipe.transformer.dtype),
            height=side,
            width=side,
            num_inference_steps=r.num_steps,
            guidance_scale=cfg,
            generator=g,
            output_type="pt",
        ).images.cpu()
        done += 1
    return now() - t, done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--resolutions", type=int, nargs="+", default=[256, 512, 768, 1024])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cfg", type=float, default=4.5)
    p.add_argument("--budget", type=int, default=32768, help="latent positions per forward")
    p.add_argument("--modes", nargs="+", default=["scheduler", "pre-grouped", "per-request",
                                                  "diffusers"])  # fmt: skip
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="the tiny preset, to test the script")
    p.add_argument("--compile", action="store_true", help="rollout.compile: regional compile")
    p.add_argument(
        "--diffusers-seconds",
        type=float,
        default=0.0,
        help="stop the diffusers mode after this long (its rate over the requests done); 0 = all",
    )
    p.add_argument(
        "--cuda-graphs", action="store_true", help="rollout.cuda_graphs: replay captured forwards"
    )
    p.add_argument(
        "--warm-passes",
        type=int,
        default=0,
        help="untimed passes of the stream first, batched modes only (compile each batch shape)",
    )
    args = p.parse_args()
    preset, res, dtype = "sd35-medium", 512, "bfloat16"
    if args.smoke:
        preset, res, dtype = "sd35-tiny", 32, "float32"
        args.requests, args.resolutions, args.steps, args.budget = 6, [32, 64], 2, 256
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    base = load_model(ModelConfig(preset=preset, dtype=dtype, resolution=res), DEV)
    fam = base.family
    engine = RolloutEngine(
        base,
        RolloutConfig(
            num_steps=args.steps,
            cfg_scale=args.cfg,
            compile=args.compile,
            cuda_graphs=args.cuda_graphs,
            graph_cache=64,  # per-request: 4 shapes; the scheduler: every batch size it forms
        ),
        [],
        DEV,
    )  # fused-QKV serving layout, as the rollout runs
    scale = res // fam.latent_shape()[1]
    reqs = make_requests(fam, args.requests, args.resolutions, args.steps, scale, seed=0)
    warm = fresh([next(r for r in reqs if r.shape[1] * scale == px) for px in args.resolutions])
    row = {"requests": len(reqs), "resolutions": args.resolutions, "steps": args.steps,
           "cfg": args.cfg, "budget": args.budget, "compile": args.compile,
           "cuda_graphs": args.cuda_graphs}  # fmt: skip
    results = {}
    for mode in args.modes:
        if mode == "diffusers":
            pipe = diffusers_pipeline(base, engine.cfg.shift)
            run_diffusers(pipe, base, warm, args.cfg, scale)
            secs, done = run_diffusers(pipe, base, reqs, args.cfg, scale, args.diffusers_seconds)
            extra = {"requests_done": done}
        else:
            budget = 1 if mode == "per-request" else args.budget
            t = now()
            run_batcher(engine, warm, budget)
            # one request at a time, every shape is in the warm set; batched, the stream's
            # batch sizes are not
            for _ in range(args.warm_passes if budget > 1 else 0):
                run_batcher(engine, fresh(reqs), budget)
            warm_s = now() - t
            stream = sorted(fresh(reqs), key=lambda r: r.shape) if mode == "pre-grouped" else None
            secs, extra = run_batcher(engine, stream or fresh(reqs), budget)
            extra["warmup_s"] = round(warm_s, 1)
            results[mode] = extra.pop("x0")
        images = extra.get("requests_done", len(reqs))
        row[mode] = {"seconds": round(secs, 2), "images_per_s": round(images / secs, 3),
                     **extra}  # fmt: skip
        print(mode, json.dumps(row[mode]), flush=True)
    if args.compile:
        row["compiled_blocks"] = engine.compiled
    if engine.graphs is not None:
        row["graphs"] = engine.graphs.stats
    if "scheduler" in results and "per-request" in results:
        a, b = results["scheduler"], results["per-request"]
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        scale_ = max(float(b[k].abs().max()) for k in b)
        row["max_abs_latent_diff_vs_per_request"] = round(diff, 4)
        row["max_abs_latent"] = round(scale_, 2)
    ips = {m: row[m]["images_per_s"] for m in args.modes}
    if "scheduler" in ips:
        for m in ips:
            row[f"scheduler_over_{m}"] = round(ips["scheduler"] / ips[m], 3)
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
