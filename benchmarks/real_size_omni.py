"""The omni families at real size on one GPU, random weights in bf16: one FL2VA (MiniMax-H3) or
T2VA (LTX-2) rollout of a few steps and one LoRA DiffusionNFT step, with peak memory and times.

    python benchmarks/real_size_omni.py --presets minimax-h3 ltx2
    python benchmarks/real_size_omni.py --presets minimax-h3 --height 288 --width 448 --bare


MiniMax-H3's DiT alone is 61.9 GB in bf16, so one H200 holds one copy of it: the rollout
samples with the model itself (``RolloutEngine(share_model=True)``: no serving copy, hence no
weight sync), and the actor then trains LoRA on the same weights. Its 32 B Qwen3-VL encoder
lives in host memory and visits the GPU once per prompt (the family's ``offload``), outside
the DiT's training step: it sits in pinned host memory and is streamed to the GPU a layer ahead
of its forward (``models/host_offload.py``). The encode is timed once cold and then, with the
cache emptied, streamed and whole (every layer brought at once), each with its peak memory.
``--bare`` times the bare model's forward+backward (input gradients only, the same
checkpointing, no LoRA) on the rows the LoRA step trains, one sample at a time as the actor's
micro-batch 1, so the step's cost over the model's floor is a ratio in one run. FL2VA's
first/last frames are random pixels encoded by the video VAE
in the data stage (``encode_conditions``), exactly as a task's conditions are.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time

import numpy as np
import torch

from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig, enable_checkpointing
from diffrl.algorithms.diffusion_nft import NFTConfig
from diffrl.algorithms.registry import get_algorithm
from diffrl.models.family import TakesConditions
from diffrl.models.registry import ModelConfig, load_model, lora_targets
from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import Prompt, PromptSet

PROMPTS = ["a red ball bounces twice on a wooden floor, each bounce a sharp knock",
           "waves roll onto a pebble beach at dusk, gulls calling"]  # fmt: skip
SHAPE = {"minimax-h3": (352, 124), "ltx2": (512, 121)}  # preset -> (square px, frames)
# --smoke: the tiny presets on the CPU, to check the script before a GPU call
SMOKE = {"h3-tiny": (32, 8), "ltx2-tiny": (32, 9)}
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def sync() -> float:
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def peak() -> int:
    return torch.cuda.max_memory_allocated() if DEV.type == "cuda" else 0


def reset_peak() -> None:
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


T0 = time.perf_counter()


def stage(preset: str, what: str) -> None:
    """A progress line on stderr, so a run cut by a time limit still says where it was."""
    mem = gib(torch.cuda.memory_allocated()) if DEV.type == "cuda" else 0
    print(f"[{time.perf_counter() - T0:7.1f}s] {preset}: {what} ({mem} GiB)", file=sys.stderr,
          flush=True)  # fmt: skip


def run_one(preset: str, args) -> dict:
    dev = DEV
    stage(preset, "building")
    reset_peak()
    res, frames = {**SHAPE, **SMOKE}[preset]
    h, w = (args.height, args.width) if args.height else (res, res)
    t = time.perf_counter()
    mcfg = ModelConfig(
        preset=preset, dtype="bfloat16", resolution=res, frames=frames,
        height=args.height, width=args.width,
    )  # fmt: skip
    torch.manual_seed(0)
    base = load_model(mcfg, dev)
    build_s = sync() - t
    stage(preset, f"built in {build_s:.0f} s")
    fam = base.family
    dit_params = sum(p.numel() for p in base.net.transformer.parameters())
    cond, mode = None, "t2va"
    if isinstance(fam, TakesConditions):  # FL2VA: first and last frames
        rng = np.random.default_rng(0)
        frames_u8 = rng.integers(0, 256, (len(PROMPTS), 2, h, w, 3), dtype=np.uint8)
        conds = [{"first_frame": f[0], "last_frame": f[1]} for f in frames_u8]
        t = time.perf_counter()
        cond = fam.encode_conditions(conds)
        cond_s, mode = sync() - t, "fl2va"
        stage(preset, "conditions encoded")
    prompts = PromptSet([Prompt(p) for p in PROMPTS], fam.tokenize, cond).all()
    rcfg = RolloutConfig(group_size=1, num_steps=args.steps, sampler="ode", max_batch=8)
    rollout = RolloutEngine(base, rcfg, [], dev, serving_layout=False, share_model=True)
    t = time.perf_counter()
    base.net.conditions(prompts.input_ids.to(dev))  # the text encoder's one visit per prompt
    encode_s = sync() - t
    stage(preset, f"text encoded in {encode_s:.1f} s")
    peak_encode = peak()
    encodes = encode_modes(base, prompts.input_ids.to(dev), preset)
    reset_peak()
    t = time.perf_counter()
    traj = asyncio.run(rollout.generate(prompts, seed=1))
    rollout_s = sync() - t
    stage(preset, f"rollout in {rollout_s:.1f} s")
    peak_rollout = peak()
    pool = RewardPool(RewardConfig([ScorerConfig(name="jpeg_incompressibility")]))
    scored, _ = asyncio.run(pool.score(traj))
    bare = bare_fwd_bwd(base, traj, preset) if args.bare else {}
    algo = get_algorithm("diffusion_nft")
    acfg = NFTConfig(timesteps_per_sample=1)
    reset_peak()
    actor = ActorEngine(
        base,
        ActorConfig(lr=1e-4, micro_batch=1, activation_checkpointing=True,
                    lora=AdapterConfig(rank=32)),
        list(lora_targets(mcfg)), algo, acfg, dev,
    )  # fmt: skip
    batch = algo.prepare(scored, acfg)
    t = time.perf_counter()
    metrics = actor.train_step(batch)
    train_s = sync() - t
    stage(preset, f"train step in {train_s:.1f} s")
    t = time.perf_counter()
    actor.train_step(batch)
    train2_s = sync() - t
    out = {
        "preset": preset,
        "mode": mode,
        "dit_params_b": round(dit_params / 1e9, 2),
        "resolution": res,
        "height": h,
        "width": w,
        "frames": frames,
        "latent_dim": int(fam.latent_shape()[0]),
        "samples": len(traj),
        "steps": args.steps,
        "build_s": round(build_s, 1),
        "conditions_s": round(cond_s, 2) if cond is not None else None,
        "text_encode_s": round(encode_s, 2),
        "rollout_s": round(rollout_s, 2),
        "train_step_s": round(train_s, 2),
        "train_step2_s": round(train2_s, 2),
        "train_samples": len(batch),
        **encodes,
        **bare,
        "step_over_bare": round(train2_s / bare["bare_fwd_bwd_s"], 3) if bare else None,
        "peak_gib_encode": gib(peak_encode),
        "peak_gib_rollout": gib(peak_rollout),
        "peak_gib_train": gib(peak()),
        "text_encoder_device": str(next(base.net.frozen.text_encoder.parameters()).device),
        "loss": metrics.get("actor/loss"),
        "finite": bool(np.isfinite(metrics.get("actor/loss", float("nan")))),
        "media": {k: tuple(v.shape) for k, v in traj.extra_fields.items()},
    }
    del rollout, actor, base, traj, scored, batch
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return out


def encode_modes(base, ids, preset: str) -> dict:
    """The text encode again, the cache emptied, streamed (the default) and whole, with each
    peak; nothing when the encoder is resident (not offloaded)."""
    home = getattr(base.net.frozen, "te_home", None)
    if home is None or not base.net.offload:
        return {"encoder_offload": "resident"}
    out: dict = {"encoder_offload": "host", "encoder_host_gib": gib(home.host_bytes)}
    for stream in (True, False, True):
        home.stream = stream
        base.net.cache.store.clear()
        reset_peak()
        t = time.perf_counter()
        base.net.conditions(ids)
        name = "stream" if stream else "whole"
        out[f"encode_{name}_s"] = round(sync() - t, 2)
        out[f"peak_gib_encode_{name}"] = gib(peak())
        stage(preset, f"encode ({name}) in {out[f'encode_{name}_s']} s")
    home.stream = True
    return out


def bare_fwd_bwd(base, traj, preset: str) -> dict:
    """The model's own forward+backward on the LoRA step's rows (input gradients only, the
    actor's checkpointing, one sample per call as micro-batch 1): the floor a LoRA step pays."""
    enable_checkpointing(base, True)
    x, prompts = traj.x0, traj.prompts
    cond = prompts.cond
    times = []
    for _ in range(2):  # the first call warms the kernels
        t = sync()
        for i in range(x.shape[0]):
            xi = x[i : i + 1].detach().to(DEV, torch.bfloat16).requires_grad_(True)
            sig = torch.full((1,), 0.5, device=DEV)
            ci = cond[i : i + 1].to(DEV) if cond is not None else None
            out = base(xi, sig, prompts.input_ids[i : i + 1], ci)
            out.float().pow(2).mean().backward()
        times.append(sync() - t)
    stage(preset, f"bare forward+backward in {times[-1]:.1f} s")
    return {"bare_fwd_bwd_s": round(times[-1], 2), "bare_samples": int(x.shape[0])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=list(SHAPE))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="the tiny presets, to test the script")
    p.add_argument("--height", type=int, default=0, help="frame height (0: square frames)")
    p.add_argument("--width", type=int, default=0)
    p.add_argument("--bare", action="store_true", help="time the bare forward+backward too")
    p.add_argument("--no-cudnn-sdp", action="store_true", help="disable cuDNN attention")
    args = p.parse_args()
    if args.smoke:
        args.presets = list(SMOKE)
    if args.no_cudnn_sdp:  # cuDNN's backward failed once (FLUX, H200, 2026-12-01); on the H100
        # it ran at every real-size shape, H3's packed sequence at 1.76x FA2 (BENCHMARKS)
        torch.backends.cuda.enable_cudnn_sdp(False)
    rows = []
    for preset in args.presets:
        try:
            row = run_one(preset, args)
        except Exception as e:  # one preset's failure must not hide the other's figures
            row = {"preset": preset, "error": f"{type(e).__name__}: {e}"[:600]}
            gc.collect()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
