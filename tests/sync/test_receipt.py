"""The sync receipt (diffrl/sync/receipt.py): after each sync the rollout reports what it holds,
and the sender checks it against what the actor sent. A rollout whose apply was skipped, did
nothing or was undone (left on its base weights) stops the run at that sync with SyncError."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from sync_faults import no_op_apply
from tiny_runs import tiny_run

from diffrl.build import build
from diffrl.config import load_config
from diffrl.controller.sync import train_sync
from diffrl.sync import layouts
from diffrl.sync.receipt import check_receipt, expected_of, receipt_of
from diffrl.sync.weights import (
    BasePrints,
    LoraDelta,
    MergedLoraTarget,
    SyncError,
    WeightUpdate,
)

RECIPE = "recipes/shapes_nft.yaml"
# a continuous reward, so that the random tiny model's groups are not all tied and update 1
# moves the adapter; the rollout is synced after every update
MOVING = ("algorithm.old_every=1", "reward.scorers=[{name: jpeg_incompressibility}]")
D = 32


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.to_q, self.attn.to_k, self.attn.to_v = (torch.nn.Linear(D, D) for _ in "qkv")
        self.up = torch.nn.Linear(D, 2 * D)


NAMES = ["attn.to_q", "attn.to_k", "attn.to_v", "up"]


def _update(version: int, model: torch.nn.Module, scale: float = 0.1) -> WeightUpdate:
    g = torch.Generator().manual_seed(version)
    deltas = {}
    for n in NAMES:
        out, cols = model.get_submodule(n).weight.shape
        a, b = torch.randn(4, cols, generator=g), torch.randn(out, 4, generator=g)
        deltas[n] = LoraDelta(a, b, scale)
    return WeightUpdate.build(version, "default", deltas, BasePrints.of_model(model, NAMES))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_receipt_sees_a_merge_and_a_rollout_left_on_base(dtype) -> None:
    torch.manual_seed(0)
    actor = Tiny()
    rollout = copy.deepcopy(actor).to(dtype)
    slot_map = layouts.merge(
        layouts.fuse_qkv(rollout, ["attn"]), layouts.split_swapped(rollout, ["up"], 2)
    )
    target = MergedLoraTarget(
        rollout, NAMES, slot_map, base_prints=BasePrints.of_model(actor, NAMES)
    )
    update = _update(1, actor)
    target.apply(update)
    want = expected_of(update)
    frac = check_receipt(1, want, receipt_of(target, 1))
    assert 0 <= frac < 1
    # a second "base" sync: the rollout's weights reloaded from its base after the merge
    with torch.no_grad():
        for module, w in target.weights.items():
            w.copy_(target.base[module])
    with pytest.raises(SyncError, match="attn.to_k holds .* still on its base weights"):
        check_receipt(1, want, receipt_of(target, 1))
    # merged again, then Q's and K's rows exchanged inside the fused weight
    target.apply(_update(2, actor))
    fused = rollout.attn.to_qkv.weight
    with torch.no_grad():
        fused[:D], fused[D : 2 * D] = fused[D : 2 * D].clone(), fused[:D].clone()
    with pytest.raises(SyncError, match="attn.to_k holds .* other weights than the actor sent"):
        check_receipt(2, expected_of(_update(2, actor)), receipt_of(target, 2))
    with pytest.raises(SyncError, match="reports weights v2 after update v3.*stale version"):
        check_receipt(3, want, receipt_of(target, 2))


@pytest.mark.parametrize("fault", ["apply", "load_weights"])
def test_a_rollout_that_does_not_apply_stops_the_run_at_its_first_sync(
    fault, tiny_checkpoint, tmp_path
) -> None:
    """The rollout's merge a no-op (version moves, weights do not), or its whole load skipped
    (neither moves): the run stops at the first sync that carries a change (update 1; the start
    sync's delta is zero, peft's B starts at zero), before step 2 samples with base weights."""
    over = tiny_run(tiny_checkpoint, tmp_path, 3, *MOVING)
    cfg = load_config(RECIPE, over)
    parts = build(cfg)
    rollout = parts.rollout
    if fault == "apply":
        rollout.target.apply = no_op_apply  # type: ignore[method-assign]
        match = "still on its base weights"
    else:
        rollout.load_weights = lambda update: no_op_apply(update)  # type: ignore[method-assign]
        match = "reports weights v0 after update v1.*stale version"
    trained = []
    train_step = parts.actor.train_step
    parts.actor.train_step = lambda batch: trained.append(1) or train_step(batch)

    async def run():
        try:
            await train_sync(cfg, parts)
        finally:
            await parts.aclose()

    with pytest.raises(SyncError, match=match):
        asyncio.run(run())
    assert len(trained) == 1  # stopped at the sync after update 1


def test_normal_run_reports_its_receipts(tiny_checkpoint, tmp_path) -> None:
    from diffrl.controller.run_dir import read_metrics

    cfg = load_config(RECIPE, tiny_run(tiny_checkpoint, tmp_path, 2, *MOVING))
    parts = build(cfg)

    async def run():
        try:
            return await train_sync(cfg, parts)
        finally:
            await parts.aclose()

    rows = read_metrics(asyncio.run(run()))
    assert rows[0]["lora/bound_modules"] == parts.bound.bound
    assert all(0 <= r["sync/receipt_frac"] < 1 for r in rows[1:])
