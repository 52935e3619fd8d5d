"""Contract 2 across ranks: LoRA sync into a TP-sharded rollout, exact on every rank or nowhere.

Parked: reached only from tests (``tests/parallel/test_tp_sync_gloo.py``); the parallel issue
(38) wires it into `diffrl train`.

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

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from diffrl.sync.weights import (  # the single-process sync's base copies and dtype bound
    SlotMap,
    SyncError,
    SyncReport,
    WeightUpdate,
    _copy,
    _rounding_bound,
    check_targets,
    slot_weights,
)

REL_TOL = 1e-4  # as MergedLoraTarget: fp32 rounding of W + delta is far inside it


@dataclass(frozen=True)
class TpSyncReport(SyncReport):
    rank: int  # this rank's index on the TP mesh
    written: int  # weight entries this rank wrote (its shards' share of every delta)
    max_global_checksum_err: float  # |sum over ranks - actor's checksum|, the same on every rank

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
    ):
        """``mesh`` is the 1-D TP mesh the plan was applied on; ``expected`` the trained module
        names (as in the model); ``base_device`` as for ``MergedLoraTarget``."""
        if mesh.ndim != 1:
            raise SyncError(f"ShardedLoraTarget takes the 1-D TP mesh; got {mesh}")
        self.model, self.mesh = model, mesh
        self.slot_map = slot_map or SlotMap()
        self.expected = sorted(expected)
        weights = slot_weights(model, self.slot_map, self.expected)
        self.shards = {m: self._shard_of(m, w) for m, w in weights.items()}
        self._check_disjoint()
        self.base = {k: _copy(_local(s.param), base_device) for k, s in self.shards.items()}

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

    def _check_disjoint(self) -> None:
        """No two trained modules write the same rows of one weight (each lands once)."""
        owner: dict[str, Tensor] = {}
        for name in self.expected:
            for slot in self.slot_map.slots_for(name):
                n_rows = self.shards[slot.module].param.shape[0]
                taken = owner.setdefault(slot.module, torch.zeros(n_rows, dtype=torch.bool))
                dst = torch.arange(n_rows)[slot.dst_rows]
                if taken[dst].any():
                    raise SyncError(
                        f"{name}: rows {slot.dst_rows} of {slot.module} are mapped twice"
                    )
                taken[dst] = True

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

    @torch.no_grad()
    def apply(self, update: WeightUpdate) -> TpSyncReport:
        """Write base + this rank's slice of every delta into its shards, after every rank has
        verified its part; raise ``SyncError`` on every rank otherwise."""
        n = len(self.expected)
        rank, size = self.mesh.get_local_rank(), self.mesh.size()
        # [failed flag per rank | per target: written sum / copies | per target: rounding bound]
        shared = torch.zeros(size + 2 * n, dtype=torch.float64, device=self.mesh.device_type)
        new: dict[str, Tensor] = {}
        max_err, written, error = 0.0, 0, None
        try:
            self._check_names(update)
            for i, name in enumerate(self.expected):
                err, count, total, rounding = self._apply_one(name, update, new)
                max_err, written = max(max_err, err), written + count
                shared[size + i], shared[size + n + i] = total, rounding
        except Exception as e:  # any failure, so that every rank still reaches the all-reduce
            error = e
            shared[rank] = 1.0
        # every rank reaches this, failed or not: no rank waits on one that gave up
        dist.all_reduce(shared, group=self.mesh.get_group())
        shared = shared.cpu()
        failed = [r for r in range(size) if shared[r] > 0]
        if error is not None:
            raise error  # this rank's own (a SyncError, or a bug as itself)
        if failed:
            raise SyncError(
                f"weight update v{update.version}: TP rank(s) {failed} failed verification; "
                f"rank {rank} verified its shards but commits nothing"
            )
        max_global = 0.0
        for i, name in enumerate(self.expected):
            total, rounding = float(shared[size + i]), float(shared[size + n + i])
            want = update.checksums[name]
            err, tol = abs(total - want), REL_TOL * max(1.0, abs(want)) + rounding
            if err > tol:  # the same numbers on every rank, so every rank raises
                raise SyncError(
                    f"{name}: the ranks' shards together hold {total:.6g} of its delta, the "
                    f"actor sent {want:.6g} (tolerance {tol:.3g}): rows held by no rank or by "
                    "two, or a corrupted update"
                )
            max_global = max(max_global, err)
        for module, w in new.items():  # commit only after every rank verified every target
            _local(self.shards[module].param).copy_(w)
        return TpSyncReport(
            update.version, update.adapter, n, n, max_err, rank, written, max_global
        )

    def _check_names(self, update: WeightUpdate) -> None:
        check_targets(update, self.expected)

    def _apply_one(
        self, name: str, update: WeightUpdate, new: dict[str, Tensor]
    ) -> tuple[float, int, float, float]:
        """Add this rank's slice of ``name``'s delta into ``new`` (local shards, from the base);
        return (local checksum error, entries written, written sum / copies, rounding bound)."""
        d = update.deltas[name]
        a, b = d.a.double(), d.b.double()  # (r, in), (out, r)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise SyncError(
                f"{name}: LoRA factors A {tuple(a.shape)}, B {tuple(b.shape)} do not chain"
            )
        err, count, total, rounding = 0.0, 0, 0.0, 0.0
        for slab in self._slabs(name, b.shape[0], a.shape[1]):
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
        return err, count, total, rounding


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
