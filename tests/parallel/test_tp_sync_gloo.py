"""Contract 2 across ranks (``parallel/tp_sync.py``): a LoRA update synced into a TP-sharded
rollout lands, on every rank, exactly as the same update merged into an unsharded copy, and a
bad update raises ``SyncError`` on every rank and changes nothing.

Each test spawns 2 ranks over gloo (``spawn``, a free TCP port on 127.0.0.1). Every rank builds
the same random model from ``torch.manual_seed(0)`` and the same random LoRA updates, keeps an
unsharded reference, shards the model with a TP plan, syncs, and writes what it measured to
``tmp_path``; the parent asserts on every rank's record.

- SD3.5's tiny DiT under ``sd3.TP_PLAN`` (to_q/k/v, add_*_proj, ff.net.0.proj column-sharded:
  ``Shard(0)``; to_out.0, to_add_out, ff.net.2 row-sharded: ``Shard(1)``), the family's own
  ``LORA_TARGETS``.
- A fused QKV (``layouts.fuse_qkv``'s SlotMap) held by ``FusedColwiseParallel(3)``
  (``_StridedShard``: each rank holds its slice of each of q, k and v).

Both take the base row prints before the plan (the actor's view), as the actor's updates
carry them. Beyond counts and shapes, a sync must refuse on every rank: a slot map with Q and K
swapped (base prints), two rows swapped in transit in a column-split weight (only the row
prints summed across ranks see it: each rank agrees with the factors it got), and factors
downcast in transit.

Tolerances, fp32: shards vs the reference slice atol 1e-6 (|W + delta| ~ 0.3; the delta is
formed in float64 on both sides and rounded to fp32 once: seen 0.0); sharded
vs merged unsharded forward atol 1e-5 (the sharded matmuls reorder sums, as in
test_tp_gloo.py). The delta moves the forward by > 1e-2, so the forward check cannot pass with
the delta missing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import finish_rank, free_port, init_gloo, run_ranks
from sync_faults import sync_error_of
from torch import nn

from diffrl.sync.weights import BasePrints, LoraDelta, Slot, SlotMap, WeightUpdate

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

WORLD = 2
SHARD_ATOL = 1e-6
FWD_ATOL = 1e-5
DIT_STD = 0.1  # as test_tp_gloo.py: the presets' 0.02 leaves a tiny DiT's blocks nearly silent
RANK = 4
DEADLINE_S = 40.0  # a hang (a rank stuck in a collective) fails here


def _spawn(fn, *args) -> None:
    """Run ``fn(rank, port, *args)`` in WORLD fresh processes; re-raise a rank's failure."""
    run_ranks(fn, WORLD, (free_port(), *args), DEADLINE_S)


def _mesh(rank: int, port: int):
    from torch.distributed.device_mesh import DeviceMesh

    init_gloo(rank, WORLD, port, DEADLINE_S)
    return DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("tp",))


def _read(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


# --- shared pieces -----------------------------------------------------------------------------


def _update(
    version: int, shapes: dict[str, tuple[int, int]], seed: int, base: BasePrints | None = None
) -> WeightUpdate:
    """A random LoRA update (rank RANK, scale 2) for modules of the given (out, in) shapes,
    carrying the actor's ``base`` row prints when given."""
    g = torch.Generator().manual_seed(seed)
    deltas = {
        name: LoraDelta(
            a=0.1 * torch.randn(RANK, cols, generator=g),
            b=0.1 * torch.randn(out, RANK, generator=g),
            scale=2.0,
        )
        for name, (out, cols) in sorted(shapes.items())
    }
    return WeightUpdate.build(version, "default", deltas, base)


def _merged(base: dict[str, torch.Tensor], update: WeightUpdate) -> dict[str, torch.Tensor]:
    """name -> full W_base + delta, unsharded (the reference)."""
    return {name: base[name] + d.delta() for name, d in update.deltas.items()}


def _expected_local(full: torch.Tensor, weight, rank: int) -> torch.Tensor:
    """This rank's slice of the full (out, in) weight, from the placement, written out by hand
    (not through tp_sync's index code): rows for Shard(0), columns for Shard(1), every chunk's
    rows for a _StridedShard."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(weight, DTensor):
        return full
    (p,) = weight.placements
    if isinstance(p, _StridedShard):
        chunks = full.chunk(p.split_factor, dim=p.dim)
        return torch.cat([c.chunk(WORLD, dim=p.dim)[rank] for c in chunks], dim=p.dim)
    assert isinstance(p, Shard), p
    return full.chunk(WORLD, dim=p.dim)[rank]


def _shard_diff(model: nn.Module, want: dict[str, torch.Tensor], rank: int) -> float:
    """max |local shard - this rank's slice of the reference| over the weights in ``want``."""
    from torch.distributed.tensor import DTensor

    diff = 0.0
    for name, full in want.items():
        w = model.get_submodule(name).weight
        local = w.to_local() if isinstance(w, DTensor) else w
        diff = max(diff, (local - _expected_local(full, w, rank)).abs().max().item())
    return diff


def _local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).clone()
        for k, v in model.state_dict().items()
    }


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in _local_state(model).items())


def _bad_updates(good: WeightUpdate, rank: int, corrupt: str) -> dict[str, WeightUpdate]:
    """Updates a sync must refuse, on every rank; ``corrupt`` names the module whose delta
    gets two rows swapped in transit (its sum, and the slice each rank checks through the
    factors it received, unchanged: only the row prints see it)."""
    names = sorted(good.deltas)
    hit = good.deltas[corrupt]
    swapped_rows = hit.b.clone()
    swapped_rows[[0, 1]] = swapped_rows[[1, 0]]
    half = {n: LoraDelta(d.a.bfloat16(), d.b.bfloat16(), d.scale) for n, d in good.deltas.items()}
    first = good.deltas[names[0]]
    missing = {n: d for n, d in good.deltas.items() if n != names[-1]}
    wide = LoraDelta(a=torch.cat([first.a, first.a], dim=1), b=first.b, scale=first.scale)
    tall = LoraDelta(a=first.a, b=torch.cat([first.b, first.b[:1]]), scale=first.scale)
    # only rank 1 gets a broken delta: rank 0 verifies its shards and must still refuse
    one_rank = {**good.deltas, names[0]: tall} if rank == 1 else good.deltas
    return dict(
        missing=WeightUpdate.build(good.version + 1, "default", missing),
        wide=WeightUpdate.build(good.version + 1, "default", {**good.deltas, names[0]: wide}),
        tall=WeightUpdate.build(good.version + 1, "default", {**good.deltas, names[0]: tall}),
        one_rank=WeightUpdate.build(good.version + 1, "default", one_rank),
        # the actor's checksum disagrees with what the ranks hold together
        checksum=dataclasses.replace(
            good,
            version=good.version + 1,
            checksums={**good.checksums, names[0]: good.checksums[names[0]] + 1.0},
        ),
        row=dataclasses.replace(
            good,
            version=good.version + 1,
            deltas={**good.deltas, corrupt: LoraDelta(hit.a, swapped_rows, hit.scale)},
        ),
        # exported in fp32, arrived in bf16
        downcast=dataclasses.replace(good, version=good.version + 1, deltas=half),
    )


def _refusals(target, model: nn.Module, good: WeightUpdate, rank: int, corrupt: str) -> dict:
    before = _local_state(model)
    bad = _bad_updates(good, rank, corrupt)
    errors = {k: sync_error_of(lambda u=u: target.apply(u)) for k, u in bad.items()}
    return dict(errors=errors, unchanged=_unchanged(model, before))


def _assert_refused(r: dict) -> None:
    e = r["refused"]["errors"]
    assert all(e.values()), e  # no rank silently succeeds on any of them
    assert "missing [" in e["missing"]
    assert "input columns" in e["wide"]
    assert "each must land exactly once" in e["tall"] or "do not fit" in e["tall"]
    if r["rank"] == 0:  # rank 0's own update was fine
        assert "TP rank(s) [1] failed verification" in e["one_rank"], e["one_rank"]
    else:
        assert "each must land exactly once" in e["one_rank"] or "do not fit" in e["one_rank"]
    assert "the actor sent" in e["checksum"]
    assert "converted in transit" in e["downcast"]
    assert r["corrupt"] in e["row"] and "row print of trained row" in e["row"], e["row"]
    assert r["refused"]["unchanged"]  # nothing was committed on any rank


def _held_twice(model: nn.Module, mesh, names: list[str], up: WeightUpdate) -> dict:
    """A target whose index arithmetic is broken (every rank believes it holds rank 0's rows
    and columns): each rank agrees with itself, so only the check across ranks can fail it."""
    from diffrl.parallel import tp_sync

    def rank0_rows(weight, dim):
        held = real(weight, dim)
        return None if held is None else torch.arange(weight.shape[dim])[: len(held)]

    real, before = tp_sync._held, _local_state(model)
    tp_sync._held = rank0_rows
    try:
        target = tp_sync.ShardedLoraTarget(model, mesh, names)
    finally:
        tp_sync._held = real
    return dict(error=sync_error_of(lambda: target.apply(up)), unchanged=_unchanged(model, before))


# --- SD3.5's tiny DiT under the family's TP plan -------------------------------------------


def _sd3_rank(rank: int, port: int, out: Path) -> None:
    from diffusers import SD3Transformer2DModel
    from torch.distributed.tensor import DTensor

    from diffrl.models.families import sd3
    from diffrl.models.families._diffusers import init_weights, random_component
    from diffrl.parallel import tp
    from diffrl.parallel.tp_sync import ShardedLoraTarget

    mesh = _mesh(rank, port)
    torch.manual_seed(0)
    cfg = sd3.PRESETS["sd35-tiny"]["transformer"]
    dit = random_component(SD3Transformer2DModel, cfg, torch.float32, torch.device("cpu"))
    init_weights(dit, std=DIT_STD)
    names = [
        n
        for n, m in dit.named_modules()
        if isinstance(m, nn.Linear) and any(n.endswith("." + t) for t in sd3.LORA_TARGETS)
    ]
    base = {n: dit.get_submodule(n).weight.detach().clone() for n in names}
    shapes = {n: tuple(w.shape) for n, w in base.items()}
    ref = copy.deepcopy(dit)  # unsharded; merged by hand below

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, 8, generator=g)  # (B, C, H, W) latents
    txt = torch.randn(2, 12, 48, generator=g)  # (B, L, joint_attention_dim)
    pooled = torch.randn(2, 40, generator=g)  # (B, pooled_projection_dim)
    t = torch.tensor([250.0, 900.0])

    def fwd(m):
        with torch.no_grad():
            return m(x, txt, pooled, t, return_dict=False)[0]

    y_base = fwd(ref)
    prints = BasePrints.of_model(dit, names)  # the actor's view: whole weights, before the plan
    tp.apply_plan(dit, mesh, sd3.TP_PLAN)
    t0 = time.perf_counter()
    target = ShardedLoraTarget(dit, mesh, names, base_prints=prints)
    t_build = time.perf_counter() - t0
    # a row-sharded (Shard(1)) target: each rank holds a part of every row
    corrupt = next(n for n in names if dit.get_submodule(n).weight.placements[0].dim == 1)

    result: dict = dict(rank=rank, n_targets=len(names))
    result["placements"] = sorted({str(dit.get_submodule(n).weight.placements) for n in names})
    assert all(isinstance(dit.get_submodule(n).weight, DTensor) for n in names)
    for version, seed in ((1, 11), (2, 12)):
        up = _update(version, shapes, seed, prints)
        t0 = time.perf_counter()
        report = target.apply(up)
        sync_s = time.perf_counter() - t0
        want = _merged(base, up)
        with torch.no_grad():
            for n, w in want.items():
                ref.get_submodule(n).weight.copy_(w)
        y_ref, y = fwd(ref), fwd(dit)
        result[f"v{version}"] = dict(
            shard_diff=_shard_diff(dit, want, rank),
            fwd_diff=(y - y_ref).abs().max().item(),
            fwd_effect=(y_ref - y_base).abs().max().item(),
            applied=report.applied,
            expected=report.expected,
            written=report.written,
            max_checksum_err=report.max_checksum_err,
            max_global_checksum_err=report.max_global_checksum_err,
            report_rank=report.rank,
            sync_s=sync_s,
        )
    # v2 replaced v1: the shards are base + delta2, not base + delta1 + delta2
    both = {n: w + _update(1, shapes, 11).deltas[n].delta() for n, w in _merged(base, up).items()}
    result["v2_vs_accumulated"] = _shard_diff(dit, both, rank)
    result["corrupt"] = corrupt
    result["refused"] = _refusals(target, dit, up, rank, corrupt)
    result["build_s"] = t_build
    # without base prints, so that only the sums across ranks can see it
    result["held_twice"] = _held_twice(dit, mesh, names, dataclasses.replace(up, base=None))
    finish_rank(out, rank, result)


def test_sd3_tp_sync_lands_each_ranks_slice_and_refuses_bad_updates(tmp_path):
    t0 = time.monotonic()
    _spawn(_sd3_rank, tmp_path)
    elapsed = time.monotonic() - t0
    records = _read(tmp_path)
    full_entries = 0
    for r in records:
        assert r["n_targets"] == 19  # 8 attention + 2 MLP in block 0; the last has no to_add_out
        # both column (Shard(0)) and row (Shard(1)) sharded targets are covered
        assert r["placements"] == ["(Shard(dim=0),)", "(Shard(dim=1),)"], r["placements"]
        for v in ("v1", "v2"):
            s = r[v]
            assert s["shard_diff"] <= SHARD_ATOL, s
            assert s["fwd_diff"] <= FWD_ATOL, s
            assert s["fwd_effect"] > 1e-2, s  # the delta matters to the forward
            assert s["applied"] == s["expected"] == 19 and s["report_rank"] == r["rank"]
            assert s["max_checksum_err"] < 1e-4 and s["max_global_checksum_err"] < 1e-4
        assert r["v2_vs_accumulated"] > 1e-2  # not base + delta1 + delta2
        full_entries += r["v1"]["written"]
        _assert_refused(r)
        assert "rows held by no rank or by two" in r["held_twice"]["error"], r["held_twice"]
        assert r["held_twice"]["unchanged"]
    # every entry of every delta was written once in all: no rank wrote all of one
    assert records[0]["v1"]["written"] == records[1]["v1"]["written"] == full_entries // 2
    assert elapsed < DEADLINE_S


# --- a fused QKV held strided over the ranks -------------------------------------------------


class _Attn(nn.Module):
    """Stands in for an attention whose serving layout fused q, k and v: after
    ``fuse_qkv(native=True)`` it computes with ``to_qkv`` and splits it in three."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)  # left out of the plan: a replicated plain weight
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.to_out = nn.Linear(inner, dim)
        self.fused_projections = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, dim)
        x = self.proj_in(x)
        if self.fused_projections:
            q, k, v = self.to_qkv(x).chunk(3, dim=-1)  # each (B, S, inner / tp)
        else:
            q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        return self.to_out(q * torch.sigmoid(k) + v)  # elementwise per channel: shardable


def _fused_rank(rank: int, port: int, out: Path) -> None:
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from diffrl.parallel import tp
    from diffrl.parallel.tp_sync import ShardedLoraTarget
    from diffrl.sync import layouts

    mesh = _mesh(rank, port)
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", _Attn(dim=12, inner=16))
    names = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out", "attn.proj_in"]
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in names}
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))  # (B, S, dim)

    prints = BasePrints.of_model(model, names)  # the actor's view, before the serving layout
    slot_map = layouts.fuse_qkv(model, ["attn"], native=True)  # q, k, v -> rows of attn.to_qkv
    ref = copy.deepcopy(model)  # fused, unsharded
    base = {
        n: model.get_submodule(n).weight.detach().clone()
        for n in ("attn.to_qkv", "attn.to_out", "attn.proj_in")
    }
    parallelize_module(model.attn.to_qkv, mesh, tp.FusedColwiseParallel(chunks=3))
    parallelize_module(model.attn.to_out, mesh, RowwiseParallel())
    twice = SlotMap({**slot_map.slots, "attn.to_k": slot_map.slots["attn.to_q"]})
    result: dict = dict(
        rank=rank, twice=sync_error_of(lambda: ShardedLoraTarget(model, mesh, names, twice))
    )
    # K's rows sent where Q's are and back: every shape fits, only the base prints see it
    swapped = SlotMap(
        {
            **slot_map.slots,
            "attn.to_q": [Slot("attn.to_qkv", dst_rows=slice(16, 32))],
            "attn.to_k": [Slot("attn.to_qkv", dst_rows=slice(0, 16))],
        }
    )
    result["swapped"] = sync_error_of(
        lambda: ShardedLoraTarget(model, mesh, names, swapped, base_prints=prints)
    )
    target = ShardedLoraTarget(model, mesh, names, slot_map, base_prints=prints)

    for version, seed in ((1, 21), (2, 22)):
        up = _update(version, shapes, seed, prints)
        report = target.apply(up)
        qkv = torch.cat([up.deltas[n].delta() for n in names[:3]])  # (3 inner, dim), Q first
        want = {
            "attn.to_qkv": base["attn.to_qkv"] + qkv,
            "attn.to_out": base["attn.to_out"] + up.deltas["attn.to_out"].delta(),
            "attn.proj_in": base["attn.proj_in"] + up.deltas["attn.proj_in"].delta(),
        }
        with torch.no_grad():
            for n, w in want.items():
                ref.get_submodule(n).weight.copy_(w)
            y_ref, y = ref(x), model(x)
        result[f"v{version}"] = dict(
            shard_diff=_shard_diff(model, want, rank),
            fwd_diff=(y - y_ref).abs().max().item(),
            applied=report.applied,
            placements=str(model.attn.to_qkv.weight.placements),
            local_qkv=list(model.attn.to_qkv.weight.to_local().shape),
            global_err=report.max_global_checksum_err,
        )
    result["corrupt"] = "attn.to_out"  # row-sharded: each rank holds half of every row
    result["refused"] = _refusals(target, model, up, rank, "attn.to_out")
    finish_rank(out, rank, result)


def test_fused_qkv_strided_shards_get_their_slice_of_each_of_q_k_v(tmp_path):
    t0 = time.monotonic()
    _spawn(_fused_rank, tmp_path)
    for r in _read(tmp_path):
        for v in ("v1", "v2"):
            s = r[v]
            assert s["shard_diff"] <= SHARD_ATOL and s["fwd_diff"] <= FWD_ATOL, s
            assert s["applied"] == 5 and s["global_err"] < 1e-4
            assert "_StridedShard" in s["placements"] or "_S(" in s["placements"], s
            assert s["local_qkv"] == [24, 12]  # 8 rows of each of q, k, v per rank
        _assert_refused(r)
        assert "are mapped twice" in r["twice"]  # to_k sent onto to_q's rows
        assert "base of attn.to_k -> attn.to_qkv" in r["swapped"], r["swapped"]
    assert time.monotonic() - t0 < DEADLINE_S
