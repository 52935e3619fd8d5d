"""Real-size families on one GPU, random weights in bf16: one rollout batch and one LoRA
training step each, with peak memory and times.

    python benchmarks/real_size.py --presets sd35-medium flux1-dev qwen-image wan2.1-1.3b

Each preset is built with random weights on the GPU (meta device, then to_empty), then:
rollout: ``prompts x group`` samples, ``steps`` ODE steps (CFG batched when cfg > 1), VAE
decode; train: one DiffusionNFT update (LoRA r=32 on the family's explicit targets) on those
samples. Prints one JSON line per preset and a table at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time

import torch

from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
from diffrl.algorithms.diffusion_nft import NFTConfig
from diffrl.algorithms.registry import get_algorithm
from diffrl.bench.mfu import matmul_rate
from diffrl.build import expanded_targets
from diffrl.models.registry import ModelConfig, load_model, lora_targets
from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import Prompt, PromptSet

PROMPTS = ["a red bicycle leaning against a brick wall", "an owl on a branch under the moon"]
SHAPE = {  # preset -> (resolution, frames)
    "sd35-medium": (512, 0),
    "flux1-dev": (512, 0),
    "qwen-image": (512, 0),
    "wan2.1-1.3b": (480, 33),
}


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def run_one(preset: str, args) -> dict:
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    res, frames = SHAPE.get(preset, (512, 0))
    t = time.perf_counter()
    mcfg = ModelConfig(preset=preset, dtype="bfloat16", resolution=res, frames=frames)
    torch.manual_seed(0)
    base = load_model(mcfg, dev)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in base.parameters())
    after_build = torch.cuda.max_memory_allocated()
    targets = list(lora_targets(mcfg))
    rcfg = RolloutConfig(
        group_size=args.group, num_steps=args.steps, sampler="ode", cfg_scale=args.cfg,
        max_batch=args.group * args.prompts, base_copy=args.base_copy,
    )  # fmt: skip
    rollout = RolloutEngine(base, rcfg, expanded_targets(base, targets), dev)
    texts = PROMPTS[: args.prompts]
    prompts = PromptSet([Prompt(p) for p in texts], base.family.tokenize).all()
    asyncio.run(rollout.generate(prompts, seed=0, num_steps=1))  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t = time.perf_counter()
    traj = asyncio.run(rollout.generate(prompts, seed=1))
    torch.cuda.synchronize()
    rollout_s = time.perf_counter() - t
    after_rollout = torch.cuda.max_memory_allocated()
    pool = RewardPool(RewardConfig([ScorerConfig(name="jpeg_incompressibility")]))
    scored, _ = asyncio.run(pool.score(traj))
    algo = get_algorithm("diffusion_nft")
    acfg = NFTConfig(timesteps_per_sample=1)
    actor = ActorEngine(
        base,
        ActorConfig(
            lr=1e-4,
            micro_batch=args.micro_batch,
            activation_checkpointing=args.checkpointing,
            lora=AdapterConfig(rank=32),
        ),
        targets, algo, acfg, dev,
    )  # fmt: skip
    batch = algo.prepare(scored, acfg)
    actor.train_step(batch)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    metrics = actor.train_step(batch)
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t
    report = rollout.load_weights(actor.export_weights("default"))
    media = {k: tuple(v.shape) for k, v in traj.extra_fields.items()}
    # MFU: the transformer's analytic FLOPs over the measured bf16 matmul rate. Rollout: every
    # forward row (x2 with CFG), over a time that also holds text encoding and VAE decode.
    # Train (NFT, one timestep per sample): the old policy's forward, the policy's forward, and
    # its backward through frozen weights (input gradients only: one forward's worth).
    rate, fwd = matmul_rate(dev, torch.bfloat16, reps=20), base.family.flops(1)
    rows = len(traj) * (2 if args.cfg > 1 else 1)
    rollout_mfu = rows * args.steps * fwd / rollout_s / rate
    train_mfu = 3 * len(batch) * fwd / train_s / rate
    out = {
        "preset": preset,
        "params_b": round(n_params / 1e9, 3),
        "resolution": res,
        "frames": frames,
        "samples": len(traj),
        "steps": args.steps,
        "cfg": args.cfg,
        "build_s": round(build_s, 1),
        "rollout_s": round(rollout_s, 2),
        "train_step_s": round(train_s, 2),
        "train_samples": len(batch),
        "peak_gib_build": gib(after_build),
        "peak_gib_rollout": gib(after_rollout),
        "peak_gib_total": gib(torch.cuda.max_memory_allocated()),
        "loss": metrics.get("actor/loss"),
        "checkpointing": args.checkpointing,
        "base_copy": args.base_copy or "gpu",
        "micro_batch": args.micro_batch,
        "sync_applied": report.applied,
        "media": media,
        "flops_per_forward_t": round(fwd / 1e12, 2),
        "matmul_tflops": round(rate / 1e12),
        "rollout_mfu": round(rollout_mfu, 3),
        "train_mfu": round(train_mfu, 3),
        "images_per_s": round(len(traj) / rollout_s, 2),
    }
    del rollout, actor, base, traj, scored, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=list(SHAPE))
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cfg", type=float, default=4.5)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--base-copy", default="", help='"cpu": sync base copy in host memory')
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--no-cudnn-sdp", action="store_true", help="disable cuDNN attention")
    args = p.parse_args()
    if args.no_cudnn_sdp:  # FLUX's backward failed in cuDNN's MHA kernel on torch 2.11 (H200)
        torch.backends.cuda.enable_cudnn_sdp(False)
    rows = []
    for preset in args.presets:
        try:
            row = run_one(preset, args)
        except Exception as e:  # one preset's failure must not hide the others' figures
            row = {"preset": preset, "error": f"{type(e).__name__}: {e}"[:400]}
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    keys = ["preset", "params_b", "rollout_s", "train_step_s", "peak_gib_total", "error"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))


if __name__ == "__main__":
    main()
