"""``diffrl bench rollout|train|epoch [RECIPE] [key=value ...]``: what the engines a recipe
builds do per second, and at what MFU.

- ``rollout``: one step's prompts x G through the rollout engine, after a warm-up, ``repeats``
  times; images (or clips) per second, latency per sampler step, MFU. The baseline, in the
  same process, is the plain loop: one prompt per call as a diffusers pipeline runs it (its G
  images batched, CFG batched, the prompt encoded afresh every call), on the model as loaded
  (no serving layout).
- ``train``: the actor's update on one scored rollout, ``repeats`` times. The baseline is the
  same update as a diffusers/peft training script runs it (flow_grpo's ``train_sd3.py``), in the
  same process, on its own copy of the model (``baseline_actor``): the transformer's weights in
  fp32 (the run's values, copied in), peft LoRA with the run's targets, rank and adapters, the
  loss under ``torch.autocast(bf16)`` when the run's model is bf16 (matmuls in bf16, the loss
  maths in fp32, each backward outside it), eager (no ``actor.compile``), one timestep's graph
  per backward, and an old policy's or a reference's (adapters disabled) forward a
  separate no-grad one. It runs the algorithm's own loss with those forwards unbatched
  (``AlgorithmConfig.unbatched``: one per timestep beside the policy's).
  Text conditions come from the run's encoders and their cache, as the script reuses the
  prompt embeddings its sampling computed.
- ``epoch``: rollout, scoring and update, as the training loop runs one step. The baseline is
  the loop a diffusers script runs, its three parts one after another, each timed on its own:
  the plain rollout loop, scoring the rollout's samples, and the baseline update on the batch.
- ``pipeline``: MFU stage by stage and over the whole step (``diffrl.controller.flops`` says
  what each stage counts). Each stage is timed alone: ``encode`` (the text encoders on the
  step's prompts, uncached), ``rollout`` (the engine's sampling: its whole call less the
  ``decode`` timed alone), ``decode``, ``reward`` (scoring the rollout's samples), ``train``
  (the update). The whole pipeline is the epoch as the loop runs it (its encodes cached after
  the warm-up) plus the encode stage: its model FLOPs and its hardware FLOPs (the update's
  recompute under activation checkpointing added) over those seconds. No baseline.

Each timing is a mean over ``repeats`` after a warm-up that runs every shape once (kernels,
allocator, compiled graphs): a whole rollout and scoring (also the batch the update trains on),
an update on the batch's first micro-batch and its last, shorter one (``warmup_batch``), one
plain-loop call.

MFU = useful FLOPs / seconds / peak. FLOPs come from the family's analytic count (checked against
torch's FLOP counter in tests/models/test_flops.py), at the text length and with the
conditioning rows each forward has. The peak is the matmul rate measured here, in the model's
dtype: on a GPU its bf16/fp32 GEMM ceiling; on a CPU the rate of a 1024 x 1024 matmul on the
CPU (so a CPU's MFU is against its own measured matmul rate, not a datasheet). Rollout: every
forward row (x2 with CFG) at every step. Train, per trained timestep of a sample: the policy's
forward and its backward through frozen weights (input gradients only, one forward's worth),
plus each no-grad forward the loss makes: NFT's old policy, a KL reference, DPO's reference;
x2 where the loss runs CFG's two branches (FlowGRPO on a CFG rollout). That backward count is
a floor: attention's backward takes two forwards' worth (both its operands are activations),
so train MFU reads a few percent low.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field, replace

import torch

from diffrl.actor.engine import ActorEngine
from diffrl.algorithms.registry import Algorithm, Backward
from diffrl.backends import build_engines
from diffrl.build import Engines, actor_targets
from diffrl.config import Config
from diffrl.controller import flops
from diffrl.controller.flops import matmul_rate
from diffrl.controller.step import rollout_and_score
from diffrl.errors import ConfigError
from diffrl.models.registry import load_model
from diffrl.rollout.engine import RolloutEngine
from diffrl.types import TrainBatch

KINDS = ("rollout", "train", "epoch", "pipeline")


@dataclass
class BenchResult:
    kind: str
    seconds: float  # mean over repeats
    samples: int
    flops: float  # useful FLOPs of one repeat
    peak_flops: float  # measured matmul rate, FLOP/s
    steps: int  # sampler steps (rollout, epoch)
    baseline_seconds: float | None = None
    # the epoch's parts, mean seconds per repeat: "rollout" (sampling with scoring beside it),
    # "update"; the baseline's "baseline_rollout", "baseline_score", "baseline_update"
    split: dict[str, float] = field(default_factory=dict)
    # pipeline: stage -> (mean seconds, model FLOPs, hardware FLOPs); ``hw_flops`` the whole
    # step's hardware FLOPs (model FLOPs plus activation checkpointing's recompute)
    stages: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    hw_flops: float = 0.0

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
        for part, secs in self.split.items():
            out[f"bench/{self.kind}/{part}_seconds"] = secs
        for stage, (secs, fl, hw) in self.stages.items():
            out[f"bench/{self.kind}/{stage}/seconds"] = secs
            out[f"bench/{self.kind}/{stage}/tflop"] = fl / 1e12  # model FLOPs
            if secs > 0:
                out[f"bench/{self.kind}/{stage}/mfu"] = fl / secs / self.peak_flops
            if stage == "train" or hw != fl:  # hardware FLOPs: the recompute counted
                out[f"bench/{self.kind}/{stage}/hw_tflop"] = hw / 1e12
                if secs > 0:
                    out[f"bench/{self.kind}/{stage}/hw_mfu"] = hw / secs / self.peak_flops
        if self.hw_flops:
            out[f"bench/{self.kind}/hw_mfu"] = self.hw_flops / self.seconds / self.peak_flops
        return out


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def rollout_flops(parts: Engines, traj) -> tuple[float, int]:
    """The DiT FLOPs of sampling ``traj`` (every step, CFG's rows beside, micro-batched as the
    engine runs it) and its sampler steps."""
    r = parts.cfg.rollout
    return flops.rollout_flops(parts.rollout.family, traj, r.max_batch), len(traj.sigmas) - 1


def _timed(fn, device: torch.device, repeats: int, warmup=None) -> float:
    """Mean seconds of ``fn`` over ``repeats`` calls after one call of ``warmup`` (default
    ``fn``): kernels, allocator, caches, compiled graphs."""
    (warmup or fn)()
    total = 0.0
    for _ in range(repeats):
        t = sync(device)
        fn()
        total += sync(device) - t
    return total / repeats


def bench(
    kind: str, cfg: Config, repeats: int = 3, baseline: bool = True, profile: str = ""
) -> BenchResult:
    """``profile``: a file for one more repeat's profile (``write_profile``), taken after the
    timings (and before the baseline's)."""
    if kind not in KINDS:
        raise ConfigError(f"diffrl bench: kind must be one of {KINDS}, got {kind!r}")
    if repeats < 1:
        raise ConfigError(f"diffrl bench: repeats must be >= 1, got {repeats}")
    parts = build_engines(cfg)
    dev, fam = parts.device, parts.rollout.family
    dtype = next(parts.rollout.model.parameters()).dtype
    peak = matmul_rate(dev, dtype)
    prompts = parts.prompts.at(0)
    n = len(prompts) * cfg.rollout.group_size

    sampled = []  # the warm-up's trajectory: what the FLOPs are counted on

    def rollout() -> None:
        asyncio.run(parts.rollout.generate(prompts, seed=1))

    def first_rollout() -> None:
        sampled.append(asyncio.run(parts.rollout.generate(prompts, seed=1)))

    def scored():
        return asyncio.run(rollout_and_score(parts, 0))[0]

    if kind == "pipeline":
        return pipeline(parts, repeats, peak)
    if kind == "rollout":
        secs = _timed(rollout, dev, repeats, warmup=first_rollout)
        if profile:
            write_profile(profile, rollout, dev)
        fl, steps = rollout_flops(parts, sampled[0])
        base = _plain_loop_seconds(parts, repeats) if baseline else None
        return BenchResult(kind, secs, n, fl, peak, steps, base)
    first = scored()  # the rollout's and the scorers' warm-up
    batch = parts.algorithm.prepare(first, cfg.algorithm)
    # forward-equivalents of the trained samples, as the algorithm counts them
    train_fl = flops.train_flops(fam, parts.algorithm, cfg.algorithm, batch, False)[0]
    head = warmup_batch(batch, cfg.actor.micro_batch)

    def update(rows: TrainBatch = batch) -> None:
        parts.actor.train_step(rows)

    if kind == "train":
        secs = _timed(update, dev, repeats, warmup=lambda: update(head))
        if profile:
            write_profile(profile, update, dev)
        base = _baseline_train_seconds(parts, batch, repeats) if baseline else None
        return BenchResult(kind, secs, len(batch), train_fl, peak, 0, base)

    timing = {"rollout": 0.0, "update": 0.0}

    def epoch() -> None:
        t = sync(dev)
        rows = parts.algorithm.prepare(scored(), cfg.algorithm)
        mid = sync(dev)
        update(rows)
        timing["rollout"] += (mid - t) / repeats
        timing["update"] += (sync(dev) - mid) / repeats

    secs = _timed(epoch, dev, repeats, warmup=lambda: update(head))
    split = dict(timing)  # the timed repeats only, not the profile's run below
    if profile:
        write_profile(profile, epoch, dev)
    fl, steps = rollout_flops(parts, first.traj)
    base = None
    if baseline:

        def score() -> None:
            asyncio.run(parts.rewards.score(first.traj))

        split["baseline_rollout"] = _plain_loop_seconds(parts, repeats)
        split["baseline_score"] = _timed(score, dev, repeats)
        split["baseline_update"] = _baseline_train_seconds(parts, batch, repeats)
        base = split["baseline_rollout"] + split["baseline_score"] + split["baseline_update"]
    return BenchResult(kind, secs, n, fl + train_fl, peak, steps, base, split)


def pipeline(parts: Engines, repeats: int, peak: float) -> BenchResult:
    """``diffrl bench pipeline`` on built engines: each stage timed alone and counted, then the
    whole epoch; MFU against ``peak`` FLOP/s."""
    cfg, dev = parts.cfg, parts.device
    model, prompts = parts.rollout.model, parts.prompts.at(0)
    fam, n = model.family, len(prompts) * cfg.rollout.group_size
    first, _ = asyncio.run(rollout_and_score(parts, 0))  # warms every stage; media for scoring
    traj = first.traj
    per = flops.measure_frozen(model, parts.rewards, traj, dev)
    encode = getattr(model.net, "_encode", None)  # a diffusers net's uncached encode
    x0 = traj.x0.to(dev)
    batch = parts.algorithm.prepare(first, cfg.algorithm)
    head = warmup_batch(batch, cfg.actor.micro_batch)

    def generate() -> None:
        asyncio.run(parts.rollout.generate(prompts, seed=1))

    def score() -> None:
        asyncio.run(parts.rewards.score(traj))

    def update() -> None:
        parts.actor.train_step(batch)

    def epoch() -> None:
        rows = parts.algorithm.prepare(asyncio.run(rollout_and_score(parts, 0))[0], cfg.algorithm)
        parts.actor.train_step(rows)

    secs = {
        "encode": _timed(lambda: encode(prompts.input_ids), dev, repeats) if encode else 0.0,
        "decode": _timed(lambda: fam.decode(x0), dev, repeats),
        "rollout": _timed(generate, dev, repeats),
        "reward": _timed(score, dev, repeats),
        "train": _timed(update, dev, repeats, warmup=lambda: parts.actor.train_step(head)),
    }
    secs["rollout"] = max(secs["rollout"] - secs["decode"], 0.0)  # sampling: less its decode
    whole = _timed(epoch, dev, repeats) + secs["encode"]
    ckpt = cfg.actor.activation_checkpointing
    train, train_hw = flops.train_flops(fam, parts.algorithm, cfg.algorithm, batch, ckpt)
    fl = {
        "encode": len(prompts) * per.encode,
        "rollout": rollout_flops(parts, traj)[0],
        "decode": n * per.decode,
        "reward": n * per.reward,
        "train": train,
    }
    stages = {k: (secs[k], fl[k], train_hw if k == "train" else fl[k]) for k in flops.STAGES}
    total = sum(fl.values())
    steps = len(traj.sigmas) - 1
    return BenchResult(
        "pipeline", whole, n, total, peak, steps, stages=stages,
        hw_flops=total - train + train_hw,
    )  # fmt: skip


# kernel kinds by name, in order (the first that matches): what a profile's device time went to
KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    (
        "matmul",
        re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_|matmul|wgmma|::(add)?b?mm$", re.I),
    ),
    ("copy/cast", re.compile(r"memcpy|memset|copy|cast|to_copy|fill", re.I)),
    ("compiled (triton)", re.compile(r"^triton", re.I)),
    ("reduction/norm", re.compile(r"reduce|norm|softmax", re.I)),
    (
        "elementwise",
        re.compile(r"elementwise|vectorized|unrolled|pointwise|::(mul|add|sub|div)_?$", re.I),
    ),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def write_profile(path: str, fn, device: torch.device) -> dict[str, float]:
    """One call of ``fn`` under torch.profiler: writes to ``path`` the share of device time by
    kernel kind (``KERNEL_KINDS``), the kernel count, and the top kernels by their own time;
    returns the shares. On a GPU it adds the operators by their own host time (where the host
    spends it while the device waits). On a CPU the operators' own CPU time stands in, for the
    calling thread's operators only (the rollout's run in a worker thread)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = sync(device)
    with torch_profile(activities=acts) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t
    every = prof.key_averages()
    rows = every
    if cuda:  # the kernels themselves: device-side events
        rows = [r for r in rows if str(getattr(r, "device_type", "")).endswith("CUDA")]
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda and rows and not hasattr(rows[0], attr):
        attr = "self_cuda_time_total"
    timed = sorted(((getattr(r, attr), r.count, r.key) for r in rows), reverse=True)
    total = sum(us for us, _, _ in timed) or 1.0
    shares: dict[str, float] = {}
    for us, _, name in timed:
        kind = kernel_kind(name)
        shares[kind] = shares.get(kind, 0.0) + us / total
    lines = [
        f"wall {wall:.3f} s, {'device' if cuda else 'CPU'} time {total / 1e6:.3f} s, "
        f"{sum(c for _, c, _ in timed)} {'kernels' if cuda else 'operator calls'}",
        "",
        "share  kind",
    ]
    lines += [f"{v:6.1%} {k}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])]
    lines += ["", "    ms  share  calls  kind               name"]
    for us, count, name in timed[:40]:
        lines.append(
            f"{us / 1e3:6.1f} {us / total:6.1%} {count:6d}  {kernel_kind(name):18s} {name[:110]}"
        )
    if cuda:  # where the host's time goes, when the device waits for it
        lines += ["", "host: operators by their own CPU time", "    ms  calls  name"]
        host = sorted(((r.self_cpu_time_total, r.count, r.key) for r in every), reverse=True)
        lines += [f"{us / 1e3:6.1f} {count:6d}  {name[:110]}" for us, count, name in host[:30]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return shares


def _plain_loop_seconds(parts: Engines, repeats: int) -> float:
    """The baseline rollout: per prompt, its G samples in one call, on a freshly loaded model
    without the serving layout, eager, the prompt encoded again each call (cache emptied)."""
    cfg = parts.cfg
    model = load_model(cfg.model, parts.device)
    one_prompt = replace(
        cfg.rollout, max_batch=cfg.rollout.group_size, compile=False, cuda_graphs=False,
        share_base=False,  # samples with its own freshly loaded model (share_model)
    )  # fmt: skip
    plain = RolloutEngine(
        model, one_prompt, [], parts.device, serving_layout=False, share_model=True
    )
    cache = getattr(model.net, "cache", None)
    prompts = parts.prompts.at(0)

    def call(k: int) -> None:
        if cache is not None:
            cache.store.clear()
        asyncio.run(plain.generate(prompts.select(torch.tensor([k])), seed=1 + k))

    def loop() -> None:
        for k in range(len(prompts)):
            call(k)

    try:  # warmed up on one call: every call runs the same shapes
        return _timed(loop, parts.device, repeats, warmup=lambda: call(0))
    finally:
        if cache is not None:
            cache.store.clear()


def baseline_actor(parts: Engines) -> ActorEngine:
    """The update's baseline (the module docstring says what it does): an eager ActorEngine
    over a freshly
    loaded fp32 copy of the model, holding the run's actor's weights and adapters (so a random
    preset trains the same function) and its random state (so it draws the same timesteps and
    noise); the run's frozen text encoders and their cache are shared, as the script reuses the
    prompt embeddings its sampling computed. Its losses run under bf16 autocast when the run's
    model is bf16."""
    cfg = parts.cfg
    model = load_model(replace(cfg.model, dtype="float32"), parts.device)
    run_net = parts.actor.model.get_base_model().net
    if hasattr(run_net, "frozen"):  # a diffusers family: its encoders live outside the module
        model.net.frozen, model.net.cache = run_net.frozen, run_net.cache
    autocast = cfg.model.dtype == "bfloat16"
    algorithm = _under_autocast(parts.algorithm, parts.device) if autocast else parts.algorithm
    algo_cfg = cfg.algorithm.unbatched()  # no-grad forwards one per timestep, beside the policy's
    actor = ActorEngine(
        model, replace(cfg.actor, compile=False), actor_targets(cfg), algorithm, algo_cfg,
        parts.device, cfg.run.seed,
    )  # fmt: skip
    actor.model.load_state_dict(parts.actor.model.state_dict())
    # the adapters' values of record: a bf16 run's fp32 masters, not its bf16 factors
    unexpected = actor.model.load_state_dict(parts.actor.adapter_tensors(), strict=False)[1]
    assert not unexpected, unexpected  # the same adapters under the same names
    actor.gen.set_state(parts.actor.gen.get_state())
    return actor


def _under_autocast(algorithm: Algorithm, device: torch.device) -> Algorithm:
    """``algorithm`` with its loss and diagnostics under bf16 autocast, as a script's
    ``accelerator.autocast()`` around the model calls: the matmuls run in bf16 and the loss
    maths stay fp32 (autocast casts no elementwise op down); each part's backward runs outside
    it, as the script's ``accelerator.backward``."""

    def bf16():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def loss(policy, batch, cfg, gen, *backward):  # backward: given with partial_backward
        with bf16():
            return algorithm.loss(policy, batch, cfg, gen, *map(_without_autocast, backward))

    def diagnostics(policy, batch, cfg):
        with bf16():
            return algorithm.diagnostics(policy, batch, cfg)

    return replace(algorithm, loss=loss, diagnostics=algorithm.diagnostics and diagnostics)


def _without_autocast(backward: Backward) -> Backward:
    def run(part: torch.Tensor) -> None:
        with torch.autocast(part.device.type, enabled=False):
            backward(part)

    return run


def warmup_batch(batch: TrainBatch, micro_batch: int) -> TrainBatch:
    """The rows an update's warm-up trains on: the first micro-batch and the last, shorter
    one if any, so every shape the update runs (compiled graphs included) runs once, for a
    fraction of a whole update's time."""
    return batch.select(torch.arange(min(len(batch), micro_batch + len(batch) % micro_batch)))


def _baseline_train_seconds(parts: Engines, batch: TrainBatch, repeats: int) -> float:
    actor = baseline_actor(parts)
    head = warmup_batch(batch, parts.cfg.actor.micro_batch)
    return _timed(lambda: actor.train_step(batch), parts.device, repeats,
                  warmup=lambda: actor.train_step(head))  # fmt: skip
