"""``diffrl bench rollout|train|epoch [RECIPE] [key=value ...]``: what the engines a recipe
builds do per second, and at what MFU.

- ``rollout``: one step's prompts x G through the rollout engine, after a warm-up, ``repeats``
  times; images (or clips) per second, latency per sampler step, MFU. The baseline, in the
  same process, is the plain loop: one prompt per call as a diffusers pipeline runs it (its G
  images batched, CFG batched, the prompt encoded afresh every call), on the model as loaded
  (no serving layout).
- ``train``: the actor's update on one scored rollout, ``repeats`` times.
- ``epoch``: rollout, scoring and update, as the training loop runs one step.

MFU = useful FLOPs / seconds / peak. FLOPs come from the family's analytic count (checked against
torch's FLOP counter in tests/models/test_flops.py). The peak is the matmul rate measured here,
in the model's dtype. Rollout: every forward row (x2 with CFG) at every step. Train, per trained
timestep of a sample: the policy's forward and its backward through frozen weights (input
gradients only, one forward's worth), plus each no-grad forward the loss makes: NFT's old
policy, a KL reference, DPO's reference.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import torch

from diffrl.config import Config
from diffrl.controller.engines import Engines, build
from diffrl.controller.sync import rollout_and_score
from diffrl.errors import ConfigError
from diffrl.models.registry import load_model
from diffrl.rollout.engine import RolloutEngine

KINDS = ("rollout", "train", "epoch")


@dataclass
class BenchResult:
    kind: str
    seconds: float  # mean over repeats
    samples: int
    flops: float  # useful FLOPs of one repeat
    peak_flops: float  # measured matmul rate, FLOP/s
    steps: int  # sampler steps (rollout, epoch)
    baseline_seconds: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def mfu(self) -> float:
        return self.flops / self.seconds / self.peak_flops

    def rows(self) -> dict[str, float]:
        out = {
            f"bench/{self.kind}/seconds": self.seconds,
            f"bench/{self.kind}/samples_per_s": self.samples_per_s,
            f"bench/{self.kind}/mfu": self.mfu,
            "bench/peak_tflops": self.peak_flops / 1e12,
        }
        if self.steps:
            out[f"bench/{self.kind}/step_latency_s"] = self.seconds / self.steps
        if self.baseline_seconds is not None:
            out[f"bench/{self.kind}/baseline_samples_per_s"] = self.samples / self.baseline_seconds
            out[f"bench/{self.kind}/speedup"] = self.baseline_seconds / self.seconds
        return out


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 0, reps: int = 10) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` here: the MFU denominator."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    t = sync(device)
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (sync(device) - t)


def forwards_per_trained_sample(cfg: Config, batch) -> float:
    """Forward-equivalents per sample of one update on ``batch`` (see the module docstring)."""
    a, name = cfg.algorithm, cfg.algorithm.name
    kl = 1 if getattr(a, "kl_coef", 0) > 0 else 0
    if name == "diffusion_nft":
        return a.timesteps_per_sample * (3 + kl)  # old, policy forward, its backward
    if name == "diffusion_dpo":
        return a.timesteps_per_pair * 3  # policy forward + backward, reference
    if name == "flow_grpo":  # a fraction of the trajectory's SDE steps, as train_steps draws
        trained = max(1, round(a.timestep_fraction * int(batch.sde_mask.sum())))
        return trained * (2 + kl)
    raise ConfigError(f"diffrl bench: no FLOP model for algorithm {name!r}")


def rollout_flops(parts: Engines, samples: int) -> tuple[float, int]:
    r = parts.cfg.rollout
    rows = samples * (2 if r.cfg_scale > 1 else 1)
    return rows * r.num_steps * parts.rollout.family.flops(1), r.num_steps


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: kernels, allocator, caches
    total = 0.0
    for _ in range(repeats):
        t = sync(device)
        fn()
        total += sync(device) - t
    return total / repeats


def bench(kind: str, cfg: Config, repeats: int = 3, baseline: bool = True) -> BenchResult:
    if kind not in KINDS:
        raise ConfigError(f"diffrl bench: kind must be one of {KINDS}, got {kind!r}")
    if repeats < 1:
        raise ConfigError(f"diffrl bench: repeats must be >= 1, got {repeats}")
    parts = build(cfg)
    dev, fam = parts.device, parts.rollout.family
    dtype = next(parts.rollout.model.parameters()).dtype
    peak = matmul_rate(dev, dtype)
    prompts = parts.prompts.at(0)
    n = len(prompts) * cfg.rollout.group_size

    def rollout() -> None:
        asyncio.run(parts.rollout.generate(prompts, seed=1))

    def scored():
        return asyncio.run(rollout_and_score(parts, 0))[0]

    if kind == "rollout":
        secs = _timed(rollout, dev, repeats)
        flops, steps = rollout_flops(parts, n)
        base = _plain_loop_seconds(parts, repeats) if baseline else None
        return BenchResult(kind, secs, n, flops, peak, steps, base)
    batch = parts.algorithm.prepare(scored(), cfg.algorithm)
    train_fwd = forwards_per_trained_sample(cfg, batch) * fam.flops(1)
    if kind == "train":
        secs = _timed(lambda: parts.actor.train_step(batch), dev, repeats)
        return BenchResult(kind, secs, len(batch), len(batch) * train_fwd, peak, 0)

    def epoch() -> None:
        parts.actor.train_step(parts.algorithm.prepare(scored(), cfg.algorithm))

    secs = _timed(epoch, dev, repeats)
    flops, steps = rollout_flops(parts, n)
    return BenchResult(kind, secs, n, flops + n * train_fwd, peak, steps)


def _plain_loop_seconds(parts: Engines, repeats: int) -> float:
    """The baseline rollout: per prompt, its G samples in one call, on a freshly loaded model
    without the serving layout, the prompt encoded again each call (cache emptied)."""
    cfg = parts.cfg
    model = load_model(cfg.model, parts.device)
    one_prompt = replace(cfg.rollout, max_batch=cfg.rollout.group_size)
    plain = RolloutEngine(
        model, one_prompt, [], parts.device, serving_layout=False, share_model=True
    )
    cache = getattr(model.net, "cache", None)
    prompts = parts.prompts.at(0)

    def loop() -> None:
        for k in range(len(prompts)):
            if cache is not None:
                cache.store.clear()
            one = prompts.select(torch.tensor([k]))
            asyncio.run(plain.generate(one, seed=1 + k))

    try:
        return _timed(loop, parts.device, repeats)
    finally:
        if cache is not None:
            cache.store.clear()
