"""``diffrl train`` over several processes: ``torchrun --nproc-per-node N -m diffrl.cli train ...``.

The ``parallel`` config section holds the degrees (``ParallelConfig``). Without torchrun the
world is one process, and nothing here starts a process group. Under torchrun, ``start``
validates the degrees against the launcher's world before any model is loaded, joins the
process group (nccl on GPUs, one device per local rank; gloo on CPU) and builds the meshes.

What a run splits today is the data. Each data-parallel rank:
- rolls out and scores its own slice of the step's prompts, with the per-sample seeds those
  rows have in the one-process run (``RolloutEngine.stream``'s ``first_prompt``), so the
  ranks' samples together are the one-process run's samples;
- trains on its slice with the frozen base sharded by FSDP2 (``fully_shard`` per transformer
  block, then the root, over ``dp_shard``; HSDP over ``dp_replicate`` x ``dp_shard``) and the
  LoRA adapters replicated, their gradients averaged over the data-parallel ranks in fp32
  before clipping (``ActorEngine``'s ``dp_group``).

Every rank runs the same controller loop. Rank 0 writes the run directory. The step's metrics
are means over the ranks, and a stop signal or ``run.max_minutes`` seen by any rank stops all
of them at the same step (``Ranks``). Held-out eval is shared out: each rank samples a
contiguous share of the held-out prompts with the one-process seeds, the shares are gathered,
and every rank scores the whole set (the same result on each). After every optimizer step the
ranks that must hold the same adapters compare checksums of them (``parallel/drift.py``): a
rank that drifted fails the step on every rank, naming itself, the tensor and the axis.

Both loops run, and so does ``run.stream_train``: the update overlaps the rollout (async; or
each scored part trains while the next rolls out), and that is safe because the rollout makes
no collective (its copy is whole on each rank; ETP encodes at start-up): the actor's
collectives, in its worker thread one part or update at a time, and the loop's (metrics, stop
flags, eval, checkpoints, on the event loop's thread between updates) are each step's only
ones, made in the same order on every rank (``check_overlap`` refuses a sharded rollout with
them). Async needs more: each rank's rollout would otherwise take whatever update its own actor
had published, so under torchrun ``run.async_weights`` is ``fixed``: iteration i samples with
exactly update i - max_staleness's weights, and every rank samples, drops and trains the same
iterations whatever its timing (the one-process run with ``async_weights=fixed`` is the
reference, ``tests/parallel/test_overlap_cli.py``).

``parallel.tp`` > 1 shards the actor's DiT and its LoRA adapters with the family's TP plan
(``parallel/tp_lora.py``), then FSDP2 shards the result over ``dp_shard`` as above. The ranks
of a tp group are one data-parallel rank: they see the same prompts and seeds, and the
adapters' gradients are averaged over the dp peers of the same tp coordinate
(``Ranks.dp_group``). ``parallel.rollout`` places the rollout's and evaluator's DiT copies:
"sharded" (the default) shards them with the same plan over the same tp group, so sampling is
a collective of the group (its ranks sample the same rows, held-out eval shared out by
data-parallel rank) and each update lands through the verified sharded sync
(``parallel/tp_sync.py``); "replicated" keeps a whole copy on every rank that receives the
gathered LoRA through the one-process sync. ``parallel.etp`` above 1 shards the frozen text
encoders over groups of ``etp`` consecutive ranks (their own mesh), independently of the other
degrees, and encodes every prompt at start-up (``parallel/etp.py``).

``parallel.sp`` > 1 shards the actor's DiT forward over the sequence with Ulysses, through the
family's diffusers ``_cp_plan`` on the main mesh's ``sp`` axis (``parallel/sp.py``), then FSDP2
over ``dp_shard`` as above. Like a tp group, the ranks of an sp group are one data-parallel
rank (same prompts and seeds) and the rollout is not sharded over sp (each sp rank holds the
copy its tp coordinate holds); each rank's adapter gradients are its tokens' share, summed over
the sp group before the dp average and the clipping. With tp beside it, TP is applied first and
Ulysses splits each tp rank's heads again. Families without a plan diffrl train runs (SD3, the
tiny DiT, LTX-2) and the actor's compile under sp are refused at start-up, naming the keys; so
is tp with HSDP replicas (``dp_replicate`` > 1), which ``diffrl plan`` still plans.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from diffrl.errors import ConfigError, check, check_choice
from diffrl.parallel.dims import KEY, Meshes, ParallelDims, build_meshes

log = logging.getLogger(__name__)


ROLLOUT_LAYOUTS = ("sharded", "replicated")  # parallel.rollout


@dataclass(frozen=True)
class ParallelConfig:
    """The degrees of ``ParallelDims`` as config keys (``parallel.*``); the world size is the
    launcher's (torchrun's ``WORLD_SIZE``)."""

    dp_replicate: int = 1  # HSDP replicas
    dp_shard: int = -1  # FSDP2 shards per replica; -1 = whatever the other degrees leave
    sp: int = 1  # Ulysses sequence parallelism of the actor's DiT (parallel/sp.py)
    tp: int = 1  # tensor parallelism of the actor's DiT and LoRA
    etp: int = 1  # tensor parallelism of the text encoders (parallel/etp.py)
    # the rollout's and evaluator's DiT copies under tp > 1: "sharded" with the actor's TP plan
    # over the same tp group (synced through parallel/tp_sync.py), or "replicated" (whole on
    # every rank, synced with the gathered LoRA in one process); nothing at tp = 1
    rollout: str = "sharded"

    def validate(self) -> None:
        for name in ("dp_replicate", "sp", "tp", "etp"):
            value = getattr(self, name)
            check(value >= 1, name, value, "must be an integer >= 1 (1 = off)")
        check_choice("rollout", self.rollout, ROLLOUT_LAYOUTS)
        check(
            self.dp_shard >= 1 or self.dp_shard == -1,
            "dp_shard",
            self.dp_shard,
            "must be >= 1, or -1 for whatever the other degrees leave of the world",
        )

    def dims(self) -> ParallelDims:
        """These degrees over the launcher's world, validated (ConfigError naming the key)."""
        degrees = dataclasses.asdict(self)
        degrees.pop("rollout")  # a layout, not a degree
        return ParallelDims.from_env(**degrees).validate()


@dataclass(frozen=True)
class Ranks:
    """What the controller needs to know of the other processes: whether this one writes the
    run directory, the step's metrics averaged over the data-parallel ranks, and a flag any
    rank raised. One process: primary, and both are the identity."""

    rank: int = 0
    world: int = 1
    meshes: Meshes | None = None
    # the rollout and evaluator sharded over tp (tp > 1, parallel.rollout=sharded): the ranks
    # of a tp group sample the same rows together, held-out eval included
    rollout_tp: bool = False

    @property
    def primary(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.meshes.dp_rank if self.meshes is not None else 0

    @property
    def dp_size(self) -> int:
        return self.meshes.dp_size if self.meshes is not None else 1

    @property
    def etp_size(self) -> int:
        """Ranks each text encoder is tensor-parallel over (``parallel.etp``; 1 = whole)."""
        return self.meshes.size("etp") if self.meshes is not None else 1

    @property
    def etp_mesh(self):
        """This rank's ETP group as a 1-D mesh (``parallel/etp.py`` shards the encoders over
        it); None in one process."""
        return self.meshes.etp if self.meshes is not None else None

    @property
    def dp_group(self):
        """The process group gradients are averaged over: every data-parallel rank, across
        the replicas of HSDP too. Without tp or sp that is the whole world; with them, the
        ranks that share this rank's tp (and sp) coordinate: each averages its own shard of
        the sharded adapters. None in one process."""
        if self.meshes is None or self.meshes.main is None:
            return None
        if self.meshes.size("tp") == 1 and self.meshes.size("sp") == 1:
            return dist.group.WORLD
        return self.meshes.dp_group()

    @property
    def rows_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """Axis -> process group, for the axes whose ranks compute on the same rows (sequence
        and tensor parallelism, where more than 1): contract 3 compares their token hashes
        (``parallel/drift.py``). Empty in one process and under data parallelism alone."""
        if self.meshes is None:
            return {}
        return {a: self.meshes.group(a) for a in ("sp", "tp") if self.meshes.size(a) > 1}

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over every rank in float64, a "*_max" metric the largest (all
        ranks hold the same keys: same loop, same step). ``merge_rank_metrics`` is the same
        rule over metrics already gathered (the Ray actor group's)."""
        if self.world == 1 or not metrics:
            return metrics
        out = {}
        for op, keys in metric_reductions(metrics):
            values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
            t = all_reduced(values, op)
            t = t if op == dist.ReduceOp.MAX else t / self.world
            out.update(zip(keys, t.tolist(), strict=True))
        return out

    @property
    def tp_mesh(self):
        """The 1-D tp mesh of this rank's tp group (the actor's, and a sharded rollout's);
        None in one process."""
        if self.meshes is None or self.meshes.main is None:
            return None
        return self.meshes.main["tp"]

    def share(self, n: int) -> tuple[int, torch.Tensor]:
        """This rank's contiguous share of ``n`` items (the first one's index, the indices):
        all of them in one process. Under a sharded rollout a tp group samples one share
        together, so the shares are the data-parallel ranks'."""
        parts, mine = (self.dp_size, self.dp_rank) if self.rollout_tp else (self.world, self.rank)
        if parts == 1:
            return 0, torch.arange(n)
        per = -(-n // parts)
        first = min(n, mine * per)
        return first, torch.arange(first, min(n, first + per))

    def join(self, traj, device: torch.device):
        """Every rank's share (``share``) of a trajectory, in rank order, as one, on
        ``device``; ``traj`` itself in one process. A rank with no share passes None, and so
        does every rank of a sharded rollout's tp group but the first (its peers sampled the
        same rows). Collective."""
        if self.world == 1:
            return traj
        from diffrl.types import Trajectory, to_device

        if self.rollout_tp and self.meshes is not None and self.meshes.rank_in("tp"):
            traj = None
        cpu = None if traj is None else to_device(traj, torch.device("cpu"))
        shares: list = [None] * self.world
        dist.all_gather_object(shares, cpu)
        return to_device(Trajectory.concat([t for t in shares if t is not None]), device)

    def any(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = all_reduced(torch.tensor([1.0 if flag else 0.0]), dist.ReduceOp.MAX)
        return bool(t.item() > 0)


SOLO = Ranks()


def metric_reductions(metrics: dict[str, float]) -> list[tuple[Any, list[str]]]:
    """The step metrics' keys by how ranks combine them: (SUM, keys to average), (MAX, the
    "*_max" keys), each sorted, empty ones left out."""
    keys = sorted(metrics)
    split = [
        (dist.ReduceOp.SUM, [k for k in keys if not k.endswith("_max")]),
        (dist.ReduceOp.MAX, [k for k in keys if k.endswith("_max")]),
    ]
    return [(op, ks) for op, ks in split if ks]


def merge_rank_metrics(answers: list[dict[str, float]]) -> dict[str, float]:
    """Every rank's step metrics combined as ``Ranks.mean`` combines them (the float64 sum
    over ranks in rank order, divided by their number; "*_max" the largest), for callers that
    hold each rank's metrics rather than a process group."""
    out = {}
    for op, keys in metric_reductions(answers[0]):
        t = torch.tensor([[float(a[k]) for k in keys] for a in answers], dtype=torch.float64)
        t = t.amax(0) if op == dist.ReduceOp.MAX else t.sum(0) / len(answers)
        out.update(zip(keys, t.tolist(), strict=True))
    return out


def all_reduced(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """A small host tensor all-reduced over ``group`` (the world by default), back on the host;
    it travels through this rank's GPU where the backend is nccl, which reduces CUDA tensors
    only."""
    dev = t.device
    if dist.get_backend(group) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    t = t.to(dev)
    dist.all_reduce(t, op=op, group=group)
    return t.cpu()


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device(name: str) -> str:
    """``run.device`` for this rank: under torchrun, ``auto`` and ``cuda`` mean this rank's
    own GPU (``cuda:LOCAL_RANK``)."""
    if world_size() > 1 and name in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return name


def start(cfg, actor_group: bool = False) -> Ranks:
    """Validate ``cfg.parallel`` against the world, join the process group and build the
    meshes; ``SOLO`` without torchrun. ``actor_group``: the ranks are the Ray backend's actor
    workers (``backends/ray_actor_group.py``), which hold the actor alone: one controller and
    one rollout elsewhere, so the checks on each rank's own rollout and loop do not apply."""
    dims = cfg.parallel.dims()
    if dims.world_size == 1:
        return SOLO
    if dims.sp > 1:
        check_sp(cfg, dims)
    if dims.tp > 1:
        check_tp(cfg, dims)
    rollout_tp = dims.tp > 1 and cfg.parallel.rollout == "sharded" and not actor_group
    if dims.etp > 1:
        from diffrl.models.registry import family

        spec = family(cfg.model.resolved_family)
        if not spec.etp_plans:
            raise ConfigError(
                f"{KEY}.etp={dims.etp}: model family {spec.name!r} declares no ETP plan for "
                f"its text encoder(s) (FamilySpec.etp_plans is empty); set {KEY}.etp=1"
            )
    if cfg.run.backend != "local" and not actor_group:
        raise ConfigError(
            f"config key 'run.backend' = {cfg.run.backend!r}: under torchrun diffrl train runs "
            "its engines in each rank's process; set run.backend=local"
        )
    if not actor_group:
        check_overlap(cfg)
    if cfg.actor.minibatches != 1:
        raise ConfigError(
            f"config key 'actor.minibatches' = {cfg.actor.minibatches}: under torchrun the "
            "ranks take one optimizer step per RL step together; set actor.minibatches=1"
        )
    if cfg.data.prompts_per_step % dims.dp:
        raise ConfigError(
            f"config key 'data.prompts_per_step' = {cfg.data.prompts_per_step}: each of the "
            f"{dims.dp} data-parallel ranks rolls out an equal slice of the step's prompts, so "
            f"it must be a multiple of {dims.dp}"
        )
    name = local_device(cfg.run.device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    meshes = build_meshes(dims, device.type)
    rank = dist.get_rank()
    if rank:  # one voice in the console: the others log warnings and errors only
        logging.getLogger("diffrl").setLevel(logging.WARNING)
    return Ranks(rank, dims.world_size, meshes, rollout_tp)


def check_overlap(cfg) -> None:
    """The loops that train while the rollout samples (async, ``run.stream_train``) run under
    torchrun when the rollout issues no collective (each rank's rollout copy is whole, the
    text encoders' ETP collectives ran at start-up): the actor's collectives are then the
    only ones of a step, made in the same order on every rank. Async also needs every rank to
    roll out iteration i with the same weights, whatever its timing (``async_weights``)."""
    layout = cfg.parallel.rollout
    overlap = "run.mode=async" if cfg.run.mode == "async" else ""
    overlap = overlap or ("run.stream_train=true" if cfg.run.stream_train else "")
    if overlap and layout != "replicated" and cfg.parallel.tp > 1:  # tp=1: nothing to shard
        raise ConfigError(
            f"config key '{KEY}.rollout' = {layout!r} with {overlap}: a sharded rollout "
            "makes collectives while the actor makes its own (the update overlaps the rollout), "
            f"which the ranks could reach in different orders; set {KEY}.rollout=replicated"
        )
    if cfg.run.mode == "async" and cfg.run.async_weights == "latest":
        raise ConfigError(
            "config key 'run.async_weights' = 'latest' under torchrun: each rank's rollout "
            "would take whatever update its own actor had published (timing decides), so the "
            "ranks would sample and drop differently; set run.async_weights=fixed (or auto)"
        )


def check_tp(cfg, dims: ParallelDims) -> None:
    """``parallel.tp`` > 1 before any process group: the family must declare a TP plan, and
    the data-parallel ranks beside tp are FSDP2 shards (dp_shard): HSDP replicas over a
    TP-sharded base are not run by diffrl train yet."""
    from diffrl.models.registry import family  # the records import diffusers lazily

    spec = family(cfg.model.resolved_family)
    if spec.tp_plan is None:
        raise ConfigError(
            f"{KEY}.tp={dims.tp}: model family {spec.name!r} declares no TP plan for the tp "
            f"axis; set {KEY}.tp=1 (shard the base with {KEY}.dp_shard instead)"
        )
    if cfg.actor.compile:
        # seen with torch 2.13 on CPU: inductor dies tracing the DTensor-sharded blocks
        # ("TypeError: mul expected 2 arguments, got 3" in symbolic shapes, minimax_h3 at tp=2)
        raise ConfigError(
            f"config key 'actor.compile' = True with {KEY}.tp={dims.tp}: the actor's regional "
            "compile is not run over a TP-sharded base yet (inductor fails tracing its DTensor "
            "blocks); set actor.compile=false (a replicated rollout, parallel.rollout=replicated, "
            "may still compile)"
        )
    if dims.dp_replicate > 1:
        raise ConfigError(
            f"{KEY}.tp={dims.tp} with {KEY}.dp_replicate={dims.dp_replicate}: diffrl train "
            f"does not run HSDP replicas over a TP-sharded base yet; set {KEY}.dp_replicate=1 "
            f"(FSDP2 over {KEY}.dp_shard composes with tp)"
        )
    if cfg.parallel.rollout == "sharded":
        for key in ("compile", "cuda_graphs"):
            if getattr(cfg.rollout, key):
                # compile: inductor fails on DTensor blocks, as the actor's; CUDA graphs would
                # capture the tp group's collectives, which nothing here has verified
                raise ConfigError(
                    f"config key 'rollout.{key}' = True with {KEY}.tp={dims.tp} and "
                    f"{KEY}.rollout='sharded': the rollout's DiT copy is TP-sharded and not "
                    f"run with rollout.{key} yet; set rollout.{key}=false, or "
                    f"{KEY}.rollout=replicated (a whole copy on every rank)"
                )


def check_sp(cfg, dims: ParallelDims) -> None:
    """``parallel.sp`` > 1 before any process group: the family must have a context-parallel
    plan diffrl train runs (``parallel/sp.py``); the actor's compile is not run over it yet.
    Beside tp, the tp checks run too (``check_tp``)."""
    from diffrl.models.registry import family  # the records import diffusers lazily
    from diffrl.parallel.sp import check_family

    spec = family(cfg.model.resolved_family)
    check_family(spec.name, spec.sp_plan, dims.sp)
    if cfg.actor.compile:
        raise ConfigError(
            f"config key 'actor.compile' = True with {KEY}.sp={dims.sp}: the actor's regional "
            "compile is not run over diffusers' context-parallel hooks yet; set "
            "actor.compile=false (the rollout, unsharded, may still compile)"
        )


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
