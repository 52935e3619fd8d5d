"""The joint audio-video reward at real size on one GPU, random weights: CLAP (audio against
the prompt) and ImageBind (audio against the frames), alone and together in one reward pool,
as seconds per clip with peak memory.

    python benchmarks/av_reward.py --clips 8 --frames 121 --fps 24 --height 288 --width 448
    python benchmarks/av_reward.py --smoke        # tiny sizes on the CPU, to check the script

ImageBind is ``imagebind_huge``'s vision and audio towers (diffrl's network), built on the meta
device and materialised on the GPU with ``to_empty`` and a random init, so no 4.8 GB file is
written. CLAP is transformers' ``ClapModel`` with its default config (HTSAT audio, RoBERTa-base
text: the layout of LAION's clap-htsat checkpoints), randomly initialised and saved with
``save_pretrained`` beside a byte-level tokenizer, because the CLAP scorer loads a directory the
way a user's checkpoint sits on disk. Each scorer does its own preparation inside the timing:
CLAP resamples to 48 kHz; ImageBind resamples to 16 kHz, cuts 3 log-mel windows and samples 5
two-second windows x 3 crops of frame pairs at 224 px.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch

from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
from diffrl.reward.random_weights import clap_dir, random_imagebind
from diffrl.reward.scorer import register_scorer
from diffrl.reward.scorers import build_scorer
from diffrl.reward.scorers.imagebind import ImageBindAVScorer, ImageBindEmbedder
from diffrl.reward.scorers.imagebind_net import ImageBindConfig
from diffrl.types import PromptBatch, Trajectory

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = ["a red ball bounces twice on a wooden floor, each bounce a sharp knock",
           "waves roll onto a pebble beach at dusk, gulls calling"]  # fmt: skip


def sync() -> float:
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def clips(n: int, frames: int, h: int, w: int, fps: float, rate: int) -> Trajectory:
    g = torch.Generator().manual_seed(0)
    samples = round(frames / fps * rate)
    texts = tuple(PROMPTS[i % len(PROMPTS)] for i in range(n))
    prompts = PromptBatch(
        texts=texts,
        input_ids=torch.zeros(n, 1, dtype=torch.long),
        ids_hash=tuple("0" for _ in range(n)),
        prompt_ids=torch.arange(n),
    )
    fields = {
        "video": torch.randint(0, 256, (n, frames, h, w, 3), dtype=torch.uint8, generator=g),
        "fps": torch.full((n,), float(fps)),
        "audio": (torch.rand(n, samples, generator=g) * 2 - 1) * 0.3,
        "sample_rate": torch.full((n,), float(rate)),
    }
    return Trajectory(
        prompts=prompts,
        group=torch.arange(n),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 1),
        sigmas=torch.linspace(1, 0, 2),
        policy_version=0,
        extra_fields=fields,
    )


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: kernels, allocator, resampler filters
    t0 = sync()
    for _ in range(repeats):
        fn()
    return (sync() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clips", type=int, default=8, help="rows per reward call")
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--fps", type=float, default=24.0)
    p.add_argument("--height", type=int, default=288)
    p.add_argument("--width", type=int, default=448)
    p.add_argument("--sample-rate", type=int, default=48_000, help="the rollout's audio rate")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=8, help="rows per scorer forward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = p.parse_args()
    dtype = getattr(torch, "float32" if args.smoke else args.dtype)
    if args.smoke:
        args.clips, args.frames, args.height, args.width = 2, 12, 24, 32
    cfg = (ImageBindConfig.tiny if args.smoke else ImageBindConfig.huge)(
        modalities=("vision", "audio")
    )
    embedder = ImageBindEmbedder(random_imagebind(cfg, DEV, dtype))
    register_scorer("bench_imagebind")(
        lambda **kw: ImageBindAVScorer(embedder=embedder, name="imagebind", **kw)
    )
    traj = clips(args.clips, args.frames, args.height, args.width, args.fps, args.sample_rate)
    with tempfile.TemporaryDirectory() as tmp:
        folder = clap_dir(Path(tmp), tiny=args.smoke)
        clap_params = {"path": str(folder), "device": str(DEV), "dtype": args.dtype}
        if args.smoke:
            clap_params["dtype"] = "float32"
        ib_params = {"batch_size": args.batch_size}
        clap = build_scorer("clap", clap_params)
        imagebind = build_scorer("bench_imagebind", ib_params)
        pool = RewardPool(
            RewardConfig(
                scorers=[
                    ScorerConfig("clap", 0.5, params=clap_params),
                    ScorerConfig("bench_imagebind", 0.5, params=ib_params, label="imagebind"),
                ]
            )
        )
        if DEV.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # all three through asyncio (a worker thread each), as the pool runs scorers
        clap_s = timed(lambda: asyncio.run(clap.score(traj)), args.repeats)
        ib_s = timed(lambda: asyncio.run(imagebind.score(traj)), args.repeats)
        joint_s = timed(lambda: asyncio.run(pool.score(traj)), args.repeats)
        scored, _ = asyncio.run(pool.score(traj))
    row = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        "smoke": args.smoke,
        "clips": args.clips,
        "video": [args.frames, args.height, args.width, args.fps],
        "audio_hz": args.sample_rate,
        "dtype": str(dtype).removeprefix("torch."),
        "imagebind_params_m": round(sum(p.numel() for p in embedder.net.parameters()) / 1e6, 1),
        "clap_s_per_clip": round(clap_s / args.clips, 4),
        "imagebind_s_per_clip": round(ib_s / args.clips, 4),
        "joint_s_per_clip": round(joint_s / args.clips, 4),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if DEV.type == "cuda"
        else 0.0,
        "rewards_finite": bool(torch.isfinite(scored.rewards).all()),
    }
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
