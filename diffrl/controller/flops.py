"""What one training step computes, stage by stage, in FLOPs: the ``perf/*`` FLOP metrics of
``diffrl train`` and the stage counts of ``diffrl bench pipeline``.

Stages, each a forward (or a backward) the step runs:

- ``encode``: the text encoders, on each prompt row the encode cache misses (a prompt seen
  before, and its G samples, cost nothing again);
- ``rollout``: the DiT's forwards of the sampler, every step, each sample's row and, with CFG,
  its unconditional row (``guided_velocity`` runs both in one call), at the text length and
  with the conditioning rows each forward really has (``family.flops(rows, ids, cond)``);
- ``decode``: the media decoders (the VAE, H3's and LTX-2's audio chains) on every sample;
- ``reward``: the in-process scorers' models on every sample (a scorer behind HTTP computes
  elsewhere and counts 0 here);
- ``train``: the update's passes through the DiT as the algorithm declares them
  (``train_cost``: forwards, and backwards at one forward's worth each).

**Model FLOPs** are those the work needs. **Hardware FLOPs** add what the run recomputes: under
``actor.activation_checkpointing`` every backward first reruns its forward. Both count the way
``torch.utils.flop_counter`` does: matmuls and attention's two matmuls, no elementwise work
(``models/family.py`` says it in full). Both are the base model's: the LoRA factors' own
matmuls in the update (2 r (d_in + d_out) per row of each target, a few percent at real size)
are left out, as is attention's second backward matmul (``TrainCost`` counts a backward as one
forward), so the update's counts are floors (tests/bench/test_bench.py bounds them).

The DiT stages are analytic (each family's formula, held to the counter in
tests/models/test_flops.py). The frozen stages have no formula: their cost per row is measured
once, by running one prompt row's encode, one sample's decode and one sample's scoring under
``FlopCount`` (``measure_frozen``), after the run's first step, under a forked random state,
so the run's numbers do not change. Eval rollouts are not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from diffrl.models.family import ARFamily
from diffrl.types import select_rows

STAGES = ("encode", "rollout", "decode", "reward", "train")
# the CPU's fused SDPA kernel: torch's counter has no formula for it, so attention on the CPU
# would count 0; its FLOPs are those of the GPU's flash kernel (the same formula)
_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class FlopCount(TorchDispatchMode):
    """Counts the FLOPs of the ops this thread runs inside the block, with torch's own formulas
    (``flop_registry``, as ``FlopCounterMode``), plus the CPU's fused attention. Unlike
    ``FlopCounterMode`` it tracks no modules (no global hooks), and it changes no result: a
    forward counted here computes what it would outside. A dispatch mode is thread-local: work
    a callee hands to another thread is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = flop_registry.get(packet)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        elif packet is _CPU_SDPA:
            q, k, v = args[:3]
            self.flops += sdpa_flop_count(q.shape, k.shape, v.shape)
        return out


def counted(fn) -> float:
    """FLOPs of one call of ``fn`` (no gradients), its result dropped."""
    with torch.no_grad(), FlopCount() as count:
        fn()
    return float(count.flops)


def rollout_flops(family, traj, max_rows: int = 0) -> float:
    """The DiT's forwards of sampling ``traj``: at each of its steps, one forward per
    micro-batch of ``max_rows`` samples (0 = all in one), the unconditional rows beside the
    conditional ones with CFG."""
    ids, cond = traj.prompts.input_ids, traj.prompts.cond
    spec = traj.step_spec
    steps = len(traj.sigmas) - 1 if traj.sigmas is not None else len(traj.sde_mask)
    n = len(ids)
    per = max_rows or n
    total = 0.0
    for k in range(0, n, per):
        rows_ids = ids[k : k + per]
        rows_cond = None if cond is None else cond[k : k + per]
        if spec is not None and spec.cfg_scale != 1:
            null = torch.as_tensor(spec.null_ids, dtype=ids.dtype).expand_as(rows_ids)
            rows_ids = torch.cat([rows_ids, null])
            rows_cond = None if rows_cond is None else torch.cat([rows_cond, rows_cond])
        total += family.flops(len(rows_ids), rows_ids, rows_cond)
    return steps * total


def train_flops(family, algorithm, algo_cfg, batch, checkpointing: bool) -> tuple[float, float]:
    """(model, hardware) FLOPs of an update on ``batch`` (a TrainBatch, or the Trajectory it is
    prepared from: ``train_cost`` reads the SDE mask and CFG off either): per sample, the
    algorithm's forward-equivalents of that sample's forward; hardware adds one forward per
    backward under activation checkpointing (the recompute)."""
    ids = batch.input_ids if hasattr(batch, "input_ids") else batch.prompts.input_ids
    cond = batch.cond if hasattr(batch, "input_ids") else batch.prompts.cond
    forward = family.flops(len(ids), ids, cond)  # one forward of every sample
    cost = algorithm.train_cost(algo_cfg, batch)
    model = cost.passes * forward
    return model, model + (cost.backwards * forward if checkpointing else 0.0)


@dataclass(frozen=True)
class FrozenFlops:
    """FLOPs of the stages without a formula, measured per unit (``measure_frozen``)."""

    encode: float  # one prompt row through the text encoders (0: the net embeds its own ids)
    decode: float  # one sample's media
    reward: float  # one sample through every in-process scorer


def measure_frozen(model, rewards, traj, device: torch.device) -> FrozenFlops:
    """Runs one prompt row's encode (uncached), one sample's decode and its scoring under
    ``FlopCount``. The random state is forked (a scorer that draws leaves the run's stream as
    it was). A scorer is counted through its ``score_sync`` (the in-process model scorers),
    in this thread; one without it (HTTP, a VLM judge, an async-only scorer) counts 0 and is
    not called, so a server sees no extra request. A scorer that raises here counts 0: the
    pool's own call decides what its failure means."""
    one = select_rows(traj, torch.tensor([0]))
    net, family = model.net, model.family
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        encode = getattr(net, "_encode", None)  # a diffusers net's uncached encode
        ids = one.prompts.input_ids
        enc = counted(lambda: encode(ids)) if encode else 0.0
        dec = counted(lambda: family.decode(one.x0.to(device)))
        rew = 0.0
        for _, scorer in rewards.scorers if rewards is not None else ():
            score = getattr(scorer, "score_sync", None)
            if score is None:
                continue
            try:
                rew += counted(lambda s=score: s(one))
            except Exception:  # counted 0; the pool's own call reports the failure
                continue
    return FrozenFlops(enc, dec, rew)


def step_flops(parts, scored, frozen: FrozenFlops | None, encoded: int) -> dict[str, float]:
    """Model FLOPs of one step by stage, and the update's hardware FLOPs (``train_hw``).
    ``encoded``: the prompt rows the text encoders ran on this step (the cache's misses)."""
    traj, cfg = scored.traj, parts.cfg
    family = parts.rollout.family
    rows = len(traj)
    model, hw = train_flops(
        family, parts.algorithm, cfg.algorithm, traj, cfg.actor.activation_checkpointing
    )
    frozen = frozen or FrozenFlops(0.0, 0.0, 0.0)
    return {
        "encode": encoded * frozen.encode,
        "rollout": rollout_flops(family, traj, cfg.rollout.max_batch),
        "decode": rows * frozen.decode,
        "reward": rows * frozen.reward,
        "train": model,
        "train_hw": hw,
    }


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 0, reps: int = 10) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` here: the MFU denominator. Its operands come from
    a generator of its own, so measuring leaves the run's random stream untouched."""
    n = n or (8192 if device.type == "cuda" else 1024)
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    a @ b

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    t = now()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (now() - t)


class PipelinePerf:
    """The ``perf/*`` FLOP metrics of ``diffrl train``, one step at a time:

    - ``perf/tflop/<stage>``: model FLOPs of the step's stage, in TFLOP (``train_hw``: the
      update's hardware FLOPs);
    - ``perf/pipeline_tflops``: model FLOPs of every step so far over the wall seconds since the
      loop started (the window of ``perf/samples_per_s``; held-out evals and checkpoints take
      wall time there whose work is not counted);
    - ``perf/pipeline_mfu``, ``perf/pipeline_hw_mfu``: model and hardware FLOP/s over the
      matmul ceiling measured at start on the GPU in the model's dtype; on a CPU no MFU is
      logged (FLOP/s only: a CPU's matmul rate is no ceiling the run is held to).

    Counts only where the rollout engine is in this process (it holds the model and its
    family); on the Ray backend, with an engine that holds neither, or for an autoregressive
    family, it logs nothing. The
    frozen stages are measured after the first step (``measure_frozen``) in a run of one
    process; under torchrun (where the encoders may be sharded collectives) they count 0.
    ``encode`` counts every prompt row the encode cache missed since the last step (a held-out
    eval's prompts too, the first time they are seen)."""

    def __init__(self, parts) -> None:
        self.parts = parts
        model = getattr(parts.rollout, "model", None)
        local = parts.cfg.run.backend == "local" and hasattr(parts.rollout, "family")
        # an autoregressive family (qwen_omni) samples tokens, not a denoising loop: the
        # stage formulas here are the diffusion families'; it logs no perf/tflop
        denoises = local and not isinstance(parts.rollout.family, ARFamily)
        self.on = denoises and model is not None
        self.total = self.total_hw = 0.0
        self.frozen: FrozenFlops | None = None
        self.peak = 0.0
        self.cache, self.misses = None, 0
        if model is None or not self.on:
            return
        if parts.device.type == "cuda":
            self.peak = matmul_rate(parts.device, next(model.parameters()).dtype)
        self.cache = getattr(model.net, "cache", None)
        self.misses = self.cache.misses if self.cache is not None else 0

    def step(self, scored, t_rate: float) -> dict[str, float]:
        if not self.on:
            return {}
        parts = self.parts
        if self.frozen is None and parts.ranks.world == 1:
            model, traj = parts.rollout.model, scored.traj
            self.frozen = measure_frozen(model, parts.rewards, traj, parts.device)
        encoded = 0
        if self.cache is not None:
            encoded, self.misses = self.cache.misses - self.misses, self.cache.misses
        flops = step_flops(parts, scored, self.frozen, encoded)
        model_flops = sum(v for k, v in flops.items() if k != "train_hw")
        self.total += model_flops
        self.total_hw += model_flops - flops["train"] + flops["train_hw"]
        seconds = max(time.time() - t_rate, 1e-9)
        out = {f"perf/tflop/{k}": v / 1e12 for k, v in flops.items()}
        out["perf/pipeline_tflops"] = self.total / seconds / 1e12
        if self.peak:
            out["perf/pipeline_mfu"] = self.total / seconds / self.peak
            out["perf/pipeline_hw_mfu"] = self.total_hw / seconds / self.peak
        return out
