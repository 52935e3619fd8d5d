"""``diffrl plan``: a recipe's memory per GPU, by component, before any GPU is used, and the knob
to turn when a layout does not fit.

Reached from ``diffrl plan``; ``diffrl train`` uses ``held_tensors`` alone, to print what each
rank holds after its first update, the figure the plan's resident rows are checked against
(``Plan.resident``; tests/parallel/test_h3_8rank_cli.py: 8 gloo ranks at tp 4, etp 4).

**Sizes are counted, never typed in.** The family's own ``load`` builds the model from the
recipe (preset or directory) under ``components_on_meta``, where every weight-making call
(``random_component``, ``load_component``) builds the same class on the ``meta`` device, so the
counts are the real diffusers/transformers classes' at the recipe's size, trimmed as the
family trims them (H3's encoder keeps 51 of its 64 layers), and on the device the family puts
them (an encoder the family keeps on the host is "offloaded"). A 33 B DiT costs no memory.

**Where the bytes go, per GPU.** Parallel degrees follow ``ParallelDims`` (``dims.py``):

- *Weights* in the model's dtype. A module the family's TP plan (``FamilySpec.tp_plan``)
  shards holds 1/tp of its weight, and of its bias unless it is a row shard; the rest (norms,
  embeddings, H3's adaLN projections, whatever the plan leaves out) is replicated. FSDP
  (``dp_shard``) then shards the actor's share, and holds two blocks unsharded at a time (the
  one running and the prefetched next) while it trains: a train-phase row, since FSDP frees
  them after each block.
- *Training state*, TP-sharded as the weights it belongs to. LoRA: FSDP leaves the adapters
  whole (``parallel/fsdp.py``: ``ignored_params``), so dp_shard does not divide them; peft
  keeps them in
  fp32 (``default``, ``old``, and ``ema`` when ``actor.ema_decay`` > 0), plus the default's
  fp32 gradient and AdamW's two fp32 moments: 4 bytes per adapter, + 4 + 8, per adapter
  weight. Full weights (``--train full``, plan-only: the actor trains LoRA): fp32 gradients
  (FSDP's fp32 reduction) and AdamW moments, 12 bytes per weight beside the bf16 weight,
  ``old`` as a full frozen copy, and the activations as for LoRA (peft's fp32 input copies
  become the Linears' own bf16 inputs, kept for every Linear, not only the targets).
- *The rollout's copy*: ``RolloutEngine`` deep-copies the DiT, and the held-out evaluator
  (``build.build``) holds another; each keeps a frozen base copy of the
  LoRA-targeted weights for verified sync (``rollout.base_copy``: "" on the GPU, "cpu" on the
  host). Copies are never FSDP-sharded. Under tp they are TP-sharded with the actor's plan
  when ``parallel.rollout`` is "sharded" (the default) and whole on every rank when
  "replicated" (``--rollout`` overrides the key); the rollout's no-grad forward is counted at
  the actor's per-rank widths either way. ``--share-rollout`` samples with the actor's own
  weights instead (``RolloutEngine(share_model=True)``: no copy, no sync). With
  ``rollout.share_base`` the copies alias the actor's frozen weights and hold only their
  synced LoRA factors, in the model's dtype, and no sync base copy (``sync/shared_base.py``;
  one process, tp 1, no FSDP, LoRA training).
- *Text encoders*: sharded by ``etp`` where the family's ``FamilySpec.etp_plans`` has a plan
  for the encoder's ``model_type`` (replicated otherwise); offloaded, 0 resident, and for each
  encode the family streams it in from pinned host memory (``models/host_offload.py``): the
  encode phase counts all but its decoder layers plus two layers at a time.

**Activations, per block and per token**, for LoRA training in bf16 (what autograd keeps for
the backward, read off each block's forward; each family's ``FamilySpec.geometry`` sums them
into its blocks' bytes; ``tests/parallel/test_plan.py`` checks every
formula against autograd's saved tensors of the real block on the CPU). With h the residual
width, a attention's inner width and f the FFN's hidden width, each divided by tp where the
TP plan shards that part, and r the LoRA rank:

- peft casts each targeted Linear's input to fp32 and keeps it for lora_A's gradient: 4 bytes
  per input element, the largest single term (a frozen Linear keeps nothing of its own);
- SDPA (flash) keeps q, k, v and its output in bf16: 8a;
- an RMSNorm keeps its input: nn.RMSNorm 2 bytes per element on CUDA (aten's fused kernel; 4
  on the CPU, whose composite path keeps an fp32 copy), diffusers' RMSNorm 6 (an fp32 copy
  and the bf16 input); a LayerNorm 2;
- GELU keeps its input (2f); SwiGLU keeps the fused [up; gate] projection and silu(gate) (6f).

That gives per token (on CUDA):

- MiniMax-H3 block: 28h + 16a + 10f (h-terms: the two norms' inputs 4h, four per-row adaLN
  tables 8h, q/k/v and FFN-up LoRA inputs 16h; a: q/k norms 4a, SDPA 8a, out-LoRA 4a; f:
  SwiGLU 6f, down-LoRA 4f). Token refiner block (text rows): 20h + 16a + 10f (no adaLN
  tables).
- SD3 joint block, image token: 20h + 24a + 6f (+20a in SD3.5's dual-attention blocks);
  text token: 16h + 24a + 2f (14h + 20a in the last, context_pre_only block; the text FFN
  is not a LoRA target). SD3.5-M has h = a = 1536, f = 4h: 68h per image token.
- LTX-2 block, per token of either stream (its own h, a, f; x the audio<->video pair's
  attention width, the audio attention's): 56h + 34a + 24x + 6f (h: four diffusers RMSNorms
  24h, eight LoRA inputs 32h: self q/k/v, text q, the pair's q and k/v, FFN-up; a: q/k norms
  6a, SDPA's self q/k/v/out and text q/out 12a, two out-LoRAs 8a, RoPE tables 8a; x: q/k
  norms 4x, SDPA 8x, the pair's out-LoRA 4x, RoPE 8x; f: GELU 2f, down-LoRA 4f). Per text
  token, in each stream: 8h + 6a (k/v LoRA inputs, k norm, SDPA's k and v). A frame-
  conditioned video token (I2AV, FL2VA: its own timestep) adds per-token adaLN, 16h (the
  six tables' sum, which the gates keep, and two 1 + scale). The RoPE tables are made once
  per forward and kept by every block: counted once. LTX-2.0 has h = a = 4096, f = 4h and
  x = the audio stream's h = 2048: about 126h per video token.

plus a few bytes per row (norm statistics, the attention's log-sum-exp, 4r per LoRA module,
H3's rotary tables). Without checkpointing a micro-batch keeps every block's set; with
``actor.activation_checkpointing`` it keeps each block's input (2h per token per stream)
plus one block's set, recomputed in the backward; with N, the first N blocks' inputs and the
other blocks' sets (``checkpointed``). Either way the backward holds one more block's worth of
gradient buffers. A layout over budget is offered the fewest N that fit
(``fewest_checkpointed``), one that fits with more checkpointing is told that N. The
rollout's no-grad forward holds one block's largest live set (H3: 4h + 8f at the SwiGLU; SD3:
the larger of 4h + 4f and 4h + 14a).

Calibrated on one H200 (bf16, LoRA r=32; ``tests/parallel/test_plan.py``): SD3.5-Medium
512 px, rollout of 8 with CFG and one NFT step of micro-batch 8, no checkpointing, measured
48.97 GiB; MiniMax-H3, 2 FL2VA samples of 352 x 352 x 124 frames, checkpointing, encoder
offloaded, one copy, measured 75.75 GiB for the step. Planned: 50.0 (+2%) and 76.6 (+1%).
LTX-2 T2VA (``tests/parallel/test_plan_av.py``), 2 clips of 121 frames at 512 x 512,
checkpointing, Gemma-3 on the GPU, one copy: measured 73.02 GiB for the step and 70.25 in the
encode; planned 74.3 (+1.7%) and 69.2 (-1.5%).

Not modelled: a video VAE's decode (image VAEs: three tensors of the last upsampling's width
per output pixel), the CUDA context, NCCL's buffers and the allocator's fragmentation, which
``HEADROOM`` keeps free of the card; and, between steps, the step's trajectories, the task's
keyframe conditions, the encode cache and the verified sync's float64 probes (about 1.7 MiB
of the tiny H3 runs' 29-38 MiB, the plan's 5% under what they hold).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import PreTrainedModel

from diffrl.errors import ConfigError
from diffrl.models.family import FamilySpec, transformer_blocks
from diffrl.models.host_offload import visiting_bytes
from diffrl.models.memory import Geometry, Widths
from diffrl.parallel.dims import KEY, ParallelDims
from diffrl.parallel.tp import ShardedRMSNorm, resolve

GIB = 2**30
H200_GIB = 141.0  # nvidia-smi: 143,771 MiB
# what a layout leaves free of the card: the totals are allocated bytes, what
# torch.cuda.max_memory_allocated reports; fragmentation, the CUDA context and NCCL take more
HEADROOM = 0.08
PHASES = ("resident", "encode", "rollout", "train")
ROLLOUT_LAYOUTS = ("replicated", "sharded")
WEIGHT_SHARDS = (ColwiseParallel, RowwiseParallel, ShardedRMSNorm)  # TP styles that split weights


FL2VA_KEYS = frozenset({"first_frame", "last_frame"})


def condition_keys(task, family) -> frozenset[str]:
    """The keys of the conditions ``task`` gives each prompt beyond its text, as the data
    stage asks for them (``build.prompt_set``: its first training prompt, at the family's
    media geometry): {"first_frame", "last_frame"} FL2VA, {"first_frame"} I2AV, {"ref_image",
    "ref_audio"} Ref2VA; empty for a text-only task. (``task`` is read as the data stage's
    ``ConditionedTask``, by its attributes: the planner imports no task.)"""
    if not getattr(task, "needs_conditions", False):
        return frozenset()
    geometry = getattr(family, "media_geometry", None)
    if geometry is None:
        raise ConfigError(
            f"plan: task {task.name!r} conditions each prompt on media, and model family "
            f"{family.name!r} takes no conditions beyond the text"
        )
    try:
        conds = task.prompt_conditions(task.prompts("train")[:1], geometry())
    except ValueError as e:  # what the data stage of `diffrl train` would refuse too
        raise ConfigError(f"plan: task {task.name!r} at the model's {geometry()}: {e}") from None
    return frozenset(conds[0]) if conds else frozenset()


@dataclass(frozen=True)
class PlanOptions:
    """The parallel degrees (the config's ``parallel`` section, overridden here where given;
    the world size is the planner's own, since there is no launcher) and the plan-only
    switches. ``None`` = take the config's (or the family's) value."""

    world_size: int | None = None
    tp: int | None = None
    etp: int | None = None
    dp_shard: int | None = None  # -1 (default): what the other degrees leave of the world
    dp_replicate: int | None = None
    sp: int | None = None
    gpu_gib: float = H200_GIB
    share_rollout: bool = False  # rollout and eval sample with the actor's own weights
    # the rollout's and evaluator's copies under tp: "sharded" (the actor's TP layout) or
    # "replicated" (whole on every rank); None: the config's parallel.rollout, else "sharded"
    rollout: str | None = None
    offload_encoder: bool | None = None  # None: where the family puts its encoder
    train: str = "lora"  # lora (what ActorEngine trains) | full
    eval_copy: bool = True  # the factory's held-out evaluator holds its own copy of the DiT
    device: str = "cuda"  # whose kernels the activation formulas assume (cuda | cpu)
    # the keys of the conditions the task gives each prompt beyond its text, which the family's
    # geometry sizes (``condition_keys``: the CLI asks the recipe's task); True: FL2VA's
    conditioned: frozenset[str] | bool = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.conditioned, bool):  # the families' geometry reads keys
            keys = FL2VA_KEYS if self.conditioned else frozenset()
            object.__setattr__(self, "conditioned", keys)

    def rollout_layout(self, cfg) -> str:
        layout = self.rollout or getattr(getattr(cfg, KEY, None), "rollout", "sharded")
        if layout not in ROLLOUT_LAYOUTS:
            raise ConfigError(f"plan: {KEY}.rollout={layout!r}; one of {ROLLOUT_LAYOUTS}")
        return layout

    def degrees(self, cfg) -> ParallelDims:
        section = getattr(cfg, KEY, None)
        out = {}
        for name in ("world_size", "tp", "etp", "dp_shard", "dp_replicate", "sp"):
            given = getattr(self, name)
            default = getattr(section, name, getattr(ParallelDims, name))
            out[name] = default if given is None else given
        return ParallelDims(**out)


@dataclass(frozen=True)
class Row:
    component: str
    phase: str  # resident (held throughout) | encode | rollout | train (held in that phase)
    gib: float  # per GPU
    note: str
    host_gib: float = 0.0


# --- what a run holds, measured ---------------------------------------------------------------


def held_tensors(device_type: str) -> dict[str, int]:
    """The bytes of every live tensor's storage on ``device_type`` in this process, each
    storage once, by kind: "parameters" (``nn.Parameter``s: the DiT copies, the adapters, the
    encoders), "other" (buffers, optimizer state, gradients, sync base copies, encode caches,
    a step's data). A DTensor counts its local shard; a storage FSDP has freed (resized to 0)
    counts nothing. What ``diffrl train`` reports after its first update, against the plan's
    resident rows (``Plan.resident``).

    Found through the garbage collector, which tracks every Python-visible tensor; tensors
    only C++ holds (autograd's saved tensors, a collective's buffers) are not seen, which is
    why this is read between steps, when none should be alive."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    # by type, not isinstance: isinstance reads __class__, which a dead weakref proxy raises
    # on (ReferenceError) and a deprecated torch object warns on
    tensors = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]
    seen: dict[int, tuple[str, int]] = {}
    for obj in tensors:
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if t.device.type != device_type or t.is_sparse or t.is_meta:  # meta: no bytes
            continue
        if isinstance(t, FakeTensor):  # compile's tracing values, left alive: no bytes (its
            continue  # data pointer reads as a real one, and warns)
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage of its own (a wrapper
            continue  # subclass)
        kind = "parameters" if isinstance(obj, nn.Parameter) else "other"
        if nbytes and (ptr not in seen or kind == "parameters"):
            seen[ptr] = (kind, nbytes)
    out = dict.fromkeys(("parameters", "other"), 0)
    for kind, nbytes in seen.values():
        out[kind] += nbytes
    return out


# --- sizes on the meta device -----------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """A recipe's model built on ``meta`` (the real classes, no memory), and where the family
    put each frozen component."""

    model: nn.Module  # the FamilyModel
    spec: FamilySpec  # the family's record: its TP/ETP plans and memory geometry
    frozen: dict[str, nn.Module]
    on_host: frozenset[str]  # frozen components the family keeps in host memory

    @property
    def family(self) -> str:
        return self.spec.name

    @property
    def encoders(self) -> dict[str, nn.Module]:
        """The frozen modules that are text encoders (transformers models; the rest: VAEs)."""
        return {k: m for k, m in self.frozen.items() if isinstance(m, PreTrainedModel)}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """diffusers' "should be kept in float32" notices and warnings are noise here: sizes only."""
    import diffusers.utils.logging  # noqa: F401  (configures its logger: before we quiet it)

    quiet = logging.getLogger("diffusers")
    level = quiet.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet.setLevel(logging.ERROR)
        try:
            yield
        finally:
            quiet.setLevel(level)


def model_facts(cfg, device: str = "cuda") -> ModelFacts:
    """Build ``cfg.model`` on meta through the family's own ``load``, told the run's device
    (so it places its components as it would there: H3 offloads its encoder for CUDA runs);
    nothing is allocated on it, every component being built under ``components_on_meta``."""
    from diffrl.models.families._diffusers import components_on_meta
    from diffrl.models.registry import family, frozen_modules

    spec = family(cfg.model.resolved_family)
    if spec.geometry is None:
        raise ConfigError(
            f"diffrl plan has no activation model for model family {spec.name!r} yet: give "
            "its FamilySpec a `geometry` (the per-block formula, see diffrl/models/memory.py)"
        )
    host: set[int] = set()
    with _quiet(), components_on_meta(host):
        model = spec.load(cfg.model, torch.device(device))
    frozen = frozen_modules(model)  # the net's shared encoders (and VAEs); the family's VAE:
    frozen |= {
        k: m
        for k, m in vars(model.family).items()
        if isinstance(m, nn.Module) and m is not model.net
    }
    return ModelFacts(model, spec, frozen, frozenset(k for k, m in frozen.items() if id(m) in host))


# --- bytes per GPU ----------------------------------------------------------------------------


def _tp_styles(module: nn.Module, plan: dict | None, tp: int) -> dict[str, object]:
    """Module path -> the style ``plan`` shards its weight with (column shards, fused ones
    included, row shards, ``ShardedRMSNorm``); empty at tp 1 or without a plan. Other styles
    (``LocalHeads``, ``PerHeadNorm``) shard no weight."""
    if not plan or tp == 1:
        return {}
    out = {}
    for pattern, paths in resolve(module, plan).items():
        if isinstance(plan[pattern], WEIGHT_SHARDS):
            out.update(dict.fromkeys(paths, plan[pattern]))
    return out


def _tensor_bytes(module: nn.Module, styles: dict[str, object], tp: int) -> dict[str, float]:
    """Parameter or buffer name -> bytes on one rank: a sharded module's weight is split tp
    ways, and so is its bias unless the shard is a row shard (whose bias is replicated)."""
    out = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        owner, _, leaf = name.rpartition(".")
        style = styles.get(owner)
        split = leaf == "weight" or (leaf == "bias" and not isinstance(style, RowwiseParallel))
        out[name] = t.numel() * t.element_size() / (tp if style is not None and split else 1)
    return out


def _targets(cfg) -> list[str]:
    from diffrl.models.registry import lora_targets

    return list(cfg.actor.lora.targets) or list(lora_targets(cfg.model))


def _is_target(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _lora_numel(dit: nn.Module, targets: list[str], rank: int, styles, tp: int):
    """(adapter weights per rank, targeted Linears): A is r x in, B out x r; a column shard
    splits B, a row shard A."""
    total, n = 0.0, 0
    for name, m in dit.named_modules():
        if isinstance(m, nn.Linear) and _is_target(name, targets):
            a, b = rank * m.in_features, m.out_features * rank
            style = styles.get(name)
            if isinstance(style, RowwiseParallel):
                a /= tp
            elif style is not None:  # a column shard (plain or fused)
                b /= tp
            total, n = total + a + b, n + 1
    return total, n


def _largest_block(dit: nn.Module, sizes: dict[str, float]) -> float:
    """Bytes on one rank of the largest entry of the DiT's block lists."""
    prefixes = [
        f"{name}.{i}."
        for name, m in dit.named_modules()
        if isinstance(m, nn.ModuleList)
        for i in range(len(m))
    ]
    blocks = [sum(v for k, v in sizes.items() if k.startswith(p)) for p in prefixes]
    return max(blocks, default=0.0)


def _encoder_dims(m: nn.Module) -> tuple[int, int, int]:
    """(hidden, FFN width, layers) of a text encoder's config (CLIP, T5, Qwen3-VL...)."""
    c = getattr(m.config, "text_config", m.config)
    hidden = getattr(c, "hidden_size", None) or c.d_model
    ffn = getattr(c, "intermediate_size", None) or c.d_ff
    layers = getattr(c, "num_hidden_layers", None) or c.num_layers
    return hidden, ffn, layers


def _encoder_heads(m: nn.Module) -> tuple[int, int]:
    c = getattr(m.config, "text_config", m.config)
    heads = getattr(c, "num_attention_heads", None) or c.num_heads
    return heads, getattr(c, "num_key_value_heads", None) or heads


@dataclass(frozen=True)
class Plan:
    rows: list[Row]
    dims: ParallelDims  # resolved
    title: str
    gpu_gib: float
    advice: list[str] = dataclasses.field(default_factory=list)
    device: str = "cuda"  # the run's: on the CPU the [host] rows are the device's memory too

    def phase(self, name: str) -> float:
        """GiB per GPU held in ``name``: what is resident plus that phase's own rows."""
        return sum(r.gib for r in self.rows if r.phase in ("resident", name))

    @property
    def resident(self) -> float:
        """GiB per rank held between steps: the resident rows, and on the CPU their [host]
        parts too. What ``diffrl train`` measures after its first update (``held_tensors``)."""
        host = self.device == "cpu"
        rows = [r for r in self.rows if r.phase == "resident"]
        return sum(r.gib + (r.host_gib if host else 0.0) for r in rows)

    @property
    def peak(self) -> tuple[str, float]:
        return max(((p, self.phase(p)) for p in PHASES[1:]), key=lambda x: x[1])

    @property
    def budget(self) -> float:
        return self.gpu_gib * (1 - HEADROOM)

    @property
    def fits(self) -> bool:
        return self.peak[1] <= self.budget

    def table(self) -> str:
        d = self.dims
        lines = [
            self.title,
            f"layout: world {d.world_size} = dp_replicate {d.dp_replicate} x dp_shard "
            f"{d.dp_shard} x sp {d.sp} x tp {d.tp}; etp {d.etp}",
            "",
            f"{'component':34s} {'phase':8s} {'GiB/GPU':>8s}  note",
        ]
        for r in self.rows:
            host = f" [host: {r.host_gib:.2f} GiB]" if r.host_gib else ""
            lines.append(f"{r.component:34s} {r.phase:8s} {r.gib:8.2f}  {r.note}{host}")
        totals = " | ".join(f"{p} {self.phase(p):.2f}" for p in PHASES[1:])
        phase, peak = self.peak
        spare = self.budget - peak
        verdict = f"fits: {spare:.1f} GiB to spare" if self.fits else f"OVER by {-spare:.1f} GiB"
        lines += [
            "",
            f"per-GPU totals (GiB): {totals}",
            f"peak {peak:.2f} GiB ({phase}) against {self.gpu_gib:g} GiB less "
            f"{HEADROOM:.0%} headroom ({self.budget:.1f} GiB): {verdict}",
            f"held between steps: {_gib_or_mib(self.resident)} per rank (diffrl train prints "
            "what its ranks hold after the first update)",
        ]
        host = sum(r.host_gib for r in self.rows)
        if host:
            lines.append(f"host memory per process: {host:.1f} GiB (the [host] rows)")
        lines += self.advice
        return "\n".join(lines)


def _gib_or_mib(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"


def _widths(dit: nn.Module, styles: dict, tp: int, rank: int, device: str) -> Widths:
    """The DiT's per-token widths on one rank: a and f divided where the TP plan shards the
    attention's to_q and the FFN's up-projection."""
    c = dit.config
    inner = c.num_attention_heads * c.attention_head_dim
    tp_a = tp if any(p.endswith("attn.to_q") for p in styles) else 1
    tp_f = tp if any(p.endswith("ff.net.0.proj") for p in styles) else 1
    return Widths(
        h=getattr(c, "hidden_size", None) or inner,
        a=inner / tp_a,
        f=(getattr(c, "ffn_dim", None) or 4 * inner) / tp_f,  # diffusers' FeedForward: 4x
        heads=c.num_attention_heads / tp_a,
        r=rank,
        rms=2 if device == "cuda" else 4,
    )


def estimate(facts: ModelFacts, cfg, opts: PlanOptions) -> Plan:
    """The per-GPU rows of ``cfg`` under ``opts`` (without advice; ``plan`` adds it)."""
    held, activations = _parts(facts, cfg, opts)
    return dataclasses.replace(held, rows=held.rows + activations(cfg))


def _parts(facts: ModelFacts, cfg, opts: PlanOptions) -> tuple[Plan, Callable[..., list[Row]]]:
    """``cfg``'s plan without its activation rows, and the function giving those for a config
    of the same model and layout (``fewest_checkpointed`` tries many without re-counting)."""
    if opts.train not in ("lora", "full"):
        raise ConfigError(f"plan: --train {opts.train!r}; lora or full")
    dit = facts.model.net.transformer
    tp_plan = facts.spec.tp_plan
    heads = [_encoder_heads(m) for m in facts.encoders.values() if _encoder_plan(facts, m)]
    dims = opts.degrees(cfg).validate(
        dit_heads=dit.config.num_attention_heads,
        encoder_heads=[h for h, _ in heads],
        kv_heads=[kv for _, kv in heads],
        family_has_tp_plan=tp_plan is not None,
    )
    styles = _tp_styles(dit, tp_plan, dims.tp)
    sizes = _tensor_bytes(dit, styles, dims.tp)
    w = _widths(dit, styles, dims.tp, cfg.actor.lora.rank, opts.device)
    geo = facts.spec.geometry(facts.model, w, opts.conditioned)
    samples = math.ceil(cfg.data.prompts_per_step * cfg.rollout.group_size / dims.dp)  # a rank's
    rows = [
        *_weight_rows(facts, cfg, opts, dims, styles, sizes),
        *_encoder_rows(facts, cfg, opts, dims, geo, samples),
    ]
    name = cfg.model.preset or cfg.model.path
    title = f"diffrl plan: {facts.family} ({name}), {geo.tokens}"
    listed = len(transformer_blocks(facts.model))
    held = Plan(rows, dims, title, opts.gpu_gib, device=opts.device)
    return held, lambda c: _activation_rows(c, dims, geo, samples, listed)


def _weight_rows(facts: ModelFacts, cfg, opts: PlanOptions, dims, styles, sizes) -> list[Row]:
    """The DiT's copies and the actor's training state."""
    dit, fsdp = facts.model.net.transformer, dims.dp_shard
    local = sum(sizes.values())
    whole = sum(t.numel() * t.element_size() for t in [*dit.parameters(), *dit.buffers()])
    n_params = sum(p.numel() for p in dit.parameters())
    split = f"{local / whole:.0%} of it per TP rank" if dims.tp > 1 else "whole"
    split += f", FSDP / {fsdp}" if fsdp > 1 else ""
    rows = [
        Row("DiT weights (actor)", "resident", local / fsdp / GIB,
            f"{n_params / 1e9:.2f} B params in {cfg.model.dtype}; {split}"),
    ]  # fmt: skip
    targets = _targets(cfg)
    if opts.train == "lora":
        numel, n_mod = _lora_numel(dit, targets, cfg.actor.lora.rank, styles, dims.tp)
        adapters = 3 if cfg.actor.ema_decay > 0 else 2  # default, old (, ema)
        per = 4 * adapters + 4 + 8  # bytes per adapter weight: fp32 adapters, grad, m and v
        rows.append(
            Row("LoRA adapters + grad + AdamW", "resident", numel * per / GIB,
                f"r={cfg.actor.lora.rank} on {n_mod} Linears ({numel / 1e6:.1f} M per adapter "
                f"per rank); {adapters} adapters, a grad and 2 moments, fp32; FSDP leaves "
                "them whole")
        )  # fmt: skip
    else:
        rows.append(
            Row("grads + AdamW (full weights)", "resident", local / 2 * 12 / fsdp / GIB,
                "fp32 grads (fp32 reduction), AdamW m and v in fp32")
        )  # fmt: skip
        rows.append(Row("old policy (full copy)", "resident", local / fsdp / GIB, "frozen"))
    if fsdp > 1:
        rows.append(
            Row("FSDP all-gather (2 blocks)", "train", 2 * _largest_block(dit, sizes) / GIB,
                "the running block and the prefetched next, unsharded")
        )  # fmt: skip
    if opts.share_rollout or getattr(cfg.rollout, "share_model", False):
        rows.append(
            Row("rollout + eval copies", "resident", 0.0, "shared: sample with the actor's")
        )
        return rows
    if cfg.rollout.share_base:
        return rows + _shared_base_rows(dit, cfg, opts, dims, targets)
    host = cfg.rollout.base_copy == "cpu"
    # parallel.rollout: the copies in the actor's TP layout, or whole on every rank
    sharded = opts.rollout_layout(cfg) == "sharded" or dims.tp == 1
    if not sharded:
        sizes, local = _tensor_bytes(dit, {}, 1), whole
    how = "TP-sharded" if dims.tp > 1 and sharded else "whole"
    base = sum(v for k, v in sizes.items() if k.endswith(".weight") and _is_target(k[:-7], targets))
    for name in ("rollout", "eval") if opts.eval_copy else ("rollout",):
        rows.append(
            Row(f"{name} copy of the DiT", "resident", local / GIB,
                f"RolloutEngine's deepcopy; {how}, not FSDP")
        )  # fmt: skip
        rows.append(
            Row(f"{name} sync base copy", "resident", 0.0 if host else base / GIB,
                f"LoRA-targeted weights, frozen (rollout.base_copy={cfg.rollout.base_copy!r})",
                base / GIB if host else 0.0)
        )  # fmt: skip
    return rows


def _shared_base_rows(dit: nn.Module, cfg, opts: PlanOptions, dims, targets) -> list[Row]:
    """``rollout.share_base``: the copies alias the actor's frozen base and hold their synced
    LoRA as factors in the model's dtype (``sync/shared_base.py``), no base copy; what cannot
    share is refused as ``build`` refuses it."""
    if opts.train != "lora":
        raise ConfigError(
            "plan: rollout.share_base=true with --train full: a fully fine-tuned actor changes "
            "the base the rollout would share; share_base needs LoRA training"
        )
    if dims.tp > 1 or dims.dp > 1:
        raise ConfigError(
            f"plan: rollout.share_base=true at tp {dims.tp}, {dims.dp} data-parallel ranks: the "
            "actor's base is then TP- or FSDP2-sharded and cannot be shared (parallel.tp=1 and "
            "one data-parallel rank)"
        )
    numel, n_mod = _lora_numel(dit, targets, cfg.actor.lora.rank, {}, 1)
    size = next(dit.parameters()).element_size()
    rows = []
    for name in ("rollout", "eval") if opts.eval_copy else ("rollout",):
        rows.append(
            Row(f"{name} LoRA factors (shared base)", "resident", numel * size / GIB,
                f"r={cfg.actor.lora.rank} on {n_mod} Linears in {cfg.model.dtype}; the DiT's "
                "weights are the actor's (rollout.share_base)")
        )  # fmt: skip
    return rows


def _encoder_plan(facts: ModelFacts, m: nn.Module) -> dict | None:
    """The family's ETP plan for encoder ``m``, found by its ``config.model_type``."""
    return facts.spec.etp_plans.get(getattr(m.config, "model_type", ""))


def _encoder_rows(facts: ModelFacts, cfg, opts, dims, geo: Geometry, samples: int) -> list[Row]:
    """The frozen modules: text encoders (ETP, offloaded or replicated) and the VAEs."""
    offload = _offload(cfg, opts, facts, dims)
    prompts = max(1, min(cfg.rollout.max_batch // cfg.rollout.group_size, samples))  # per encode
    rows = []
    for name, m in facts.frozen.items():
        whole = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
        if name not in facts.encoders:
            rows.append(Row(name, "resident", whole / GIB, f"{type(m).__name__}, replicated"))
            continue
        plan = _encoder_plan(facts, m)
        etp = dims.etp if plan and not offload else 1
        local = sum(_tensor_bytes(m, _tp_styles(m, plan, etp), etp).values())
        how = f"ETP / {etp}" if etp > 1 else "replicated"
        if offload:
            how = "offloaded: host memory, on the GPU only to encode"
        rows.append(
            Row(f"text encoder {name}", "resident", 0.0 if offload else local / GIB,
                f"{type(m).__name__}, {whole / GIB:.2f} GiB whole; {how}",
                whole / GIB if offload else 0.0)
        )  # fmt: skip
        if offload:  # streamed from pinned host memory, a layer ahead (models/host_offload.py)
            visit = visiting_bytes(m)
            rows.append(
                Row(f"{name}, visiting to encode", "encode", visit / GIB,
                    "streamed: all but its layers, and two layers at a time")
            )  # fmt: skip
        hidden, width, layers = _encoder_dims(m)
        tokens = geo.encoder_tokens[name]
        act = prompts * tokens * 2 * (hidden * (layers + 1) + 3 * width / etp)
        rows.append(
            Row(f"{name} activations", "encode", act / GIB,
                f"{prompts} prompts x {tokens} tokens: every hidden state kept, one MLP's")
        )  # fmt: skip
    return rows


def checkpointed(value: bool | int, geo: Geometry, listed: int) -> list[int]:
    """How many blocks of each of ``geo.blocks``' kinds ``actor.activation_checkpointing`` =
    ``value`` recomputes, as the actor does (``enable_checkpointing``): true (or every one of
    the ``listed`` blocks of the transformer's block lists) all of them, nested ones (H3's
    token refiner) included; an integer N the first N listed ones. The family's geometry
    lists the listed blocks' kinds first, in call order, and the nested ones after them."""
    counts = [b.count for b in geo.blocks]
    n = listed if value is True else int(value)
    if n > listed:
        raise ConfigError(
            f"plan: actor.activation_checkpointing={n}: the model has {listed} transformer "
            f"blocks; give true, false or 0..{listed}"
        )
    if n == listed:
        return counts
    out = []
    for count in counts:
        out.append(min(n, count))
        n -= out[-1]
    return out


def _activation_rows(cfg, dims, geo: Geometry, samples: int, listed: int) -> list[Row]:
    """The rollout's no-grad forward and decode; the training step's autograd graph (one
    micro-batch, one timestep: the losses back-propagate per timestep)."""
    n = min(cfg.rollout.max_batch, samples)
    fwd = n * (2 if cfg.rollout.cfg_scale > 1 else 1)  # CFG's two branches in one forward
    live = max(b.live for b in geo.blocks) / dims.sp
    rows = [
        Row("DiT forward (no grad)", "rollout", fwd * live / GIB,
            f"{fwd} rows, one block's live set at a time"),
        Row("VAE decode", "rollout", n * geo.decode / GIB,
            f"{n} samples" if geo.decode else "not modelled for this family"),
    ]  # fmt: skip
    mb = min(cfg.actor.micro_batch, samples)
    one = mb * max(b.saved for b in geo.blocks) / dims.sp
    n_blocks = sum(b.count for b in geo.blocks)
    ckpt = checkpointed(cfg.actor.activation_checkpointing, geo, listed)
    n_ckpt, kinds = sum(ckpt), list(zip(geo.blocks, ckpt, strict=True))
    if n_ckpt < n_blocks:  # the blocks that keep their set
        kept = mb * sum((b.count - c) * b.saved for b, c in kinds) / dims.sp
        how = "not checkpointed" if n_ckpt else "no checkpointing"
        rows.append(Row("activations kept for backward", "train", kept / GIB,
                        f"{mb} samples x {n_blocks - n_ckpt} blocks, {how}"))  # fmt: skip
    if n_ckpt:
        kept = mb * sum(c * b.inputs for b, c in kinds) / dims.sp
        which = f"{n_ckpt} blocks'" if n_ckpt == n_blocks else f"the first {n_ckpt} blocks'"
        rows.append(Row("block inputs (checkpointing)", "train", kept / GIB,
                        f"{mb} samples x {which} inputs"))  # fmt: skip
        rows.append(Row("recomputed block", "train", one / GIB, "one block's saved set"))
    rows.append(Row("backward buffers", "train", one / GIB, "one block's worth of gradients"))
    return rows


def _offload(cfg, opts: PlanOptions, facts: ModelFacts, dims: ParallelDims) -> bool:
    """Is the text encoder offloaded: the option, else a config key where one exists, else
    where the family puts it; ETP > 1 keeps it on the GPU, sharded."""
    want = opts.offload_encoder
    for section, key in ((cfg.rollout, "text_encoder_offload"), (cfg.model, "offload_encoder")):
        if want is None and getattr(section, key, None) is not None:
            want = bool(getattr(section, key))
    if want and not hasattr(facts.model.net, "offload"):
        raise ConfigError(f"plan: model family {facts.family!r} cannot offload its encoders")
    if want is None:
        return dims.etp == 1 and bool(facts.on_host & set(facts.encoders))
    return want


# --- the knobs --------------------------------------------------------------------------------


def _knobs(cfg, opts: PlanOptions, dims: ParallelDims, facts: ModelFacts):
    """(what to change, the config, the options) for each knob that could lower the peak."""
    rep = dataclasses.replace
    heads = facts.model.net.transformer.config.num_attention_heads
    if (
        heads % (2 * dims.tp) == 0
        and dims.world_size % (2 * dims.tp * dims.sp * dims.dp_replicate) == 0
    ):
        yield f"raise {KEY}.tp to {2 * dims.tp}", cfg, rep(opts, tp=2 * dims.tp, dp_shard=-1)
    if dims.world_size % (2 * dims.etp) == 0:
        yield f"raise {KEY}.etp to {2 * dims.etp}", cfg, rep(opts, etp=2 * dims.etp)
    if hasattr(facts.model.net, "offload"):
        yield (
            "offload the text encoder (plan: --offload-encoder)",
            cfg,
            rep(opts, offload_encoder=True, etp=1),
        )
    listed = len(transformer_blocks(facts.model))
    now = _checkpointed_blocks(cfg, listed)
    if now < listed:  # the fewest leading blocks that fit, else every one
        try:
            fewest = fewest_checkpointed(facts, cfg, opts, lo=now + 1)
        except ConfigError:
            fewest = None
        n = listed if fewest is None else fewest[0]
        what = "turn on actor.activation_checkpointing"
        if n < listed:
            what = (
                f"checkpoint the first {n} of {listed} blocks (actor.activation_checkpointing="
                f"{n}: the fewest that fit)"
            )
        yield what, _with_checkpointing(cfg, n, listed), opts
    world = 2 * dims.world_size
    yield (
        f"raise {KEY}.dp_shard to {2 * dims.dp_shard} ({world} GPUs)",
        cfg,
        rep(opts, world_size=world, dp_shard=2 * dims.dp_shard),
    )
    if not opts.share_rollout and dims.tp > 1 and opts.rollout_layout(cfg) == "replicated":
        yield (
            f"shard the rollout copies with tp ({KEY}.rollout=sharded; plan: --rollout sharded)",
            cfg,
            rep(opts, rollout="sharded"),
        )
    if not opts.share_rollout and not cfg.rollout.share_base and dims.tp == 1 and dims.dp == 1:
        rollout = rep(cfg.rollout, share_base=True)
        yield "share the frozen base (rollout.share_base=true)", rep(cfg, rollout=rollout), opts
    if not opts.share_rollout:
        yield "share the rollout copy (plan: --share-rollout)", cfg, rep(opts, share_rollout=True)
        if cfg.rollout.base_copy != "cpu" and not cfg.rollout.share_base:
            rollout = rep(cfg.rollout, base_copy="cpu")
            yield (
                "move the sync base copies to the host (rollout.base_copy=cpu)",
                rep(cfg, rollout=rollout),
                opts,
            )
    if cfg.actor.micro_batch > 1:
        actor = rep(cfg.actor, micro_batch=cfg.actor.micro_batch // 2)
        yield f"lower actor.micro_batch to {actor.micro_batch}", rep(cfg, actor=actor), opts


def _checkpointed_blocks(cfg, listed: int) -> int:
    """The leading blocks ``actor.activation_checkpointing`` recomputes (true: all)."""
    value = cfg.actor.activation_checkpointing
    return listed if value is True else int(value)


def _with_checkpointing(cfg, n: int, listed: int):
    """``cfg`` with the first ``n`` of ``listed`` blocks checkpointed (all: true)."""
    actor = dataclasses.replace(cfg.actor, activation_checkpointing=True if n == listed else n)
    return dataclasses.replace(cfg, actor=actor)


def fewest_checkpointed(
    facts: ModelFacts, cfg, opts: PlanOptions, lo: int = 0
) -> tuple[int, Plan] | None:
    """The fewest leading blocks N >= ``lo`` to checkpoint for ``cfg`` to fit, and its plan;
    None when checkpointing every block does not fit. A block checkpointed keeps its inputs
    instead of its saved set, never more, so the peak falls with N: a bisection."""
    listed = len(transformer_blocks(facts.model))
    held, activations = _parts(facts, cfg, opts)

    def at(n: int) -> Plan:
        return dataclasses.replace(
            held, rows=held.rows + activations(_with_checkpointing(cfg, n, listed))
        )

    best = at(listed)
    if not best.fits:
        return None
    hi = listed
    while lo < hi:
        mid = (lo + hi) // 2
        p = at(mid)
        if p.fits:
            hi, best = mid, p
        else:
            lo = mid + 1
    return hi, best


def _fewer_checkpointed(facts: ModelFacts, cfg, opts: PlanOptions, base: Plan) -> list[str]:
    """For a layout that fits with checkpointing: the fewest leading blocks that would still
    fit (each block not checkpointed is one forward less in the backward)."""
    listed = len(transformer_blocks(facts.model))
    now = _checkpointed_blocks(cfg, listed)
    fewest = fewest_checkpointed(facts, cfg, opts) if now else None
    if fewest is None or fewest[0] >= now:
        return []
    n, p = fewest
    phase, peak = p.peak
    return [
        f"activation checkpointing: the first {n} of {listed} blocks are the fewest that fit "
        f"(actor.activation_checkpointing={n}: peak {peak:.1f} GiB ({phase}), "
        f"{p.phase('train'):.1f} GiB in the step; {now - n} fewer blocks recomputed)"
    ]


def advise(facts: ModelFacts, cfg, opts: PlanOptions, base: Plan) -> list[str]:
    """What to change when ``base`` does not fit: each knob alone, re-planned, best first.
    When it fits with activation checkpointing: the fewest checkpointed blocks that fit."""
    if base.fits:
        return _fewer_checkpointed(facts, cfg, opts, base)
    tried = []
    for what, cfg2, opts2 in _knobs(cfg, opts, base.dims, facts):
        try:
            p = estimate(facts, cfg2, opts2)
        except ConfigError:
            continue
        if p.peak[1] < base.peak[1] - 0.05:
            tried.append((p.peak[1], what, p.fits))
    tried.sort()
    if not tried:
        return ["no single knob lowers the peak; this model needs more GPUs per copy"]
    out = ["to fit, change one of (re-planned with that knob alone):"]
    out += [f"  - {w}: peak {g:.1f} GiB{' (fits)' if ok else ''}" for g, w, ok in tried]
    if not any(ok for _, _, ok in tried):
        out.append("  none fits alone: combine the first few")
    return out


def plan(cfg, opts: PlanOptions | None = None, facts: ModelFacts | None = None) -> Plan:
    """The per-GPU memory plan of ``cfg`` (a loaded ``Config``), with the knobs to turn when
    its peak does not fit ``opts.gpu_gib`` less the headroom."""
    opts = opts or PlanOptions()
    facts = facts or model_facts(cfg, opts.device)
    base = estimate(facts, cfg, opts)
    return dataclasses.replace(base, advice=advise(facts, cfg, opts, base))
