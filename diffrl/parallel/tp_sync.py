"""Contract 2 across ranks: LoRA sync into a TP-sharded rollout, exact on every rank or nowhere.

``diffrl train`` reaches it under ``parallel.tp`` > 1 with ``parallel.rollout=sharded`` (the
default): ``shard_rollout`` shards the rollout's and evaluator's DiT copies with the family's TP
plan over the actor's tp group, keeping the serving layout's fusions TP can hold (fused Q/K/V
under ``FusedColwiseParallel``), and checks their layout against what the sync expects
(``check_layout``); the copies are built without a whole second DiT on the device at any time
(``alias_copy``, ``serving_slot_map``). ``RolloutEngine.load_weights`` applies each update through
``ShardedLoraTarget`` and ``receipt_of_sharded`` reads the post-sync receipt across the shards
(``tests/parallel/test_tp_sync_gloo.py``, ``test_tp_rollout_gloo.py``).

The actor exports full LoRA factors per trained module (``WeightUpdate``: A (r, in), B (out, r),
scale). A rollout sharded by ``tp.apply_plan`` holds each targeted weight as a DTensor: a
column-sharded Linear (``ColwiseParallel``, ``Shard(0)``) keeps rows ``[rank*out/tp, ...)``, a
row-sharded one (``RowwiseParallel``, ``Shard(1)``) keeps columns, a fused one
(``FusedColwiseParallel``, ``_StridedShard(0, chunks)``) keeps its slice of every chunk, and an
unsharded module keeps a plain tensor (all of it). A ``SlotMap`` (``sync/layouts.py``) may still
send a trained module's rows into rows of another weight (a fused QKV); its slices are in the
weight's global rows, as without TP.

``ShardedLoraTarget`` keeps a frozen copy of each rank's local shards. For each target and each
rank it works out which global rows and columns of the weight this rank holds (from the
DTensor's own placements, split locally by ``distribute_tensor(src_data_rank=None)``, so the
index arithmetic is torch's), and adds only ``scale * B[rows] @ A[:, cols]``: no rank builds a
full delta. Before anything is written, every rank checks

- the update's targets are the expected ones, each delta's trained rows are covered once by its
  slots and its input width is the weight's, and the local shard has the shape its indices say;
- its own shards: a weighted sum of what it wrote, ``u^T (W_new - W_base)[rows, cols] v`` with
  weights fixed by each entry's trained row and global column, equals ``scale (u^T B[rows])
  (A[:, cols] v)``, the same slice through the factors (float64, another order of operations;
  the weights catch a row or column written in the wrong place, which a plain sum would not);
- across ranks, in one all-reduce over the TP mesh: no rank failed, and the ranks' written sums
  (each divided by how many ranks hold the same entries) add up to the actor's checksum of the
  full delta, so a row held by no rank or by two is caught even where each rank agrees with
  itself.

Every rank reaches the all-reduce (a rank whose own checks failed sends a flag instead of its
sums), so a bad update raises ``SyncError`` on every rank and commits nothing anywhere.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from diffrl.errors import ConfigError
from diffrl.models.family import FamilyModel, transformer_root
from diffrl.parallel.tp import FusedColwiseParallel, Plan, apply_plan, check_plan, resolve
from diffrl.sync.layouts import fuse_parts, merge
from diffrl.sync.receipt import SyncReceipt, receipt_rows
from diffrl.sync.weights import (  # the single-process sync's base copies and dtype bound
    PROBES,
    BasePrints,
    SlotMap,
    SyncError,
    SyncReport,
    WeightUpdate,
    _copy,
    _rounding_bound,
    check_disjoint,
    check_prints,
    check_targets,
    eps_of,
    probe,
    slot_prints,
    slot_weights,
)

_M = TypeVar("_M", bound=nn.Module)
REL_TOL = 1e-4  # as MergedLoraTarget: fp32 rounding of W + delta is far inside it


@dataclass(frozen=True)
class TpSyncReport(SyncReport):
    rank: int = 0  # this rank's index on the TP mesh
    written: int = 0  # weight entries this rank wrote (its shards' share of every delta)
    max_global_checksum_err: float = 0.0  # |sum over ranks - actor's checksum|, on every rank

    def as_metrics(self) -> dict[str, float]:
        return {
            **super().as_metrics(),
            "sync/max_global_checksum_err": self.max_global_checksum_err,
        }


@dataclass(frozen=True)
class _Slab:
    """Where one slot of a trained module lands in this rank's shard of one weight."""

    module: str
    local_rows: Tensor  # (k,) row positions in the local shard
    src_rows: Tensor  # (k,) the trained delta's rows that land there
    cols: Tensor | None  # (c,) global columns this rank holds; None = all
    copies: int  # ranks that hold the same entries (tp for a replicated weight, else 1)


@dataclass(frozen=True)
class _Shard:
    """One targeted weight as this rank holds it."""

    param: Tensor  # the module's weight (DTensor or plain)
    rows: Tensor | None  # (out_local,) global rows held; None = all
    cols: Tensor | None  # (in_local,) global columns held; None = all
    copies: int


class ShardedLoraTarget:
    """The TP rollout's view of one model on one rank: frozen copies of its local shards of
    every weight a sync may write, and how the trained rows land in them."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        expected: list[str],
        slot_map: SlotMap | None = None,
        base_device: str = "",
        base_prints: BasePrints | None = None,
    ):
        """``mesh`` is the 1-D TP mesh the plan was applied on; ``expected`` the trained module
        names (as in the model); ``base_device`` and ``base_prints`` as for
        ``MergedLoraTarget`` (the prints taken before the serving layout and the plan; given,
        every rank checks them here, in one collective, else on the first update that
        carries the actor's)."""
        if mesh.ndim != 1:
            raise SyncError(f"ShardedLoraTarget takes the 1-D TP mesh; got {mesh}")
        self.model, self.mesh = model, mesh
        self.slot_map = slot_map or SlotMap()
        self.expected = sorted(expected)
        weights = slot_weights(model, self.slot_map, self.expected)
        self.shards = {m: self._shard_of(m, w) for m, w in weights.items()}
        rows = {m: s.param.shape[0] for m, s in self.shards.items()}
        check_disjoint(self.slot_map, self.expected, rows)
        # where each trained module's rows sit in the shared row-print vectors: sized from the
        # slot map, the same on every rank whatever an update carries
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name in self.expected:
            n = sum(len(range(rows[s.module])[s.dst_rows]) for s in self.slot_map.slots_for(name))
            self.offsets[name], start = (start, n), start + n
        self.n_rows = start
        self.base = {k: _copy(_local(s.param), base_device) for k, s in self.shards.items()}
        self.verified: BasePrints | None = None
        if base_prints is not None:
            self.check_base(base_prints, "the rollout's own base before its layout and plan")

    def _shard_of(self, module: str, weight: Tensor) -> _Shard:
        if not isinstance(weight, DTensor):
            return _Shard(weight, None, None, self.mesh.size())
        if weight.device_mesh != self.mesh:
            raise SyncError(
                f"{module}: weight is sharded over {weight.device_mesh}, not {self.mesh}"
            )
        if weight.ndim != 2 or any(p.is_partial() for p in weight.placements):
            raise SyncError(f"{module}: cannot sync a {weight.ndim}-D or Partial weight")
        rows, cols = _held(weight, 0), _held(weight, 1)
        local = weight.to_local()
        want = (
            weight.shape[0] if rows is None else len(rows),
            weight.shape[1] if cols is None else len(cols),
        )
        if tuple(local.shape) != want:
            raise SyncError(
                f"{module}: local shard {tuple(local.shape)}, its placements say {want}"
            )
        copies = self.mesh.size() if rows is None and cols is None else 1
        return _Shard(weight, rows, cols, copies)

    def _slabs(self, name: str, out: int, cols_in: int) -> list[_Slab]:
        """This rank's pieces of trained module ``name`` (delta (out, cols_in))."""
        slabs, src_all = [], []
        for slot in self.slot_map.slots_for(name):
            shard = self.shards[slot.module]
            n_rows, n_cols = shard.param.shape
            if cols_in != n_cols:
                raise SyncError(
                    f"{name} -> {slot.module}: delta has {cols_in} input columns, "
                    f"the weight {n_cols}"
                )
            src, dst = torch.arange(out)[slot.rows], torch.arange(n_rows)[slot.dst_rows]
            if len(src) != len(dst):
                raise SyncError(
                    f"{name} -> {slot.module}: delta rows {slot.rows} ({len(src)} of {out}) do "
                    f"not fit rows {slot.dst_rows} ({len(dst)} of {n_rows})"
                )
            src_all.append(src)
            # global weight row -> trained row (-1: not this slot's), read at the rows held here
            lookup = torch.full((n_rows,), -1, dtype=torch.long)
            lookup[dst] = src
            held = lookup if shard.rows is None else lookup[shard.rows]
            local_rows = (held >= 0).nonzero().flatten()
            slabs.append(_Slab(slot.module, local_rows, held[local_rows], shard.cols, shard.copies))
        covered = torch.cat(src_all).sort().values
        if not torch.equal(covered, torch.arange(out)):
            raise SyncError(
                f"{name}: its slots cover {len(covered)} rows ({covered.unique().numel()} "
                f"distinct) of the delta's {out}; each must land exactly once"
            )
        return slabs

    def _reduce(self, parts: list[Tensor], error: Exception | None, what: str) -> list[Tensor]:
        """Sum ``parts`` (float64, CPU) over the TP mesh in one all-reduce, with a failure flag
        per rank; raise on every rank if any failed; return the sums (CPU, shaped as given)."""
        rank, size = self.mesh.get_local_rank(), self.mesh.size()
        flags = torch.zeros(size, dtype=torch.float64)
        if error is not None:
            flags[rank] = 1.0
        shared = torch.cat([flags, *(p.flatten() for p in parts)]).to(self.mesh.device_type)
        # every rank reaches this, failed or not: no rank waits on one that gave up
        dist.all_reduce(shared, group=self.mesh.get_group())
        shared = shared.cpu()
        failed = [r for r in range(size) if shared[r] > 0]
        if error is not None:
            raise error  # this rank's own (a SyncError, or a bug as itself)
        if failed:
            raise SyncError(
                f"{what}: TP rank(s) {failed} failed verification; "
                f"rank {rank} verified its shards but commits nothing"
            )
        out, at = [], size
        for p in parts:
            out.append(shared[at : at + p.numel()].view_as(p))
            at += p.numel()
        return out

    def _check_global(self, name: str, got: Tensor, tol: Tensor, want: Tensor, what: str) -> float:
        """The ranks' partial row prints of ``name``, summed, against the full ones."""
        if len(want) != len(got):
            raise SyncError(f"{what}: {len(want)} row prints sent, its slots hold {len(got)} rows")
        return check_prints(
            got,
            want,
            tol,
            f"{what}, the TP ranks' shards together: rows held by no rank or by two, or sent "
            "to the wrong place",
            torch.arange(len(got)),
        )

    @torch.no_grad()
    def check_base(self, prints: BasePrints, source: str) -> float:
        """Every rank checks its shards' base rows against ``prints`` (rows it holds whole:
        here; rows split by columns: their partial prints, summed across ranks in one
        all-reduce); raise ``SyncError`` on every rank unless all match."""
        rank = self.mesh.get_local_rank()
        # per trained row: [partial print / copies, its tolerance / copies]
        buf = torch.zeros(2, self.n_rows, PROBES, dtype=torch.float64)
        error, worst = None, 0.0
        try:
            for name in self.expected:
                want = prints.rows.get(name)
                if want is None:
                    raise SyncError(f"{source}: no base row prints for trained module {name}")
                start, n = self.offsets[name]
                width = self.shards[self.slot_map.slots_for(name)[0].module].param.shape[1]
                for i, slab in enumerate(self._slabs(name, len(want), width)):
                    local = self.base[slab.module]
                    device = _local(self.shards[slab.module].param).device
                    rows = local[slab.local_rows.to(local.device)].to(device)
                    r = probe(name, width)
                    r = (r if slab.cols is None else r[slab.cols]).to(device)
                    eps = eps_of(local.dtype, prints.dtypes.get(name, local.dtype))
                    got, tol = slot_prints(rows, None, r, eps)
                    if slab.cols is None:  # whole rows: this rank checks them itself
                        what = (
                            f"base of {name} -> {slab.module} (slot {i}) on TP rank {rank} "
                            f"against {source}: the slot map sends these rows to the wrong "
                            "place, or the rollout holds other base weights"
                        )
                        worst = max(
                            worst, check_prints(got, want[slab.src_rows], tol, what, slab.src_rows)
                        )
                    idx = start + slab.src_rows
                    buf[0].index_add_(0, idx, got.cpu() / slab.copies)
                    buf[1].index_add_(0, idx, tol.cpu() / slab.copies)
        except Exception as e:  # any failure, so that every rank still reaches the all-reduce
            error = e
        (buf,) = self._reduce([buf], error, f"base prints from {source}")
        for name in self.expected:
            start, n = self.offsets[name]
            got, tol = buf[0, start : start + n], buf[1, start : start + n]
            what = f"base of {name} against {source}"
            worst = max(worst, self._check_global(name, got, tol, prints.rows[name], what))
        self.verified = prints
        return worst

    @torch.no_grad()
    def apply(self, update: WeightUpdate) -> TpSyncReport:
        """Write base + this rank's slice of every delta into its shards, after every rank has
        verified its part; raise ``SyncError`` on every rank otherwise."""
        n = len(self.expected)
        rank = self.mesh.get_local_rank()
        if update.base is not None and not update.base.same_as(self.verified):
            # the same update on every rank, so every rank takes this collective or none does
            self.check_base(update.base, f"the actor's base (update v{update.version})")
        # per target: [written sum / copies, rounding bound]; per trained row: [partial delta
        # print / copies, its tolerance / copies]
        sums = torch.zeros(2, n, dtype=torch.float64)
        buf = torch.zeros(2, self.n_rows, PROBES, dtype=torch.float64)
        new: dict[str, Tensor] = {}
        max_err, max_frac, written, error = 0.0, 0.0, 0, None
        try:
            self._check_names(update)
            for i, name in enumerate(self.expected):
                start, rows = self.offsets[name]
                err, count, sum_, rounding, frac = self._apply_one(
                    name, update, new, buf[0, start : start + rows], buf[1, start : start + rows]
                )
                max_err, written = max(max_err, err), written + count
                max_frac = max(max_frac, frac)
                sums[0, i], sums[1, i] = sum_, rounding
        except Exception as e:  # any failure, so that every rank still reaches the all-reduce
            error = e
        sums, buf = self._reduce([sums, buf], error, f"weight update v{update.version}")
        max_global = 0.0
        for i, name in enumerate(self.expected):
            sum_, rounding = float(sums[0, i]), float(sums[1, i])
            want = update.checksums[name]
            err, tol = abs(sum_ - want), REL_TOL * max(1.0, abs(want)) + rounding
            if err > tol:  # the same numbers on every rank, so every rank raises
                raise SyncError(
                    f"{name}: the ranks' shards together hold {sum_:.6g} of its delta, the "
                    f"actor sent {want:.6g} (tolerance {tol:.3g}): rows held by no rank or by "
                    "two, or a corrupted update"
                )
            max_global = max(max_global, err)
            start, rows = self.offsets[name]
            frac = self._check_global(
                name,
                buf[0, start : start + rows],
                buf[1, start : start + rows],
                update.delta_rows[name],
                f"delta of {name} (update v{update.version})",
            )
            max_frac = max(max_frac, frac)
        for module, w in new.items():  # commit only after every rank verified every target
            _local(self.shards[module].param).copy_(w)
        return TpSyncReport(
            update.version,
            update.adapter,
            n,
            n,
            max_err,
            max_frac,
            rank=rank,
            written=written,
            max_global_checksum_err=max_global,
        )

    def _check_names(self, update: WeightUpdate) -> None:
        check_targets(update, self.expected)

    def _apply_one(
        self,
        name: str,
        update: WeightUpdate,
        new: dict[str, Tensor],
        prints: Tensor,
        tols: Tensor,
    ) -> tuple[float, int, float, float, float]:
        """Add this rank's slice of ``name``'s delta into ``new`` (local shards, from the base),
        and its partial row prints / copies into ``prints`` and ``tols`` (per trained row);
        return (local checksum error, entries written, written sum / copies, rounding bound,
        the worst whole-row print error as a fraction of its tolerance)."""
        d = update.deltas[name]
        a, b = d.a.double(), d.b.double()  # (r, in), (out, r)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise SyncError(
                f"{name}: LoRA factors A {tuple(a.shape)}, B {tuple(b.shape)} do not chain"
            )
        want_rows = update.delta_rows[name]
        if want_rows.shape != (b.shape[0], PROBES):
            raise SyncError(f"{name}: {tuple(want_rows.shape)} row prints for {b.shape[0]} rows")
        rank = self.mesh.get_local_rank()
        err, count, total, rounding, frac = 0.0, 0, 0.0, 0.0, 0.0
        for i, slab in enumerate(self._slabs(name, b.shape[0], a.shape[1])):
            target = new.get(slab.module)
            if target is None:
                target = self.base[slab.module].to(_local(self.shards[slab.module].param).device)
                target = new[slab.module] = target.clone()
            a_cols = a if slab.cols is None else a[:, slab.cols]  # (r, c)
            b_rows = b[slab.src_rows]  # (k, r)
            part = (b_rows @ a_cols) * d.scale  # (k, c): this rank's slice only
            rows = slab.local_rows.to(target.device)
            target[rows] += part.to(target)
            base = self.base[slab.module]
            applied = target[rows].double() - base[rows.to(base.device)].double().to(target.device)
            bound = _rounding_bound(target[rows], target.dtype) if rows.numel() else 0.0
            # The slice again through the factors, weighted by each entry's trained row and
            # global column (u (k,), v (c,)), so a row or column written in the wrong place
            # fails where a plain sum would not: u^T (scale B A) v = scale (u^T B)(A v).
            u = _probe(slab.src_rows).to(applied)
            v = _probe(torch.arange(a.shape[1]) if slab.cols is None else slab.cols).to(applied)
            want = float((u @ b_rows.to(applied)) @ (a_cols.to(applied) @ v)) * d.scale
            got = float(u @ applied @ v)
            e, tol = abs(got - want), REL_TOL * max(1.0, abs(want)) + _PROBE_MAX * bound
            if e > tol:
                raise SyncError(
                    f"checksum mismatch for {name} -> {slab.module} on TP rank "
                    f"{self.mesh.get_local_rank()}: wrote {got:.6g} (weighted sum), its slice "
                    f"of the delta gives {want:.6g} (tolerance {tol:.3g})"
                )
            got = float(applied.sum())  # the plain sum, for the actor's checksum across ranks
            err, count = max(err, e), count + part.numel()
            total, rounding = total + got / slab.copies, rounding + bound / slab.copies
            # row prints of what this rank wrote: whole rows checked here, partial ones (a
            # column shard) summed across ranks and checked after the all-reduce
            r = probe(name, a.shape[1])
            r = (r if slab.cols is None else r[slab.cols]).to(target.device)
            eps = eps_of(target.dtype, d.a.dtype, torch.float32)
            p, t = slot_prints(target[rows], base[rows.to(base.device)], r, eps)
            if slab.cols is None:
                what = (
                    f"delta of {name} -> {slab.module} (slot {i}) on TP rank {rank}: the "
                    "merged shard differs from what the actor sent"
                )
                frac = max(frac, check_prints(p, want_rows[slab.src_rows], t, what, slab.src_rows))
            prints.index_add_(0, slab.src_rows, p.cpu() / slab.copies)
            tols.index_add_(0, slab.src_rows, t.cpu() / slab.copies)
        return err, count, total, rounding, frac


_PROBE_MAX = 1.5  # the largest weight _probe gives


def _probe(index: Tensor) -> Tensor:  # (n,) global indices -> (n,) weights in [0.5, 1.5]
    """Fixed, position-dependent weights: the same entry gets the same weight on every rank."""
    return 1.0 + 0.5 * torch.sin(index.double() * 1.6180339887)


def _local(weight: Tensor) -> Tensor:
    """The tensor this rank stores for ``weight`` (its local shard, or itself): a DTensor's
    ``to_local()`` is its storage, so a sync's ``copy_`` lands in the parameter."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _held(weight: DTensor, dim: int) -> Tensor | None:
    """The global indices along ``dim`` this rank holds, in local order (None: all of them),
    from torch's own split of the placements (``src_data_rank=None``: no communication)."""
    # (_StridedShard, FusedColwiseParallel's placement, answers is_shard() with False)
    placements = [
        p if isinstance(p, (Shard, _StridedShard)) and p.dim == dim else Replicate()
        for p in weight.placements
    ]
    if all(isinstance(p, Replicate) for p in placements):
        return None
    shape = [1] * weight.ndim
    shape[dim] = weight.shape[dim]
    index = torch.arange(weight.shape[dim], device=weight.device).view(shape)
    local = distribute_tensor(index, weight.device_mesh, placements, src_data_rank=None)
    return local.to_local().flatten().cpu()


# --- the rollout's copy sharded with the actor's plan (parallel.rollout=sharded) ----------------


def planned_placement(style: object) -> Placement | None:
    """The placement a TP style gives a Linear's weight (None: the style leaves it whole)."""
    if isinstance(style, FusedColwiseParallel):
        return _StridedShard(0, split_factor=style.chunks)
    if isinstance(style, ColwiseParallel):
        return Shard(0)
    if isinstance(style, RowwiseParallel):
        return Shard(1)
    return None


def check_layout(
    model: nn.Module, mesh: DeviceMesh, plan: Plan, targets: list[str], slot_map: SlotMap
) -> None:
    """At start-up: every weight a trained module's rows land in (its slots in ``slot_map``)
    is held in the sharded rollout ``model`` as ``plan`` shards it (the placement
    ``ShardedLoraTarget`` reads its rows and columns from) over ``mesh``, the actor's tp group;
    else a ``SyncError`` naming the weight, what it holds and what the plan says. A weight the
    plan leaves out must stay whole."""
    root = transformer_root(model)
    prefix = next(n for n, m in model.named_modules() if m is root)
    paths = resolve(root, plan)
    styles = {
        f"{prefix}.{path}" if prefix else path: style
        for pattern, style in plan.items()
        for path in paths[pattern]
    }
    family = getattr(getattr(model, "family", None), "name", type(model).__name__)
    for name in targets:
        for module in dict.fromkeys(s.module for s in slot_map.slots_for(name)):
            weight = getattr(model.get_submodule(module), "weight", None)
            want = planned_placement(styles.get(module))
            held = weight.placements if isinstance(weight, DTensor) else "whole"
            on = weight.device_mesh if isinstance(weight, DTensor) else None
            if want is None and on is None:
                continue
            if want is not None and on == mesh and tuple(held) == (want,):
                continue
            where = f"over ranks {on.mesh.tolist()} ({on.mesh_dim_names})" if on else ""
            raise SyncError(
                f"rollout layout at start-up (family {family}, parallel.rollout=sharded): "
                f"{module} (trained {name}) is held {held} {where}, the sync expects "
                f"{(want,) if want is not None else 'whole'} over the tp group "
                f"{mesh.mesh.tolist()} ({mesh.mesh_dim_names}; "
                f"{type(styles.get(module)).__name__} in the rollout's TP plan); a sync would "
                "write its rows and columns in the wrong place"
            )


def tp_fusions(layout: SlotMap, styles: dict[str, object], model: nn.Module) -> dict:
    """The fusions of a family's one-process serving ``layout`` that a TP-sharded copy can hold:
    fused module -> its parts (full names, in row order), for each fused weight whose parts
    are equal Linears that the plan (``styles``: full module name -> style) column-shards
    plainly, so ``FusedColwiseParallel(parts)`` gives each rank its slice of every part.
    Layouts TP cannot hold (a module split over several weights: swapped shards) are left
    out: the plan's shards are that module's layout."""
    by_module: dict[str, list[tuple[int, str]]] = {}
    for name, slots in layout.slots.items():
        if len(slots) == 1 and slots[0].rows == slice(None):
            dst = slots[0].dst_rows
            by_module.setdefault(slots[0].module, []).append((dst.start or 0, name))
    out = {}
    for module, parts in by_module.items():
        names = [n for _, n in sorted(parts)]
        lins = [model.get_submodule(n) for n in names]
        if (
            len(names) > 1
            and all(type(styles.get(n)) is ColwiseParallel for n in names)
            and all(isinstance(m, nn.Linear) for m in lins)
            and len({m.out_features for m in lins}) == 1
        ):
            out[module] = names
    return out


def shard_rollout(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Plan | None,
    targets: list[str],
    base_device: str = "",
    base_prints: BasePrints | None = None,
    layout: SlotMap | None = None,
    source: nn.Module | None = None,
) -> ShardedLoraTarget:
    """Shard a rollout's copy ``model`` (a plain FamilyModel, not peft-wrapped) in place with
    the family's TP ``plan`` over the 1-D tp ``mesh``, check its layout against what the sync
    expects, and return the target updates are written through.

    ``layout``: the family's one-process serving layout's slot map (taken on another copy,
    ``serving_slot_map``). Its fusions of column-sharded parts (fused Q/K/V) are made here too,
    the fused weight held by ``FusedColwiseParallel`` with ``RowView``s of it in the parts'
    place (``tp_fusions``); what TP cannot hold (swapped shards) keeps the plan's shards as its
    layout. ``base_prints``: the trained rows before any layout and the plan.

    ``source``: the model ``model`` was copied from by ``alias_copy`` (its tensors share
    ``source``'s storage). Then no whole second DiT is made: every tensor the plan does not
    shard gets its own storage first (a replicated placement is broadcast in place, which must
    not write into the source), the sharded weights are scattered from the shared storage into
    their shards, and each fusion's weight is whole only until it is sharded, one at a time."""
    family = getattr(getattr(model, "family", None), "name", type(model).__name__)
    if plan is None:
        raise ConfigError(
            f"parallel.rollout=sharded: model family {family!r} declares no TP plan "
            "(FamilySpec.tp_plan) to shard the rollout's copy with; set parallel.rollout="
            "replicated or parallel.tp=1"
        )
    root = transformer_root(model)
    prefix = next(n for n, m in model.named_modules() if m is root)
    paths = check_plan(root, mesh.size(), plan)  # all of it, before anything is sharded
    full = {path: f"{prefix}.{path}" if prefix else path for p in paths.values() for path in p}
    styles = {full[path]: style for pattern, style in plan.items() for path in paths[pattern]}
    fusions = tp_fusions(layout or SlotMap(), styles, model)
    fused_parts = {n for parts in fusions.values() for n in parts}
    # the plan spelt out module by module, less the fused parts (sharded as one weight below)
    explicit: Plan = {
        path: style
        for pattern, style in plan.items()
        for path in paths[pattern]
        if full[path] not in fused_parts
    }
    if source is not None:
        _own_storage(model, source, keep=_scattered(model, prefix, explicit, fused_parts))
    apply_plan(root, mesh, explicit)
    maps = []
    device = next(model.parameters()).device
    # the fused Linears are made from the global RNG and overwritten: keep the draws out of it
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for module, parts in fusions.items():
            maps.append(fuse_parts(model, module, parts))
            parallelize_module(model.get_submodule(module), mesh, FusedColwiseParallel(len(parts)))
            explicit[module[len(prefix) + 1 :] if prefix else module] = FusedColwiseParallel(
                len(parts)
            )
    if source is not None:  # a safety net: nothing of the copy may still share the source's
        _own_storage(model, source, keep=set())
    slot_map = merge(*maps)
    check_layout(model, mesh, explicit, targets, slot_map)
    return ShardedLoraTarget(model, mesh, targets, slot_map, base_device, base_prints)


# --- building the sharded copy without a whole second DiT on the device ------------------------


def alias_copy(model: _M) -> _M:
    """``copy.deepcopy(model)`` whose parameters and buffers are new tensors over ``model``'s
    storage (no memory): the start of a sharded rollout copy, which ``shard_rollout(...,
    source=model)`` then gives its own storage piece by piece, sharded where the plan says."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach(), requires_grad=False)
    for b in model.buffers():
        memo[id(b)] = b.detach()
    return copy.deepcopy(model, memo)


def _storages(module: nn.Module) -> set[int]:
    return {
        _local(t).untyped_storage().data_ptr()
        for t in [*module.parameters(), *module.buffers()]
        if _local(t).numel()
    }


def _scattered(model: nn.Module, prefix: str, explicit: Plan, fused_parts: set[str]) -> set[int]:
    """ids of the tensors the plan scatters into shards (read, never written, by the scatter):
    the weights of Colwise/Rowwise-styled Linears, and Colwise biases, and the fused parts'."""
    out = set()
    for path, style in explicit.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        sub = model.get_submodule(f"{prefix}.{path}" if prefix else path)
        out.add(id(sub.weight))
        if isinstance(style, ColwiseParallel) and getattr(sub, "bias", None) is not None:
            out.add(id(sub.bias))
    for name in fused_parts:  # concatenated into a new fused weight: read only
        out |= {id(t) for t in model.get_submodule(name).parameters(recurse=False)}
    return out


@torch.no_grad()
def _own_storage(model: nn.Module, source: nn.Module, keep: set[int]) -> None:
    """Give every parameter and buffer of ``model`` that shares ``source``'s storage its own
    copy (a DTensor its own local shard), except the tensors whose ids are in ``keep``."""
    shared = _storages(source)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or id(t) in keep or not _local(t).numel():
                    continue
                if _local(t).untyped_storage().data_ptr() not in shared:
                    continue
                own = t.detach().clone()
                table[name] = (
                    nn.Parameter(own, requires_grad=False) if table is module._parameters else own
                )


class _ReplayDraws(TorchDispatchMode):
    """Under it, each random fill of a meta tensor (``nn.Linear``'s init of a fused weight made
    on a meta copy) is repeated on a real tensor of the same shape and dtype on ``device``, so
    the device's generator advances as the same fill on a real copy would advance it."""

    OPS = {torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default}

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            if func not in self.OPS or not isinstance(args[0], Tensor) or not args[0].is_meta:
                # a draw this replay does not know how to repeat: the RNG would silently part
                # from the one-process run's, so the layout is refused instead
                raise ConfigError(
                    f"parallel.rollout=sharded: the serving layout draws with {func} on a meta "
                    "copy; only in-place uniform_/normal_ fills (nn.Linear's init) are "
                    "replayed on the device (tp_sync._ReplayDraws)"
                )
            real = torch.empty(args[0].shape, dtype=args[0].dtype, device=self.device)
            func(real, *args[1:], **kwargs)
        return out


def serving_slot_map(model: FamilyModel, device: torch.device) -> SlotMap:
    """The slot map of the family's one-process serving layout, taken on a meta copy of
    ``model`` (no memory), with the global RNG advanced on ``device`` exactly as the layout on
    a real copy there advances it: the actor's LoRA init, drawn after the rollout is built,
    is then the one-process run's."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    meta = copy.deepcopy(model, memo)
    with _ReplayDraws(device):
        return model.family.serving_layout(meta)


@torch.no_grad()
def receipt_of_sharded(target: ShardedLoraTarget, version: int) -> SyncReceipt:
    """``sync/receipt.receipt_of`` for a sharded rollout: each rank reads its shards of the
    receipt rows from the weights its model uses now (looked up by name), the partial row
    prints are summed over the tp group in one all-reduce (a collective: every rank of the
    group calls it), and every rank returns the same receipt."""
    if target.verified is None:
        raise SyncError("no base row prints: the receipt cannot size the trained modules")
    picks = {n: receipt_rows(n, target.verified.rows[n].shape[0]) for n in target.expected}
    offsets, n_rows = {}, 0
    for name in target.expected:
        offsets[name], n_rows = n_rows, n_rows + len(picks[name][0])
    buf = torch.zeros(2, n_rows, PROBES, dtype=torch.float64)  # [partial print, its tol]
    error = None
    try:
        live = slot_weights(target.model, target.slot_map, target.expected)
        for name in target.expected:
            rows, _ = picks[name]
            out = target.verified.rows[name].shape[0]
            width = target.shards[target.slot_map.slots_for(name)[0].module].param.shape[1]
            for slab in target._slabs(name, out, width):
                hit = torch.isin(slab.src_rows, rows)
                if not hit.any():
                    continue
                w, base = _local(live[slab.module]), target.base[slab.module]
                at = slab.local_rows[hit]
                r = probe(name, width)
                r = (r if slab.cols is None else r[slab.cols]).to(w.device)
                eps = eps_of(w.dtype, torch.float32)
                got, tol = slot_prints(
                    w[at.to(w.device)], base[at.to(base.device)].to(w.device), r, eps
                )
                idx = offsets[name] + torch.searchsorted(rows, slab.src_rows[hit])
                buf[0].index_add_(0, idx, got.cpu() / slab.copies)
                buf[1].index_add_(0, idx, tol.cpu() / slab.copies)
    except Exception as e:  # any failure, so that every rank still reaches the all-reduce
        error = e
    (buf,) = target._reduce([buf], error, f"the sync receipt of v{version}")
    held, tol = {}, {}
    for name in target.expected:
        rows, u = picks[name]
        part = slice(offsets[name], offsets[name] + len(rows))
        held[name] = u @ buf[0, part]
        tol[name] = (u.square() @ buf[1, part].square()).sqrt()
    return SyncReceipt(version, held, tol)
