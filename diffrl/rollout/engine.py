"""The rollout engine: samples G trajectories per prompt with its own copy of the weights.

It holds a frozen base model plus the LoRA delta merged in (a fused serving layout), or, with
``rollout.share_base``, an alias of the loaded model's weights with the LoRA held beside them as
factors (``diffrl/sync/shared_base.py``), and changes weights only through ``load_weights``
(versioned, verified; see ``diffrl.sync``).
Generation runs in a worker thread (torch releases the GIL), so the event loop stays free for
scorers of the previous step.

A weight update may also be *offered* while the engine samples (``offer``; the async loop's
``run.async_sync=step``): the sampling thread applies it, verified, at the next denoising-step
boundary, so the micro-batch in flight keeps its partly denoised latents and per-step records
and takes its remaining steps under the new weights. Each step records the version that took
it (``Trajectory.step_versions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from diffrl.channel import Channel
from diffrl.errors import ConfigError, check, check_choice
from diffrl.models.compile import compile_blocks
from diffrl.models.family import FamilyModel, HasModalities
from diffrl.models.graphs import graph_transformer
from diffrl.models.packed import BACKENDS as PACKED_BACKENDS
from diffrl.models.packed import PacksSequences, packed_velocity
from diffrl.parallel.tp import Plan
from diffrl.parallel.tp_sync import (
    ShardedLoraTarget,
    alias_copy,
    receipt_of_sharded,
    serving_slot_map,
    shard_rollout,
)
from diffrl.rollout.samplers import (
    STOCHASTIC_STEPS,
    coarse_tail,
    euler_step,
    guided_velocity,
    modality_log_probs,
    noise_from_seeds,
    sde_window,
    sigma_schedule,
    tree_noise_blocks,
)
from diffrl.rollout.scheduled import stream_scheduled
from diffrl.rollout.scheduler import ContinuousBatcher, StepRule
from diffrl.sync.bound import bound_of, linear_weights
from diffrl.sync.receipt import SyncReceipt, load_verified, receipt_of
from diffrl.sync.shared_base import SharedBaseTarget, receipt_of_shared
from diffrl.sync.weights import (
    BasePrints,
    MergedLoraTarget,
    SlotMap,
    SyncError,
    SyncReport,
    WeightUpdate,
)
from diffrl.types import PromptBatch, StepSpec, Trajectory, check_token_hashes, host_to_device


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8  # G samples per prompt
    num_steps: int = 10  # sampler steps T
    sampler: str = "ode"  # ode (Euler) | sde (FlowGRPO step with log-probs)
    noise_level: float = 0.7  # flow_grpo: a in s = a*sqrt(sigma/(1-sigma)); cps: eta in [0,1]
    sde_step: str = "flow_grpo"  # flow_grpo (FlowGRPO's SDE) | cps (coefficients-preserving)
    # SDE window (Flow-GRPO-Fast / MixGRPO): only `sde_window` consecutive steps are stochastic
    # (and trained), the rest are ODE; 0 = every step but the last
    sde_window: int = 0
    sde_window_mode: str = "fixed"  # fixed | random (per iteration) | sliding (over iterations)
    sde_window_start: int = 0  # fixed: first SDE step; random, sliding: the earliest start
    # random, sliding: the latest step the window may start at; -1 = the last that fits
    sde_window_end: int = -1
    sde_window_every: int = 1  # sliding: iterations between one-step moves of the window
    # DanceGRPO: a group's samples start from the same noise. They stay identical until the first
    # SDE step, so those steps run one forward per group (a window at step k branches there)
    shared_init_noise: bool = False
    # mirrored sampling: group members 2k+1 take the negated SDE noise of member 2k, so a pair's
    # reward difference is the odd part of the reward in that noise (needs an even group_size)
    antithetic_noise: bool = False
    # tree-structured groups (BranchGRPO-style): with shared_init_noise and an SDE window of k
    # steps, members share each SDE step's noise in blocks of g/2, g/4, ..., (the last window
    # step's noise is their own), so the group splits in two at each window step: a binary tree
    # whose nodes' inputs run one forward each, in rollout and training. GRPO's loss then
    # credits every node with the advantages of the leaves below it (needs g divisible by
    # 2^(k-1))
    tree_noise: bool = False
    # MixGRPO-Flash's cheap tail: the ODE steps after the last SDE step (no log-probs, never
    # trained; only their end point is scored) re-gridded to this many Euler steps; 0 = off.
    # Held-out eval (ODE, eval_num_steps) is never re-gridded
    ode_tail_steps: int = 0
    # precision of the deterministic steps' forward passes (autocast): bfloat16 is faster on a
    # CPU with bf16 instructions. SDE steps always run in the model's own dtype,
    # so the recorded log-probs stay exact; held-out eval always runs in it
    ode_dtype: str = "float32"  # float32 | bfloat16
    shift: float = 1.0  # sigma-schedule time shift
    cfg_scale: float = 1.0  # classifier-free guidance; 1 = off (one forward per step)
    max_batch: int = 32  # samples per forward; each micro-batch streams to the reward pool
    keep_latents: bool = False  # keep x at every step (GRPO/log-prob recompute need it)
    # where weight sync keeps its frozen copy of the LoRA-targeted base weights: "" = beside
    # them; "cpu" = host memory (a 20 B model's copy does not fit beside actor and rollout)
    base_copy: str = ""
    eval_num_steps: int = 10  # steps for held-out eval sampling (ODE)
    # guidance for held-out eval sampling; 1 = none, so eval measures the policy itself even
    # when the rollout samples with CFG
    eval_cfg_scale: float = 1.0
    # regional torch.compile: each block of the transformer's block lists compiled on its own
    # (identical blocks share one compiled graph, so compile time stays short); the rollout's
    # copy only. Needs a compiler toolchain (inductor); off by default
    compile: bool = False
    # CUDA-graph replay of the transformer's forward (diffrl/models/graphs.py): each input
    # shape runs eagerly once, is captured at its second call and replayed from then on, at
    # most `graph_cache` shapes kept. A batch-1 forward is launch-bound, so this is most of its
    # speed-up; with `compile` the graph replays the compiled kernels. CUDA only
    cuda_graphs: bool = False
    graph_cache: int = 16
    # decode a micro-batch's media (the VAE) in a second worker thread, on a CUDA stream of
    # its own, while the next micro-batch denoises; trajectories still stream in order. Off by
    # default: its gain on an H200 is not measured yet
    overlap_decode: bool = False
    # the rollout and the evaluator alias the loaded model's frozen weights instead of holding
    # copies of the DiT, and apply the synced LoRA unmerged, as factors of their own beside the
    # shared weight (diffrl/sync/shared_base.py): two DiTs fewer in memory. One process only
    # (run.backend=local, no FSDP or TP base); no serving layout; base_copy is unused
    share_base: bool = False
    # how a training step's samples are batched: batch = micro-batches of max_batch // G whole
    # prompts, each run start to end; scheduler = request-level continuous batching
    # (diffrl/rollout/scheduled.py): each prompt's G samples are one request, admitted between
    # two denoising steps as soon as room frees, and handed to the reward pool as it finishes
    engine: str = "batch"  # batch | scheduler
    # scheduler: the most latent positions (rows x positions) one forward takes; 0 = max_batch
    # samples of the family's latent shape
    token_budget: int = 0
    # scheduler: requests of different latent shapes (resolutions) share one forward through
    # sequence packing with block-diagonal attention (diffrl/models/packed.py) under one
    # budget, instead of a forward per shape; the family's net must have a packed forward
    packed: bool = False
    packed_attention: str = "bylength"  # bylength (SDPA per segment length) | varlen (CUDA)

    def validate(self) -> None:
        check_choice("engine", self.engine, ("batch", "scheduler"))
        check_choice("packed_attention", self.packed_attention, PACKED_BACKENDS)
        check(
            not self.packed or self.engine == "scheduler",
            "packed",
            self.packed,
            "packs the scheduler's requests: needs rollout.engine=scheduler",
        )
        # a packed forward calls the blocks' modules in its own order, not the blocks' compiled
        # forwards or a captured graph: they would be held and never run
        check(
            not (self.packed and (self.compile or self.cuda_graphs)),
            "packed",
            self.packed,
            "runs its forwards eager (packed layouts change every step): set "
            "rollout.compile=false and rollout.cuda_graphs=false with it",
        )
        check(self.token_budget >= 0, "token_budget", self.token_budget, "must be >= 0")
        check(
            not (self.engine == "scheduler" and self.overlap_decode),
            "overlap_decode",
            self.overlap_decode,
            "decodes micro-batches beside the next; rollout.engine=scheduler decodes each request "
            "as it finishes: set rollout.overlap_decode=false",
        )
        check(self.graph_cache >= 1, "graph_cache", self.graph_cache, "must be >= 1")
        check(self.group_size >= 1, "group_size", self.group_size, "must be >= 1")
        check(self.num_steps >= 1, "num_steps", self.num_steps, "must be >= 1")
        check_choice("sampler", self.sampler, ("ode", "sde"))
        check(self.noise_level >= 0, "noise_level", self.noise_level, "must be >= 0")
        check_choice("sde_step", self.sde_step, tuple(STOCHASTIC_STEPS))
        if self.sde_step == "cps":
            check(self.noise_level <= 1, "noise_level", self.noise_level, "cps needs eta <= 1")
        check(
            0 <= self.sde_window < max(self.num_steps, 2),
            "sde_window",
            self.sde_window,
            f"must be in [0, num_steps - 1 = {self.num_steps - 1}] (0 = every step)",
        )
        check_choice("sde_window_mode", self.sde_window_mode, ("fixed", "random", "sliding"))
        check(self.sde_window_start >= 0, "sde_window_start", self.sde_window_start, ">= 0")
        if self.sde_window:
            last = self.num_steps - 1 - self.sde_window  # the last step is never stochastic
            check(
                self.sde_window_start <= last,
                "sde_window_start",
                self.sde_window_start,
                f"a window of {self.sde_window} must start at <= {last} "
                f"(num_steps={self.num_steps}, and the last step is deterministic)",
            )
        check(self.sde_window_every >= 1, "sde_window_every", self.sde_window_every, ">= 1")
        if self.sde_window and self.sde_window_mode != "fixed" and self.sde_window_end >= 0:
            check(
                self.sde_window_start <= self.sde_window_end <= last,
                "sde_window_end",
                self.sde_window_end,
                f"must be in [sde_window_start = {self.sde_window_start}, {last}] (-1 = {last})",
            )
        if self.tree_noise:
            k = self.sde_window or self.num_steps - 1
            check(
                self.shared_init_noise and not self.antithetic_noise and self.sampler == "sde",
                "tree_noise",
                self.tree_noise,
                "needs rollout.sampler=sde and rollout.shared_init_noise=true (the tree's root "
                "is the group's one initial noise), and excludes rollout.antithetic_noise",
            )
            check(
                self.group_size % 2 ** (k - 1) == 0,
                "group_size",
                self.group_size,
                f"must be divisible by 2^(k-1) = {2 ** (k - 1)} for a tree over k = {k} SDE "
                "steps (rollout.tree_noise)",
            )
        if self.antithetic_noise:
            check(
                self.group_size % 2 == 0,
                "group_size",
                self.group_size,
                "must be even with rollout.antithetic_noise (members are mirrored in pairs)",
            )
        check(self.ode_tail_steps >= 0, "ode_tail_steps", self.ode_tail_steps, "must be >= 0")
        if self.ode_tail_steps:
            check(
                self.sampler == "sde" and self.sde_window > 0,
                "ode_tail_steps",
                self.ode_tail_steps,
                "re-grids the ODE steps after an SDE window, and this rollout has none: set "
                "rollout.sampler=sde and rollout.sde_window > 0 (sde_window=0 makes every step "
                "but the last stochastic)",
            )
            if self.sde_window_mode == "fixed":
                after = self.num_steps - self.sde_window_start - self.sde_window
                check(
                    self.ode_tail_steps < after,
                    "ode_tail_steps",
                    self.ode_tail_steps,
                    f"must be < {after}, the ODE steps after the fixed window (steps "
                    f"{self.sde_window_start}..{self.sde_window_start + self.sde_window - 1} of "
                    f"{self.num_steps}); at {after} or more it changes nothing",
                )
        check_choice("ode_dtype", self.ode_dtype, ("float32", "bfloat16"))
        check(self.shift > 0, "shift", self.shift, "must be > 0")
        check(self.cfg_scale >= 1, "cfg_scale", self.cfg_scale, "must be >= 1 (1 = off)")
        check(self.max_batch >= 1, "max_batch", self.max_batch, "must be >= 1")
        check_choice("base_copy", self.base_copy, ("", "cpu"))
        check(self.eval_num_steps >= 1, "eval_num_steps", self.eval_num_steps, "must be >= 1")
        check(self.eval_cfg_scale >= 1, "eval_cfg_scale", self.eval_cfg_scale, "must be >= 1")
        # dynamo does not guard on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards):
        # a block class compiled before the shared base's LoRA hooks were added (the actor's, an
        # evaluator's) is reused without them, and the rollout samples the base alone, silently
        check(
            not (self.share_base and self.compile),
            "compile",
            self.compile,
            "compiled blocks may not see the LoRA factors rollout.share_base holds beside the "
            "shared base (dynamo does not guard on the forward hooks that add them); set "
            "rollout.compile=false with rollout.share_base=true",
        )


def sample_seeds(base_seed: int, n: int) -> Tensor:
    """(n,) int64 per-sample seeds derived from one step seed (reproducible, distinct)."""
    g = torch.Generator().manual_seed(int(base_seed))
    return torch.randint(0, 2**62, (n,), generator=g, dtype=torch.int64)


def _held_on(model: torch.nn.Module, device: torch.device) -> bool:
    """Every tensor of ``model`` is on ``device`` (an index-less device means its current one)."""
    want = torch.empty(0, device=device).device
    return all(t.device == want for t in [*model.parameters(), *model.buffers()])


class RolloutEngine:
    def __init__(
        self,
        model: FamilyModel,
        cfg: RolloutConfig,
        lora_targets: list[str],
        device: torch.device,
        serving_layout: bool = True,
        share_model: bool = False,
        tp_mesh: DeviceMesh | None = None,
        tp_plan: Plan | None = None,
        lora_rank: int = 0,
    ) -> None:
        """Holds its own copy of ``model`` (the family's frozen encoders are shared, not
        copied), re-laid out for serving by the family (fused QKV, sharded FCs; contract 2)
        unless ``serving_layout`` is False; ``lora_targets`` are the actor's trained modules.
        ``share_model`` samples with ``model`` itself instead (no copy, no serving layout, no
        weight sync): for a GPU that holds one copy of a model only, e.g. the real-size
        MiniMax-H3 benchmark, where the actor then trains the same weights.

        ``tp_mesh`` (``parallel.rollout=sharded``): the copy is sharded with the family's TP
        ``tp_plan`` over that 1-D tp mesh, keeping the serving layout's fusions that TP can hold
        (fused Q/K/V over column shards; ``tp_sync.shard_rollout``), its layout checked
        against what the sync expects, and updates land through
        ``parallel/tp_sync.py``'s verified sharded sync; sampling, syncs and receipts are then
        collectives of the tp group, whose ranks sample the same rows.

        ``cfg.share_base``: the copy aliases ``model``'s weights (no memory; ``model`` must be
        on ``device``) and holds the synced LoRA as factors of rank ``lora_rank`` beside them,
        unmerged (``diffrl/sync/shared_base.py``); no serving layout."""
        if cfg.share_base and (share_model or tp_mesh is not None or lora_rank < 1):
            raise ConfigError(
                "rollout.share_base aliases one process's whole base and needs the actor's LoRA "
                f"rank (given {lora_rank}); it excludes a TP-sharded rollout copy "
                "(parallel.rollout=sharded under tp) and sampling with the actor's own model"
            )
        if cfg.share_base and cfg.compile:  # RolloutConfig.validate's rule, for any caller
            raise ConfigError(
                "rollout.compile with rollout.share_base: compiled blocks may not see the LoRA "
                "factors held beside the shared base; set rollout.compile=false"
            )
        if cfg.share_base and not _held_on(model, device):
            raise ConfigError(
                f"rollout.share_base: the loaded model is not wholly on {device}, so the "
                "rollout cannot alias its weights there; set rollout.share_base=false"
            )
        if share_model and (serving_layout or lora_targets or tp_mesh is not None):
            raise ValueError("share_model samples with the model as given: no layout, no sync")
        if tp_mesh is not None and (cfg.compile or cfg.cuda_graphs):
            raise ConfigError(
                "rollout.compile and rollout.cuda_graphs are not run over a TP-sharded rollout "
                "copy (parallel.rollout=sharded) yet; set them to false"
            )
        self.shared = share_model
        self.family = model.family
        layout = SlotMap()
        if tp_mesh is not None:
            # No whole second DiT on the device at any time: the family's one-process serving
            # layout is read off a meta copy (its slot map says which fusions the sharded copy
            # keeps; the fused Linears it makes draw from the global RNG as on a real copy, so
            # the actor's LoRA init, drawn after the rollout is built, is one process's), and
            # the copy shares the model's storage until shard_rollout gives it its own shards
            # (a model held elsewhere is copied whole onto the device first, as replicated)
            if serving_layout:
                layout = serving_slot_map(model, device)
            source = model if _held_on(model, device) else None
            self.model = alias_copy(model) if source else copy.deepcopy(model).to(device)
        elif cfg.share_base:
            self.model = alias_copy(model)
            serving_layout = False  # fusions would need storage of their own
        else:
            self.model = model if share_model else copy.deepcopy(model).to(device)
        self.model.eval().requires_grad_(False)
        if cfg.packed and not isinstance(self.model.net, PacksSequences):
            raise ConfigError(
                f"rollout.packed: the {self.family.name} family's net has no packed forward "
                "(the tiny DiT and SD3 have one); set rollout.packed=false"
            )
        self.cfg = cfg
        self.null_ids = tuple(int(i) for i in self.family.null_ids())
        self.device = device
        self.version = 0
        # a weight update offered while sampling (``offer``), applied by the sampling thread at
        # the next step boundary; the lock guards it and the sync/* of the ones applied
        self._offer_lock = threading.Lock()
        self._offered: WeightUpdate | None = None
        self._offer_synced: dict[str, float] = {}
        # the trained modules' base rows as they are before the serving layout moves them: the
        # anchor the slot map is checked against, here and against the actor's on each sync
        base_prints = BasePrints.of_model(self.model, lora_targets)
        # what updates merge into, named and shaped before the serving layout: the rollout's
        # half of the bound-module gate (diffrl/sync/bound.py), compared with the actor's
        self.bound = bound_of(linear_weights(self.model, lora_targets))
        self.target: MergedLoraTarget | ShardedLoraTarget | SharedBaseTarget
        if cfg.share_base:
            self.target = SharedBaseTarget(self.model, lora_targets, lora_rank, base_prints)
        elif tp_mesh is not None:
            self.target = shard_rollout(
                self.model, tp_mesh, tp_plan, lora_targets, cfg.base_copy, base_prints, layout,
                source=source,
            )  # fmt: skip
        else:
            slot_map = self.family.serving_layout(self.model) if serving_layout else SlotMap()
            self.target = MergedLoraTarget(
                self.model, lora_targets, slot_map, cfg.base_copy, base_prints
            )
        self.compiled = compile_blocks(self.model) if cfg.compile else 0
        # a sharded copy (or a shared, sharded actor) samples through collectives: the
        # controller must not run it beside the actor's (controller/sync.py prefetch_next)
        self.collective = any(isinstance(p, DTensor) for p in self.model.parameters())
        self._decode_stream: torch.cuda.Stream | None = None  # overlap_decode, on a GPU
        self.graphs = None
        if cfg.cuda_graphs:
            if device.type != "cuda":
                raise ConfigError(
                    f"rollout.cuda_graphs needs a CUDA device; this run's is {device} "
                    "(set run.device=cuda, or rollout.cuda_graphs=false)"
                )
            self.graphs = graph_transformer(self.model, cfg.graph_cache)

    @property
    def produces(self) -> frozenset[str]:
        """The ``extra_fields`` every trajectory of this engine carries (for the start-up check
        of the scorers' declared inputs)."""
        return frozenset(self.family.media)

    def load_weights(self, update: WeightUpdate) -> SyncReport:
        if self.shared:
            raise SyncError("this rollout engine shares the actor's model: it has no copy to sync")
        if update.version < self.version:
            raise SyncError(f"stale weight update v{update.version} < current v{self.version}")
        report = self.target.apply(update)
        self.version = update.version
        with self._offer_lock:  # an offer this load supersedes is not applied after it
            if self._offered is not None and self._offered.version <= update.version:
                self._offered = None
        return report

    def offer(self, update: WeightUpdate) -> None:
        """Thread-safe: hold ``update`` for the sampling thread, which applies it (verified by
        its receipt) before the next denoising step it takes, mid-micro-batch or at the next
        one's start; a newer offer replaces an older one not yet applied. Its ``sync/*``
        metrics are collected by ``take_synced``."""
        if self.shared or self.collective:
            raise SyncError(
                "run.async_sync=step offers weights to a rollout mid-sampling; this rollout "
                + ("shares the actor's model" if self.shared else "is TP-sharded (its ranks "
                   "would have to switch at the same step)")
                + ": use run.async_sync=batch"
            )  # fmt: skip
        with self._offer_lock:
            if self._offered is None or update.version >= self._offered.version:
                self._offered = update

    def take_synced(self) -> dict[str, float]:
        """The ``sync/*`` of the offered updates applied since the last call (the latest's)."""
        with self._offer_lock:
            out, self._offer_synced = self._offer_synced, {}
        return out

    def _apply_offered(self) -> None:
        """In the sampling thread, between two steps: load the offered update, if any."""
        if self._offered is None:  # read without the lock: a miss waits one step
            return
        with self._offer_lock:
            update, self._offered = self._offered, None
        if update is None:
            return
        synced = load_verified(self, update)
        with self._offer_lock:
            self._offer_synced = synced

    def receipt(self) -> SyncReceipt:
        """What this rollout holds now, for the sender to check a sync by
        (``diffrl/sync/receipt.py``)."""
        if self.shared:
            raise SyncError("this rollout engine shares the actor's model: it has no copy to sync")
        if isinstance(self.target, ShardedLoraTarget):  # a collective of the tp group
            return receipt_of_sharded(self.target, self.version)
        if isinstance(self.target, SharedBaseTarget):
            return receipt_of_shared(self.target, self.version)
        return receipt_of(self.target, self.version)

    async def stream(
        self,
        prompts: PromptBatch,
        seed: int,
        channel: Channel,
        *,
        group_size: int | None = None,
        sampler: str | None = None,
        num_steps: int | None = None,
        iteration: int = 0,
        first_prompt: int = 0,
    ) -> None:
        """Produces one ``Trajectory`` per micro-batch of whole groups into ``channel`` as
        each finishes (so scoring overlaps generation), then closes the channel. Waits only
        on the worker thread and on channel back-pressure. ``first_prompt``: where these
        prompts start in a larger batch that others sample the rest of (a data-parallel rank's
        slice of a step, or its share of the held-out set): their samples take that batch's
        seeds and group ids."""
        g = group_size or self.cfg.group_size
        per = max(1, self.cfg.max_batch // g)  # prompts per micro-batch
        offset = first_prompt * g
        seeds = sample_seeds(seed, offset + len(prompts) * g)[offset:]
        mask = self.sde_mask(
            sampler or self.cfg.sampler, num_steps or self.cfg.num_steps, iteration, seed
        )
        sigmas, mask = coarse_tail(
            sigma_schedule(len(mask), self.cfg.shift), mask, self.cfg.ode_tail_steps, self.cfg.shift
        )
        overlap = self.cfg.overlap_decode
        decoding: asyncio.Task | None = None  # the previous micro-batch's decode (overlap)
        try:
            if self.cfg.engine == "scheduler":  # one trajectory per prompt, as each finishes
                await stream_scheduled(self, prompts, seeds, g, first_prompt, sigmas, mask, channel)
                return
            for k in range(0, len(prompts), per):
                sub = prompts.select(torch.arange(k, min(k + per, len(prompts))))
                traj, x0 = await asyncio.to_thread(
                    self._generate,
                    sub,
                    seeds[k * g : (k + len(sub)) * g],
                    g,
                    first_prompt + k,
                    sigmas,
                    mask,
                    not overlap,
                )
                if not overlap:
                    await channel.put(traj, traj.policy_version)
                    continue
                if decoding is not None:  # in order: the one before this micro-batch
                    done = await decoding
                    await channel.put(done, done.policy_version)
                decoding = asyncio.create_task(asyncio.to_thread(self._decode, traj, x0))
            if decoding is not None:
                done, decoding = await decoding, None
                await channel.put(done, done.policy_version)
        finally:
            if decoding is not None:  # the run failed mid-stream: let the decode finish
                await asyncio.gather(decoding, return_exceptions=True)
            channel.close()

    @torch.no_grad()
    def _decode(self, traj: Trajectory, x0: Tensor) -> Trajectory:
        """``traj`` with its media (``rollout.overlap_decode``): decoded in this worker thread,
        on the GPU on a stream of its own, while the sampling thread denoises the next
        micro-batch on the default stream. ``x0`` is complete (the sampling thread copied it
        to the host), and the decode ends in a copy to the host, so no event is needed."""
        side: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if x0.device.type == "cuda":
            if self._decode_stream is None:
                self._decode_stream = torch.cuda.Stream(x0.device)
            x0.record_stream(self._decode_stream)
            side = torch.cuda.stream(self._decode_stream)
        with side:
            return traj.with_fields(**self.family.decode(x0))

    async def generate(self, prompts: PromptBatch, seed: int, **kw) -> Trajectory:
        """The whole batch as one trajectory (micro-batches joined)."""
        channel = Channel()
        producer = asyncio.create_task(self.stream(prompts, seed, channel, **kw))
        parts = [t async for t in channel]
        await producer
        return Trajectory.concat(parts)

    def sde_mask(self, sampler: str, num_steps: int, iteration: int, seed: int) -> Tensor:
        """(T,) bool: the steps this rollout takes stochastically (none for the ODE sampler)."""
        if sampler == "ode" or self.cfg.noise_level == 0:
            return torch.zeros(num_steps, dtype=torch.bool)
        c = self.cfg
        return sde_window(
            num_steps,
            c.sde_window,
            c.sde_window_mode,
            c.sde_window_start,
            c.sde_window_every,
            iteration,
            seed,
            c.sde_window_end,
        )

    @torch.no_grad()
    def _generate(
        self,
        prompts: PromptBatch,
        seeds: Tensor,
        g: int,
        group_offset: int,
        sigmas: Tensor,
        mask: Tensor,
        decode: bool = True,
    ) -> tuple[Trajectory, Tensor]:
        """One micro-batch's trajectory, and its final latents on the device; its media are
        decoded here unless ``decode`` is False (then ``_decode`` adds them)."""
        batch = prompts.repeat(g)
        # contract 3: the ids (and conditions) sampled with are the data stage's, on this rank
        check_token_hashes(batch, "the rollout engine")
        split = self.modality_split()
        # a video+audio family's SDE steps keep their log-probs per modality too (FlowGRPO's
        # algorithm.modality_credit clips each modality's ratio against them)
        by_modality: list[Tensor] | None = [] if split is not None and mask.any() else None
        x0, latents, log_probs, versions = self._sample(
            batch.input_ids, seeds, sigmas, mask, g, batch.cond, by_modality
        )
        group = torch.arange(len(prompts)).repeat_interleave(g) + group_offset
        traj = Trajectory(
            prompts=batch,
            group=group,
            seeds=seeds,
            x0=x0.cpu(),
            sigmas=sigmas,
            policy_version=versions[0],  # the first step's: the oldest
            latents=latents.cpu() if self.cfg.keep_latents else None,
            log_probs=log_probs.cpu(),
            sde_mask=mask,
            step_spec=self.step_spec(),
            step_versions=torch.tensor(versions, dtype=torch.int64).expand(len(batch), -1).clone(),
            extra_fields=self.family.decode(x0) if decode else {},
            modality_split=split,
            modality_log_probs=None if not by_modality else torch.stack(by_modality, 1).cpu(),
        )
        return traj, x0

    def step_spec(self) -> StepSpec:
        """How this rollout takes its stochastic steps (training recomputes them so)."""
        c = self.cfg
        shares = c.shared_init_noise or c.tree_noise
        return StepSpec(c.sde_step, c.noise_level, c.cfg_scale, self.null_ids, shares_inputs=shares)

    def modality_split(self) -> tuple[int, int] | None:
        """(n_video, n_audio) elements of x for a video+audio family, else None."""
        if not isinstance(self.family, HasModalities):
            return None
        n_video, n_audio = self.family.modality_split()
        return n_video, n_audio

    def batcher(
        self, token_budget: int, max_wait_s: float = 0.0, packed: bool | None = None
    ) -> ContinuousBatcher:
        """Request-level continuous batching (``diffrl.rollout.scheduler``) over this engine's
        weights (serving layout, synced LoRA, an offered update applied between two forwards),
        guidance, time shift and step rule: requests each with its own latent shape, seeds,
        step count and SDE mask. ``packed`` (default ``rollout.packed``): every shape in one
        packed forward."""
        c = self.cfg
        pack = None
        if c.packed if packed is None else packed:
            pack = partial(packed_velocity, self.model, attention=c.packed_attention)
        rule = StepRule(c.sde_step, c.noise_level, c.ode_dtype == "bfloat16", self.modality_split())
        return ContinuousBatcher(
            self.model,
            self.device,
            token_budget=token_budget,
            max_wait_s=max_wait_s,
            cfg_scale=self.cfg.cfg_scale,
            null_ids=self.null_ids,
            shift=self.cfg.shift,
            dtype=next(self.model.parameters()).dtype,
            decode=self.family.decode,
            ids_device=self.model.ids_device(self.device),
            rule=rule,
            before_step=self._apply_offered,
            version=lambda: self.version,
            packed=pack,
        )

    def velocity(self, x: Tensor, sigma: Tensor, ids: Tensor, cond: Tensor | None = None) -> Tensor:
        return guided_velocity(self.model, x, sigma, ids, self.cfg.cfg_scale, self.null_ids, cond)

    def noise(
        self, seeds: Tensor, g: int, mask: Tensor, t_steps: int, shape: tuple[int, ...] = ()
    ) -> tuple[Tensor, list[int]]:
        """(B, T+1, *S) on the device, in the model's dtype: each row's initial state (slice 0)
        and each step's noise, for rows in whole groups of ``g``; and ``after`` (T ints): after
        step i, rows are bitwise copies in runs of after[i] (1 = none).

        Every slice comes from the sample's own seed; with shared_init_noise a group starts from
        its first member's initial noise, with antithetic_noise every odd member steps with its
        even partner's negated noise, and with tree_noise the members share each SDE step's
        noise in runs of ``after[i]``: all within a group, so a group's rows alone give the
        same noise (``rollout.engine=scheduler`` draws it per group). ``shape``: a sample's
        latent shape (default the family's)."""
        shape = shape or tuple(self.family.latent_shape())
        dtype = next(self.model.parameters()).dtype
        noise = noise_from_seeds(seeds, (t_steps + 1, *shape), self.device).to(dtype)
        row = torch.arange(len(seeds))
        member = row % g  # position within its (contiguous) group
        if self.cfg.antithetic_noise:  # an odd-sized group's last member stays unpaired
            odd = (member % 2 == 1).nonzero().squeeze(1)
            noise[odd, 1:] = -noise[odd - 1, 1:]
        after = [1] * t_steps
        if self.cfg.tree_noise:
            steps = mask.nonzero().flatten().tolist()
            for i, run in zip(steps, tree_noise_blocks(mask, g), strict=True):
                noise[:, i + 1] = noise[row - row % run, i + 1]
                after[i] = run
        if self.cfg.shared_init_noise:
            noise[:, 0] = noise[row - member, 0]
        return noise, after

    def _sample(
        self,
        ids: Tensor,
        seeds: Tensor,
        sigmas: Tensor,
        mask: Tensor,
        g: int,
        cond: Tensor | None = None,
        by_modality: list[Tensor] | None = None,
    ):
        """One micro-batch: returns x0 (b, *S), latents (b, T+1, *S), log_probs (b, T) and the
        version that took each step (T ints). An offered update is applied before each step.
        Given ``by_modality`` (a video+audio family), each step's (b, 2) log-prob split by
        modality is appended to it (``samplers.modality_log_probs``; zeros for ODE steps)."""
        t_steps = len(sigmas) - 1
        dtype = next(self.model.parameters()).dtype
        noise, after = self.noise(seeds, g, mask, t_steps)
        x, ids = noise[:, 0], ids.to(self.model.ids_device(self.device))
        cond = None if cond is None else cond.to(self.device, dtype)
        step_fn = STOCHASTIC_STEPS[self.cfg.sde_step]
        latents, log_probs, versions = [x], [], []
        copies = g if self.cfg.shared_init_noise else 1  # x is bitwise copies in runs of this
        low = self.cfg.ode_dtype == "bfloat16"
        # on the device once, not at every step (a copy from host memory waits for the GPU)
        sig_dev = host_to_device(sigmas, self.device, dtype)
        for i in range(t_steps):
            self._apply_offered()  # the step boundary: x, latents and log_probs so far are kept
            versions.append(self.version)
            sigma = sig_dev[i].expand(x.shape[0])
            sigma_next = sig_dev[i + 1].expand(x.shape[0])
            with torch.autocast(self.device.type, torch.bfloat16, enabled=low and not mask[i]):
                if copies > 1:  # one forward per run of copies, copied to its members
                    c = None if cond is None else cond[::copies]
                    v = self.velocity(x[::copies], sigma[::copies], ids[::copies], c)
                    v = v.repeat_interleave(copies, 0)
                else:
                    v = self.velocity(x, sigma, ids, cond)
            v = v.to(dtype)
            if mask[i]:
                copies = min(copies, after[i])  # the SDE noise splits the runs of copies
                x, lp, mean, std = step_fn(
                    x,
                    v,
                    sigma,
                    sigma_next,
                    self.cfg.noise_level,
                    float(sigmas[1]),
                    noise=noise[:, i + 1],
                )
                if by_modality is not None:
                    split = self.modality_split()
                    assert split is not None, "by_modality is asked of a video+audio family"
                    by_modality.append(modality_log_probs(x, mean, std, split).float())
            else:  # ODE steps, and always the last step to sigma=0 (its SDE std is 0)
                x, lp = (
                    euler_step(x, v, sigma, sigma_next),
                    torch.zeros(x.shape[0], device=x.device),
                )
                if by_modality is not None:
                    by_modality.append(torch.zeros(x.shape[0], 2, device=x.device))
            latents.append(x)
            log_probs.append(lp)
        lat, lp = torch.stack(latents, 1).float(), torch.stack(log_probs, 1).float()
        return x.float(), lat, lp, versions
