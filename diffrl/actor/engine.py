"""The actor engine: LoRA adapters via peft on the base model, AdamW, grad clipping.

Adapters: ``default`` (trained), ``old`` (frozen, refreshed by the algorithm's schedule) and,
with ``ema_decay`` > 0, ``ema`` (frozen, an exponential moving average of ``default`` updated
after every optimizer step, which held-out eval samples with); the reference policy is the base
model with adapters disabled. The actor never samples trajectories; it trains on what the
rollout produced and exports versioned LoRA deltas.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer, LoraModel
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint, noop_context_fn

from diffrl.algorithms.registry import Algorithm, AlgorithmConfig
from diffrl.errors import ConfigError, DiffrlError, check, check_choice
from diffrl.hostmem import release_host_memory
from diffrl.models.compile import compile_blocks
from diffrl.models.family import FamilyModel, transformer_blocks
from diffrl.parallel.drift import check_adapters_across, check_tokens_across
from diffrl.parallel.launch import all_reduced
from diffrl.parallel.tp_lora import clip_grads, full, like, local
from diffrl.sync.bound import bound_of
from diffrl.sync.weights import BasePrints, LoraDelta, WeightUpdate
from diffrl.types import TrainBatch, check_token_hashes

log = logging.getLogger(__name__)
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterConfig:
    # Adam moves every adapter weight by about lr per step, so at the same scale (alpha = rank)
    # a higher rank is a larger update: full rank on the tiny DiT diverged at the GRPO
    # recipes' learning rate. Lower actor.lr when raising it
    rank: int = 32
    alpha: float = 32.0  # LoRA scale = alpha / rank
    targets: list[str] = field(default_factory=list)  # empty = the model family's explicit list

    def validate(self) -> None:
        check(self.rank >= 1, "rank", self.rank, "must be >= 1")
        check(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        check(
            "all-linear" not in self.targets,
            "targets",
            self.targets,
            "name target modules explicitly (contract 2: no 'all-linear')",
        )


@dataclass(frozen=True)
class ActorConfig:
    lr: float = 1e-3
    # learning-rate schedule over optimizer steps: constant, or a linear or cosine decay from
    # `lr` to `lr * lr_end` at step `lr_horizon` (0 = run.steps x minibatches, filled in when
    # the run is built), after `lr_warmup` steps of linear warm-up (lr/(w+1), 2lr/(w+1), ..).
    # A run stopped early by run.max_minutes ends before the decay does
    lr_schedule: str = "constant"  # constant | linear | cosine
    lr_warmup: int = 0
    lr_end: float = 0.0
    lr_horizon: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch: int = 64  # samples per forward/backward; gradients accumulate to the batch
    # optimizer steps per RL batch: the batch is shuffled and split into this many parts, each
    # one AdamW step (PPO-style minibatches; 1 = one step on the whole batch)
    minibatches: int = 1
    max_nonfinite_steps: int = 3  # consecutive NaN/inf losses before training stops
    # > 0: keep an ``ema`` adapter, ema <- d*ema + (1-d)*default after each optimizer step, with
    # d = min(ema_decay, k/(k+1)) at the k-th step (a plain mean of the iterates until the EMA's
    # horizon 1/(1-ema_decay) is reached); held-out eval then measures the EMA policy, while
    # rollouts keep sampling with the live one. 0 = off
    ema_decay: float = 0.0
    # recompute each transformer block's activations in the backward pass instead of keeping
    # them (diffusers' enable_gradient_checkpointing): a real-size model's training step fits
    # beside the rollout's copy (Qwen-Image on one H200 ran out of memory without it).
    # true: every block; an integer N: only the first N blocks of the transformer's block lists
    # (the units compile and FSDP2 take), the others keep theirs (0 = false; every block =
    # true). Numerics are the same either way. `diffrl plan` picks the smallest N that fits
    activation_checkpointing: bool | int = False
    # regional torch.compile of the transformer's blocks once peft has wrapped them (as
    # rollout.compile; diffrl/models/compile.py): each adapter state the losses switch to (old,
    # default, disabled) compiles once. Needs a compiler toolchain (inductor); off by default
    compile: bool = False
    # precision of the adapters' matmuls. "auto": the model's own dtype; on a bf16 model the
    # LoRA factors are held in bf16 for the forward and backward, and every adapter (trained,
    # old, ema) keeps an fp32 master copy, which the optimizer steps, blends, exports and
    # checkpoints read; gradients accumulate into the fp32 masters. "float32": peft's default,
    # fp32 factors and each LoRA input cast up to fp32 (the fp32 LoRA matmuls are a large share
    # of a bf16 model's update on a GPU). An fp32 model computes in fp32 either way
    lora_compute: str = "auto"  # auto | float32
    # the policy's forward passes (policy, old, reference) under torch.autocast in this dtype,
    # each output cast back to the model's dtype, so the losses' maths stay outside it (the
    # backward mirrors the forward's dtypes); parameters, gradients and optimizer state keep the
    # model's dtype. On a CPU with bf16 instructions, bf16 matmuls run several times faster
    # than fp32's on the tiny DiT's shapes. "off": the model's own precision
    autocast: str = "off"  # off | bfloat16
    lora: AdapterConfig = field(default_factory=AdapterConfig)

    def __post_init__(self) -> None:
        # YAML 1.1 reads a bare off as a boolean: the documented ``actor.autocast=off`` arrives
        # as False, which OmegaConf turns into the string "False"
        if str(self.autocast) in ("False", "false"):
            object.__setattr__(self, "autocast", "off")

    def validate(self) -> None:
        check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be finite and > 0")
        check_choice("lr_schedule", self.lr_schedule, ("constant", "linear", "cosine"))
        check(self.lr_warmup >= 0, "lr_warmup", self.lr_warmup, "must be >= 0")
        check(0 <= self.lr_end <= 1, "lr_end", self.lr_end, "must be in [0, 1] (a fraction of lr)")
        check(self.lr_horizon >= 0, "lr_horizon", self.lr_horizon, "must be >= 0")
        if self.lr_horizon:
            check(
                self.lr_warmup < self.lr_horizon,
                "lr_warmup",
                self.lr_warmup,
                f"must be < lr_horizon = {self.lr_horizon}",
            )
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        check(
            math.isfinite(self.grad_clip) and self.grad_clip > 0,
            "grad_clip",
            self.grad_clip,
            "must be finite and > 0",
        )
        check(self.micro_batch >= 1, "micro_batch", self.micro_batch, "must be >= 1")
        ac = self.activation_checkpointing
        check(
            isinstance(ac, bool) or (isinstance(ac, int) and ac >= 0),
            "activation_checkpointing",
            ac,
            "true, false, or the number N >= 0 of leading transformer blocks to checkpoint",
        )
        check(self.minibatches >= 1, "minibatches", self.minibatches, "must be >= 1")
        check(0 <= self.ema_decay < 1, "ema_decay", self.ema_decay, "must be in [0, 1)")
        check_choice("lora_compute", self.lora_compute, ("auto", "float32"))
        check_choice("autocast", self.autocast, ("off", "bfloat16"))


def lr_factor(cfg: ActorConfig, step: int) -> float:
    """The multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): a pure function of
    the step, so a resumed run continues the schedule exactly (no scheduler state to save)."""
    if step < cfg.lr_warmup:
        return (step + 1) / (cfg.lr_warmup + 1)
    if cfg.lr_schedule == "constant" or not cfg.lr_horizon:
        return 1.0
    done = min(1.0, (step - cfg.lr_warmup) / max(1, cfg.lr_horizon - cfg.lr_warmup))
    shape = 1 - done if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * done))
    return cfg.lr_end + (1 - cfg.lr_end) * shape


def enable_checkpointing(model: FamilyModel, blocks: bool | int) -> None:
    """Activation checkpointing on the family's transformer, through the diffusers class's own
    loop (``enable_gradient_checkpointing``) with our function: every block (``True``, or N
    covering them all) or the first N of ``transformer_blocks`` (the others run as they are).
    A net with ``checkpoint_context`` (H3's packed calls) gives ``torch.utils.checkpoint`` the
    state its blocks' re-run in the backward needs."""
    transformer = getattr(model.net, "transformer", None)
    if transformer is None or not hasattr(transformer, "enable_gradient_checkpointing"):
        raise DiffrlError(
            "actor.activation_checkpointing needs a diffusers transformer (model.net.transformer)"
        )
    listed = transformer_blocks(model)
    n = len(listed) if blocks is True else int(blocks)
    if n > len(listed):
        raise ConfigError(
            f"actor.activation_checkpointing={n}: the model has {len(listed)} transformer "
            f"blocks; give true, false or 0..{len(listed)}"
        )
    if n == 0:
        return
    # every block, as diffusers' own function (the token refiner's too); else the first n
    chosen = None if n == len(listed) else {id(b) for b in listed[:n]}
    context = getattr(model.net, "checkpoint_context", noop_context_fn)

    def run(block: torch.nn.Module, *args):
        if chosen is not None and id(block) not in chosen:
            return block(*args)
        return checkpoint(block.__call__, *args, use_reentrant=False, context_fn=context)

    transformer.enable_gradient_checkpointing(gradient_checkpointing_func=run)


class NonFiniteLoss(DiffrlError):
    """The loss or gradients stayed NaN/inf for too many steps."""


def host_floats(metrics: dict) -> dict[str, float]:
    """Metric values (device tensors or numbers) as Python floats, in one device sync."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    if not keys:
        return dict(metrics)
    dev = metrics[keys[0]].device
    values = torch.stack([metrics[k].detach().float().reshape(()).to(dev) for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, values, strict=True))}


def average_over(group, grads: list[Tensor], loss: Tensor, rows: int | None = None) -> Tensor:
    """The data-parallel ranks' gradients and losses averaged in place, in fp32, in one
    all-reduce; returns the averaged loss. Every rank then takes the same step. With ``rows``,
    ``grads`` and ``loss`` are this rank's sums over its ``rows`` rows, and the average is over
    every rank's rows (ranks may hold different numbers); without, a plain mean over ranks."""
    dev = loss.device
    # a TP-sharded gradient: this rank's shard, averaged with the same shard of the other
    # data-parallel ranks (they hold the same TP coordinate)
    grads = [local(g) for g in grads]
    parts = [g.float().reshape(-1) for g in grads] + [loss.float().reshape(1).to(dev)]
    if rows is not None:
        parts.append(torch.tensor([float(rows)], device=dev))
    flat = torch.cat(parts)
    torch.distributed.all_reduce(flat, group=group)
    if rows is None:
        flat /= torch.distributed.get_world_size(group)
    else:
        flat /= max(1.0, float(flat[-1]))
    start = 0
    for g in grads:
        g.copy_(flat[start : start + g.numel()].view_as(g))
        start += g.numel()
    return flat[len(flat) - (1 if rows is None else 2)]


def grad_or_zeros(p: Tensor) -> Tensor:
    """``p``'s gradient, zeros set first where it has none yet."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


@dataclass
class PendingStep:
    """One optimizer step in progress; its rows arrive in parts (``ActorEngine.train_part``).
    The loss and metrics stay device tensors until the update is decided, so micro-batches
    queue without a host sync; ``_update`` reads them in one."""

    expected: int  # rows the step expects; a micro-batch weighs its share of them
    diagnose: bool  # run the algorithm's diagnostics on the first part with rows
    total: Tensor  # () the weighted loss so far
    metrics: dict = field(default_factory=dict)  # weighted sums, as the loss
    diagnostics: dict[str, float] = field(default_factory=dict)
    rows: int = 0  # rows this process trained
    passes: int = 0  # micro-batch passes made (a lockstep rank's spare passes included)
    # loss metrics named "*_max": the largest over the step's micro-batches, not a weighted
    # mean (e.g. FlowGRPO's check/logp_gap_max)
    maxima: dict = field(default_factory=dict)


# One pass: (rows to take ``index`` from, index, weight of its loss in the step)
Pass = tuple[TrainBatch, Tensor, float]


class StepReduction(Protocol):
    """How the micro-batches of one optimizer step are weighted and their gradients combined:
    the data-parallel layout, as a policy of the actor's one update path."""

    diagnostics: bool  # whether the step may run the algorithm's (no-grad) diagnostics

    def passes(self, part: TrainBatch, micro_batch: int, expected: int) -> list[Pass] | None:
        """The forward/backward passes for ``part``; None: every rank skips them."""
        ...

    def combine(self, params: list[Tensor], step: PendingStep) -> tuple[Tensor, dict]:
        """After the last part: the step's gradients in ``params``' ``.grad``, its (loss,
        metrics) as the optimizer step sees them."""
        ...


class OneProcess:
    """One process holds every row: a micro-batch weighs its share of the expected rows, and
    a step whose rows fell short (some filtered out) is rescaled to the mean over those that
    came."""

    diagnostics = True

    def passes(self, part: TrainBatch, micro_batch: int, expected: int) -> list[Pass]:
        n = len(part)
        chunks = [torch.arange(s, min(s + micro_batch, n)) for s in range(0, n, micro_batch)]
        return [(part, idx, len(idx) / expected) for idx in chunks]

    def combine(self, params: list[Tensor], step: PendingStep) -> tuple[Tensor, dict]:
        total, metrics = step.total, step.metrics
        if step.rows != step.expected:
            scale = step.expected / step.rows
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            total, metrics = total * scale, {k: v * scale for k, v in metrics.items()}
        return total, metrics


class Lockstep:
    """Data parallel over ``group``: each rank trains its slice of the batch, and every rank
    makes the same passes, because the frozen base is sharded (FSDP2) and each forward and
    backward is a collective.

    A rank whose slice has fewer micro-batches (its prompt groups were filtered, or its scorer
    failed) makes the rest on a spare row with weight 0: the last row it trained on. Each rank
    weighs its micro-batches by rows, and one all-reduce sums gradients, loss and rows, so the
    update is the mean over every rank's rows. When no rank has any row, or a rank needs a
    spare it does not have yet, every rank skips. No diagnostics: a rank without rows could
    not join their forward."""

    diagnostics = False

    def __init__(self, group) -> None:
        self.group = group
        self.spare: TrainBatch | None = None

    def passes(self, part: TrainBatch, micro_batch: int, expected: int) -> list[Pass] | None:
        n = len(part)
        if n:
            self.spare = part.select(torch.tensor([n - 1]))
        mine = -(-n // micro_batch)
        # [the most micro-batches of any rank, whether any rank lacks rows and a spare]
        lacks = 0 if (mine or self.spare is not None) else 1
        agree = torch.tensor([mine, lacks], dtype=torch.float64)
        most, lacking = (int(v) for v in all_reduced(agree, ReduceOp.MAX, self.group))
        if most == 0 or lacking:
            return None
        out: list[Pass] = []
        for i in range(mine):
            idx = torch.arange(i * micro_batch, min((i + 1) * micro_batch, n))
            out.append((part, idx, float(len(idx))))
        if most > mine:  # lockstep: the other ranks' passes, contributing nothing
            assert self.spare is not None, "a rank short of passes has a spare row (agreed above)"
            out += [(self.spare, torch.tensor([0]), 0.0)] * (most - mine)
        return out

    def combine(self, params: list[Tensor], step: PendingStep) -> tuple[Tensor, dict]:
        # a pass-less or zero-weight rank still reduces every adapter
        grads = [grad_or_zeros(p) for p in params]
        total = average_over(self.group, grads, step.total, rows=step.rows)
        rows = max(1, step.rows)
        return total, {k: v / rows for k, v in step.metrics.items()}  # this rank's row means


class ActorEngine:
    def __init__(
        self,
        model: FamilyModel,
        cfg: ActorConfig,
        targets: list[str],
        algorithm: Algorithm,
        algo_cfg: AlgorithmConfig,
        device: torch.device,
        seed: int = 0,
        shard: Callable[[torch.nn.Module], None] | None = None,
        dp_group=None,
        tensor_parallel: Callable[[torch.nn.Module], str] | None = None,
        rows_groups: Mapping[str, ProcessGroup | None] | None = None,
        sequence_parallel: Callable[[torch.nn.Module], str] | None = None,
        sp_group: ProcessGroup | None = None,
    ) -> None:
        """``shard`` (data parallel, ``parallel/fsdp.py``) shards the peft-wrapped model in
        place once its adapters exist; ``dp_group`` is the process group whose ranks each train
        on a slice of the batch: the adapters' gradients and the loss are averaged over it.
        ``rows_groups``: axis -> process group of the ranks that compute on the same rows (TP,
        SP; ``Ranks.rows_groups``): every batch's token hashes are compared across each.
        ``tensor_parallel`` (``parallel/tp_lora.py``) shards the base and the adapters with
        the family's TP plan, before any precision, compile or FSDP step (torchtitan's order);
        ``sequence_parallel`` (``parallel/sp.py``) then shards the transformer's sequence over
        ``sp_group``, whose ranks each hold their tokens' share of every gradient: the
        adapters' gradients are summed over it before clipping."""
        self.cfg, self.algorithm, self.algo_cfg, self.device = cfg, algorithm, algo_cfg, device
        self.rows_groups = dict(rows_groups or {})
        self.ids_device = model.ids_device(device)
        # how each optimizer step's micro-batches are weighted and reduced: one process, or
        # every data-parallel rank in lockstep
        self.reduction: StepReduction = OneProcess() if dp_group is None else Lockstep(dp_group)
        # axis -> the group whose ranks must hold the same adapters after every step (dp and sp
        # peers: all of them, shards included; tp peers: the factors they replicate)
        self.peers = {**({"dp": dp_group} if dp_group is not None else {}), **self.rows_groups}
        lora = LoraConfig(
            r=cfg.lora.rank,
            # peft annotates lora_alpha as int; it only divides it by r, so a float is fine
            lora_alpha=cfg.lora.alpha,  # type: ignore[arg-type]
            target_modules=list(targets),
            lora_dropout=0.0,
            init_lora_weights=True,
        )
        if cfg.activation_checkpointing is not False:
            enable_checkpointing(model, cfg.activation_checkpointing)
        self.model = get_peft_model(model.to(device), lora)
        self.frozen = ("old", "ema") if cfg.ema_decay > 0 else ("old",)
        for name in self.frozen:
            self.model.add_adapter(name, lora)
        tuner = self.model.base_model  # peft types it nn.Module; a LoRA config makes a LoraModel
        assert isinstance(tuner, LoraModel), "a LoRA config's peft model tunes with LoraModel"
        tuner.set_adapter("default")
        self.layers: dict[str, LoraLayer] = {
            name.removeprefix(PEFT_PREFIX): m
            for name, m in self.model.named_modules()
            if isinstance(m, LoraLayer)
        }
        missing = [
            t for t in targets if not any(n == t or n.endswith("." + t) for n in self.layers)
        ]
        if missing or not self.layers:
            raise DiffrlError(f"LoRA targets {missing or targets} matched no module of the model")
        # the frozen base's row prints, sent with every update so the rollout can check where
        # its serving layout put each trained row (taken before any sharding: whole weights)
        base_weights = {n: _weight(layer.get_base_layer()) for n, layer in self.layers.items()}
        self.base_prints = BasePrints.of(base_weights)
        # the modules the adapter is on, whole (before sharding): the actor's half of the
        # bound-module gate (diffrl/sync/bound.py)
        self.bound = bound_of(base_weights)
        # TP replaces the sharded parameters by DTensor ones: before anything keys on them
        self.sharded = tensor_parallel is not None
        # what the model parallelism applied, in a line for the console ("" = none)
        layouts = [tensor_parallel(self.model)] if tensor_parallel is not None else []
        if sequence_parallel is not None:  # after TP, before precision, compile and FSDP2
            layouts.append(sequence_parallel(self.model))
        self.layout = "; ".join(layouts)
        self.sp_group = sp_group
        self.masters: dict[Tensor, Tensor] = {}  # LoRA factor -> its fp32 master (bf16 compute)
        # the precision the policy's forward computes in (the first-step gate's default
        # threshold depends on it), and whether that gate has run in this process
        base_dtype = next(p.dtype for n, p in self.model.named_parameters() if "lora_" not in n)
        self.compute_dtype = torch.bfloat16 if cfg.autocast == "bfloat16" else base_dtype
        self.gated = False
        self._init_precision(model)
        for name in self.frozen:  # == default at start (peft inits A randomly per adapter)
            self.blend(name, decay=0.0)
        self.compiled = compile_blocks(model, "actor.compile") if cfg.compile else 0
        if shard is not None:
            shard(self.model)
        self.trained: list[Tensor] = [
            p for n, p in self.model.named_parameters() if ".default." in n
        ]
        for p in self.trained:
            p.requires_grad_(True)
        # what the optimizer steps: the fp32 masters when the factors compute in bf16
        self.params = [self.masters[p] for p in self.trained] if self.masters else self.trained
        beta1, beta2 = cfg.betas  # a tuple, or a list from YAML
        # a multi-tensor (foreach) step, torch's default on GPUs, takes no mix of TP shards and
        # plain tensors: per tensor under TP
        foreach = False if self.sharded else None
        self.opt = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(beta1, beta2), weight_decay=cfg.weight_decay,
            foreach=foreach,
        )  # fmt: skip
        self.gen = torch.Generator().manual_seed(seed)
        self.version = 0  # optimizer steps taken
        self._step: PendingStep | None = None  # the optimizer step in progress
        self.nonfinite = 0

    def _init_precision(self, model: FamilyModel) -> None:
        """``lora_compute``: on a model in a 16-bit dtype with "auto", the LoRA factors move to
        that dtype, each with an fp32 master holding its value; the trained factors' gradients
        accumulate into their masters', in fp32, after each backward (``_fold_grads``)."""
        base = next(p.dtype for n, p in self.model.named_parameters() if "lora_" not in n)
        if self.cfg.lora_compute != "auto" or base not in (torch.bfloat16, torch.float16):
            return
        for layer in self.layers.values():
            for name in ("lora_A", "lora_B"):
                for mod in getattr(layer, name).values():
                    w = mod.weight
                    master = w.detach().float().clone()
                    if isinstance(w, DTensor):  # a TP shard: its .data cannot change dtype
                        w = torch.nn.Parameter(w.detach().to(base), w.requires_grad)
                        mod.weight = w
                    else:
                        w.data = w.data.to(base)
                    self.masters[w] = master

    def _fold_grads(self) -> None:
        """Move the bf16 factors' gradients into their fp32 masters' (one multi-tensor add per
        backward, not a hook per factor), leaving the factors without gradients."""
        if not self.masters:
            return
        folded = [(self.masters[w], w.grad) for w in self.trained if w.grad is not None]
        if not folded:
            return
        # on the local shards: a multi-tensor op takes no mix of TP shards and plain tensors
        torch._foreach_add_(
            [local(grad_or_zeros(m)) for m, _ in folded], [local(g) for _, g in folded]
        )
        for w in self.trained:
            w.grad = None

    @torch.no_grad()
    def _sync_from_masters(self, adapters: tuple[str, ...] | None = None) -> None:
        """Copy the masters (of ``adapters``, default all) into the factors the model uses."""
        for layer in self.layers.values():
            for name in ("lora_A", "lora_B"):
                for adapter, mod in getattr(layer, name).items():
                    if adapters is None or adapter in adapters:
                        mod.weight.copy_(self.masters[mod.weight])

    def _factor(self, mod: torch.nn.Module) -> Tensor:
        """A LoRA factor's value of record: its fp32 master, or the weight itself."""
        weight = mod.weight
        assert isinstance(weight, Tensor), "a LoRA factor is a layer with a weight"
        return self.masters.get(weight, weight)

    # --- the Policy the algorithms see -------------------------------------------------
    def velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        input_ids: Tensor,
        adapter: str | None = "default",
        cond: Tensor | None = None,
    ) -> Tensor:
        """``cond``: the batch's per-row conditions beyond the text (``TrainBatch.cond``).
        Under ``actor.autocast`` the forward computes in that dtype and returns ``x``'s."""
        if self.cfg.autocast == "off":
            return self._velocity(x, sigma, input_ids, adapter, cond)
        with torch.autocast(self.device.type, dtype=getattr(torch, self.cfg.autocast)):
            v = self._velocity(x, sigma, input_ids, adapter, cond)
        return v.to(x.dtype)

    def token_log_probs(
        self,
        tokens: Tensor,
        temperature: Tensor | float,
        input_ids: Tensor,
        adapter: str | None = "default",
        cond: Tensor | None = None,
    ) -> Tensor:
        """An autoregressive family's (B, T) per-token log-probs (its model's forward,
        ``models/family.py`` ``ARModel``) under ``adapter`` (None = the reference): the same
        adapter switching and autocast as ``velocity``, returned in float32."""
        if self.cfg.autocast == "off":
            return self._velocity(tokens, temperature, input_ids, adapter, cond).float()
        with torch.autocast(self.device.type, dtype=getattr(torch, self.cfg.autocast)):
            return self._velocity(tokens, temperature, input_ids, adapter, cond).float()

    def _velocity(self, x, sigma, input_ids, adapter, cond) -> Tensor:
        if adapter is None:
            with self.model.disable_adapter():
                return self.model(x, sigma, input_ids, cond)
        if adapter == "default":
            return self.model(x, sigma, input_ids, cond)
        self._activate(adapter)
        try:
            return self.model(x, sigma, input_ids, cond)
        finally:
            self._activate("default")

    def _activate(self, adapter: str) -> None:
        # peft's set_adapter also flips requires_grad; keep the others frozen whatever is active
        for layer in self.layers.values():
            layer.set_adapter(adapter)
            for name in ("lora_A", "lora_B"):
                for frozen in self.frozen:
                    getattr(layer, name)[frozen].requires_grad_(False)

    # --- training: one update path, an optimizer step whose rows arrive in parts -----------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update: ``minibatches`` optimizer steps over a shuffle of the batch, each a
        stream of one part. The diagnostics run first, under the rollout's weights."""
        self._check_tokens(batch)
        self.model.train()
        diagnose = len(batch) > 0 and self.reduction.diagnostics
        totals: dict[str, float] = self._diagnostics(batch) if diagnose else {}
        parts = self._minibatches(batch)
        for part in parts:
            self.begin_stream(len(part), diagnose=False)
            self.train_part(part)
            for k, v in self.end_stream().items():
                totals[k] = totals.get(k, 0.0) + v / len(parts)
        return totals

    def _check_tokens(self, batch: TrainBatch) -> None:
        """Contract 3 on what this rank is about to train on: the data stage's ids and
        conditions, and under TP/SP the same ones as the other ranks of its groups."""
        if self.rows_groups:
            check_tokens_across(batch, self.rows_groups, "the actor")  # collective
        else:
            check_token_hashes(batch, "the actor")

    def _minibatches(self, batch: TrainBatch) -> list[TrainBatch]:
        """The batch shuffled and cut into ``minibatches`` parts; an empty batch is one empty
        part (a data-parallel rank without rows still joins the step)."""
        n = len(batch)
        if n == 0:
            return [batch]
        k = min(self.cfg.minibatches, n)
        if batch.pairs is None:
            parts = [p for p in torch.randperm(n, generator=self.gen).chunk(k) if len(p)]
        else:  # keep each (winner, loser) pair whole and adjacent for pairwise losses
            pair_parts = torch.randperm(n // 2, generator=self.gen).chunk(max(1, min(k, n // 2)))
            parts = [torch.stack([2 * p, 2 * p + 1], 1).flatten() for p in pair_parts if len(p)]
        return [batch.select(p) for p in parts]

    def begin_stream(self, expected_rows: int, diagnose: bool = True) -> None:
        """Start one optimizer step whose rows arrive in parts (``train_part``), ``expected_rows``
        of them if none is filtered out. Each part's gradient accumulates at once, so training
        can overlap the rollout of the next part (``run.stream_train``); ``end_stream`` takes
        the step. ``diagnose``: the algorithm's diagnostics on the first part with rows."""
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        zero = torch.zeros((), device=self.device)
        diagnose = diagnose and self.reduction.diagnostics
        self._step = PendingStep(max(1, expected_rows), diagnose, zero)

    def train_part(self, part: TrainBatch) -> None:
        """Back-propagate one part (whole prompt groups, in arrival order), its micro-batches
        weighted as the reduction policy says."""
        st = self._step
        assert st is not None, "train_part outside begin_stream / end_stream"
        self._check_tokens(part)
        if st.diagnose and len(part) and st.rows == 0:  # under the rollout's weights
            st.diagnostics = self._diagnostics(part)
        passes = self.reduction.passes(part, self.cfg.micro_batch, st.expected)
        if passes is None:  # every rank skips this part: its rows are not in the step's mean
            return
        for rows, index, w in passes:
            mb = self._on_device(rows, index)
            st.total = self._backward(mb, w, st.total, st.metrics, st.maxima)
            st.passes += 1
        st.rows += len(part)

    def end_stream(self) -> dict[str, float]:
        """The step over every part: a mean over the rows that arrived (on every rank)."""
        st, self._step = self._step, None
        assert st is not None, "end_stream without begin_stream"
        if st.passes == 0:
            return {"actor/skipped_empty": 1.0}
        total, metrics = self.reduction.combine(self.params, st)
        self._sum_over_sp()
        out = {**st.diagnostics, **self._update(total, {**metrics, **st.maxima})}
        self._check_peers()
        if self.device.type == "cpu":  # the step's activations were host memory
            release_host_memory()
        return out

    def _check_peers(self) -> None:
        """After an optimizer step: the ranks that must hold the same adapters do (a checksum
        of every LoRA tensor all-gathered over each of ``peers``; ``parallel/drift.py``), else
        ``ContractError`` on every rank naming the rank, the tensor and the axis. Collective."""
        if not self.peers:
            return
        held = {
            n.removeprefix(PEFT_PREFIX): self.masters.get(p, p)
            for n, p in self.model.named_parameters()
            if "lora_" in n
        }
        # the ranks of a tp group hold different shards of the sharded factors; dp and sp
        # peers share a tp coordinate, so the same shards
        groups = {
            axis: (group, {n: local(t) for n, t in held.items() if axis != "tp" or whole(t)})
            for axis, group in self.peers.items()
        }
        check_adapters_across(groups, f"after optimizer step {self.version}")

    def _sum_over_sp(self) -> None:
        """Under sequence parallelism each rank of the sp group holds its tokens' share of the
        adapters' gradients (``parallel/sp.py``): the whole ones are their sum, in fp32, in one
        all-reduce; every rank of the group then clips and steps the same."""
        if self.sp_group is None:
            return
        grads = [local(grad_or_zeros(p)) for p in self.params]
        flat = torch.cat([g.float().reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=self.sp_group)
        start = 0
        for g in grads:
            g.copy_(flat[start : start + g.numel()].view_as(g))
            start += g.numel()

    def _on_device(self, batch: TrainBatch, index: Tensor) -> TrainBatch:
        """Rows ``index`` on the actor's device, the ids where the model wants them
        (``FamilyModel.ids_device``: a diffusers net keys its text conditions on host ids) and
        NFT's ``noise_key`` on the host (it only seeds host generators)."""
        host = ("input_ids", "noise_key") if self.ids_device.type == "cpu" else ("noise_key",)
        return batch.select(index, self.device, host=host)

    def _diagnostics(self, batch: TrainBatch) -> dict[str, float]:
        """The algorithm's no-grad diagnostics on the batch's first micro-batch (before the
        update: under the weights that sampled it); none without diagnostics."""
        if self.algorithm.diagnostics is None:
            return {}
        mb = self._on_device(batch, torch.arange(min(len(batch), self.cfg.micro_batch)))
        with torch.no_grad():
            out = host_floats(self.algorithm.diagnostics(self, mb, self.algo_cfg))
        gate = self.algorithm.first_step_gate
        if not self.gated and gate is not None:  # this process's first step, before any update
            self.gated = True
            gate(out, self.algo_cfg, self.compute_dtype)
        return out

    def _backward(
        self, mb: TrainBatch, w: float, total: Tensor, metrics: dict, maxima: dict | None = None
    ) -> Tensor:
        """One micro-batch's loss, back-propagated with weight ``w`` (its share of the
        optimizer step's rows); adds its weighted loss and metrics to the step's sums, and
        keeps the largest of its "*_max" metrics in ``maxima``."""
        if self.algorithm.partial_backward:  # one timestep's graph at a time

            def part_backward(part: Tensor, w: float = w) -> None:
                (part * w).backward()
                self._fold_grads()

            loss, m = self.algorithm.loss(self, mb, self.algo_cfg, self.gen, part_backward)
        else:
            loss, m = self.algorithm.loss(self, mb, self.algo_cfg, self.gen)
        if loss.requires_grad:
            (loss * w).backward()
            self._fold_grads()
        for k, v in m.items():
            if k.endswith("_max") and maxima is not None:
                if w > 0:  # a lockstep rank's spare pass (weight 0) is not one of its rows
                    maxima[k] = v if k not in maxima else _larger(maxima[k], v)
                continue
            metrics[k] = metrics.get(k, 0.0) + v * w
        return total + loss.detach().float() * w

    def _update(self, total: Tensor, metrics: dict) -> dict[str, float]:
        """Clip, guard against non-finite values, and take the optimizer step."""
        if self.sharded:  # some adapters are DTensor shards: the norm over the whole set
            norm = clip_grads(self.params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        loss, grad_norm = torch.stack([total, norm.float().to(total.device)]).tolist()
        metrics = host_floats(metrics)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.nonfinite += 1
            self.opt.zero_grad(set_to_none=True)
            log.warning(
                "non-finite loss/grad (loss=%s, grad_norm=%s): update skipped", loss, grad_norm
            )
            if self.nonfinite >= self.cfg.max_nonfinite_steps:
                raise NonFiniteLoss(
                    f"loss or gradients were NaN/inf for {self.nonfinite} steps in "
                    "a row; lower actor.lr or check the rewards"
                )
            return {**metrics, "actor/loss": loss, "actor/skipped_nonfinite": 1.0}
        self.nonfinite = 0
        lr = self.cfg.lr * lr_factor(self.cfg, self.version)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        if self.masters:
            self._sync_from_masters(("default",))
        self.version += 1
        if self.cfg.ema_decay > 0:
            self.blend("ema", decay=min(self.cfg.ema_decay, self.version / (self.version + 1)))
        return {**metrics, "actor/loss": loss, "actor/grad_norm": grad_norm, "actor/lr": lr}

    def update_old(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * default (decay=0: a copy)."""
        self.blend("old", decay)

    @torch.no_grad()
    def blend(self, adapter: str, decay: float) -> None:
        """adapter <- decay * adapter + (1 - decay) * default, factor by factor (LoRA A and B)."""
        for layer in self.layers.values():
            for name in ("lora_A", "lora_B"):
                mods = getattr(layer, name)
                target = self._factor(mods[adapter])
                target.mul_(decay).add_(self._factor(mods["default"]), alpha=1 - decay)
        if self.masters:
            self._sync_from_masters((adapter,))

    @property
    def eval_adapter(self) -> str:
        """The adapter held-out eval measures: the EMA when there is one."""
        return "ema" if self.cfg.ema_decay > 0 else "default"

    def export_weights(self, adapter: str = "default") -> WeightUpdate:
        deltas = {
            name: LoraDelta(
                a=full(self._factor(layer.lora_A[adapter])).detach().float().cpu().clone(),
                b=full(self._factor(layer.lora_B[adapter])).detach().float().cpu().clone(),
                scale=float(layer.scaling[adapter]),
            )
            for name, layer in self.layers.items()
        }
        return WeightUpdate.build(self.version, adapter, deltas, self.base_prints)

    # --- checkpoints (tensors only; loaded with weights_only=True) ------------------------
    def adapter_tensors(self) -> dict[str, Tensor]:
        """Every adapter's factors by parameter name (the fp32 masters where there are), whole:
        TP shards are gathered (a collective: every rank calls it), so the format is the
        one-process one whatever the layout."""
        return {
            n: full(self.masters.get(p, p)).detach().cpu().clone()
            for n, p in self.model.named_parameters()
            if "lora_" in n
        }

    def state_dict(self) -> dict:
        return {
            "optimizer": _whole_state(self.opt.state_dict()),
            "version": self.version,
            "gen": self.gen.get_state(),
            "nonfinite": self.nonfinite,
        }

    def load_state(self, adapters: dict[str, Tensor], state: dict) -> None:
        """Restore adapters and optimizer state. A run resumed with ``ema_decay`` switched on
        starts its average from the resumed weights; switched off, it drops the saved one."""
        params = dict(self.model.named_parameters())
        saved_ema = any(".ema." in n for n in adapters)
        if saved_ema and "ema" not in self.frozen:
            log.warning("checkpoint has an EMA adapter and actor.ema_decay is 0: dropping it")
            adapters = {n: t for n, t in adapters.items() if ".ema." not in n}
        start_ema = "ema" in self.frozen and not saved_ema
        if start_ema:
            log.warning("checkpoint has no EMA adapter: the average starts at the resumed weights")
        missing = sorted(
            n
            for n in params
            if "lora_" in n and n not in adapters and not (start_ema and ".ema." in n)
        )
        if missing:
            raise DiffrlError(f"checkpoint lacks adapter tensors {missing[:4]}")
        with torch.no_grad():
            for n, t in adapters.items():
                if n not in params or params[n].shape != t.shape:
                    raise DiffrlError(
                        f"checkpoint tensor {n} {tuple(t.shape)} does not fit the "
                        "model (different LoRA rank or targets?)"
                    )
                target = self.masters.get(params[n], params[n])
                target.copy_(like(t, target))
        if self.masters:
            self._sync_from_masters()
        if start_ema:
            self.blend("ema", decay=0.0)
        self.opt.load_state_dict(state["optimizer"])
        if self.sharded:  # the whole moments, split as their parameters are
            for p in self.params:
                for k, v in self.opt.state.get(p, {}).items():
                    if isinstance(v, Tensor) and v.ndim:
                        self.opt.state[p][k] = like(v, p)
        self.version = int(state["version"])
        self.gen.set_state(state["gen"])
        self.nonfinite = int(state["nonfinite"])


def _whole_state(state: dict) -> dict:
    """An optimizer state dict with every TP-sharded tensor gathered (a collective)."""
    per_param = {i: {k: full(v) for k, v in s.items()} for i, s in state["state"].items()}
    return {**state, "state": per_param}


def whole(t: Tensor) -> bool:
    """Whether every rank of ``t``'s mesh holds all of it (a plain tensor, or a DTensor
    replicated on every mesh dimension), not a shard."""
    return not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements)


def _weight(module: torch.nn.Module) -> Tensor:
    """A LoRA-wrapped module's base weight (peft types the attribute loosely)."""
    weight = module.weight
    if not isinstance(weight, Tensor):
        raise DiffrlError(f"LoRA wraps {type(module).__name__}, which has no weight tensor")
    return weight


def _larger(a: Tensor | float, b: Tensor | float) -> Tensor | float:
    """max(a, b) without a host sync when both are device tensors."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return torch.maximum(a, b.to(a.device))
    return max(float(a), float(b))
