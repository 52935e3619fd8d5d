"""Contract 2: actor -> rollout weight sync is exact or fails, leaving the rollout unchanged."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from diffrl.build import expanded_targets
from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.sync.weights import (
    BasePrints,
    LoraDelta,
    MergedLoraTarget,
    Slot,
    SlotMap,
    SyncError,
    WeightUpdate,
)


@pytest.fixture
def pair(tiny_model, actor_factory, train_batch_factory, lora_names):
    """(base copy, rollout engine, actor trained one step, probe inputs)."""
    base = copy.deepcopy(tiny_model)
    rollout = RolloutEngine(
        tiny_model, RolloutConfig(), lora_names(tiny_model), torch.device("cpu")
    )
    actor = actor_factory(tiny_model, lr=2e-2)
    batch = train_batch_factory(4, seed=1)
    metrics = actor.train_step(batch)
    assert "actor/skipped_nonfinite" not in metrics and actor.version == 1
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 3, 32, 32, generator=g)
    probe = (x, torch.tensor([0.2, 0.5, 0.9]), batch.input_ids[:3])
    return base, rollout, actor, probe


def rollout_state(rollout: RolloutEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in rollout.model.state_dict().items()}


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_lora_delta_golden() -> None:
    d = LoraDelta(a=torch.tensor([[1.0, 2.0]]), b=torch.tensor([[3.0], [-1.0]]), scale=0.5)
    assert d.delta().tolist() == [[1.5, 3.0], [-0.5, -1.0]]
    up = WeightUpdate.build(4, "default", {"m": d})
    assert up.checksums == {"m": pytest.approx(3.0)}


def test_expanded_targets_match_the_tiny_dit(tiny_model, lora_names) -> None:
    expanded = expanded_targets(tiny_model, list(TINY_DIT_LORA_TARGETS))
    assert sorted(expanded) == lora_names(tiny_model)
    assert len(lora_names(tiny_model)) == 8


@torch.no_grad()
def test_sync_makes_rollout_match_actor(pair) -> None:
    base, rollout, actor, (x, sigma, ids) = pair
    v_base = base(x, sigma, ids)
    torch.testing.assert_close(rollout.model(x, sigma, ids), v_base)
    v_actor = actor.velocity(x, sigma, ids, adapter="default")
    assert (v_actor - v_base).abs().max() > 1e-4  # the step changed the policy
    report = rollout.load_weights(actor.export_weights("default"))
    assert report.version == 1 and rollout.version == 1
    assert report.applied == report.expected == 8
    assert report.max_checksum_err < 1e-4
    assert report.as_metrics()["sync/applied"] == 8
    torch.testing.assert_close(rollout.model(x, sigma, ids), v_actor, rtol=0, atol=1e-5)
    # the merged weight is exactly W_base + scale * B @ A of the actor
    name = "net.blocks.1.mlp.fc1"
    layer = actor.layers[name]
    delta = (
        layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    merged = rollout.model.get_submodule(name).weight
    torch.testing.assert_close(merged, base.get_submodule(name).weight + delta, rtol=0, atol=1e-6)


@torch.no_grad()
def test_old_adapter_sync(pair) -> None:
    base, rollout, actor, (x, sigma, ids) = pair
    # 'old' is still the initial adapter (B == 0): syncing it gives the base model
    rollout.load_weights(actor.export_weights("old"))
    torch.testing.assert_close(rollout.model(x, sigma, ids), base(x, sigma, ids), rtol=0, atol=1e-6)
    rollout.load_weights(actor.export_weights("default"))
    actor.update_old(decay=0.0)
    rollout.load_weights(actor.export_weights("old"))  # replaces (not adds to) the last delta
    torch.testing.assert_close(
        rollout.model(x, sigma, ids),
        actor.velocity(x, sigma, ids, adapter="old"),
        rtol=0,
        atol=1e-5,
    )


def _last(update: WeightUpdate) -> str:
    return sorted(update.deltas)[-1]  # applied last: earlier targets would already be written


@pytest.mark.parametrize("fault", ["missing", "extra", "shape", "checksum"])
def test_bad_update_raises_and_leaves_weights(pair, train_batch_factory, fault: str) -> None:
    _, rollout, actor, _ = pair
    rollout.load_weights(actor.export_weights("default"))  # a non-base state to protect
    actor.train_step(train_batch_factory(4, seed=2))
    good = actor.export_weights("default")
    deltas, sums = dict(good.deltas), dict(good.checksums)
    name = _last(good)
    if fault == "missing":
        del deltas[name]
        bad = WeightUpdate.build(good.version, "default", deltas)
        match = "missing"
    elif fault == "extra":
        deltas["net.blocks.9.attn.qkv"] = deltas[name]
        bad = WeightUpdate.build(good.version, "default", deltas)
        match = "unexpected"
    elif fault == "shape":
        d = deltas[name]
        deltas[name] = LoraDelta(a=d.a, b=torch.cat([d.b, d.b[:1]]), scale=d.scale)
        bad = WeightUpdate.build(good.version, "default", deltas)
        match = "do not fit"
    else:
        sums[name] += 0.5
        bad = dataclasses.replace(good, checksums=sums)
        match = "checksum"
    before, version = rollout_state(rollout), rollout.version
    with pytest.raises(SyncError, match=match):
        rollout.load_weights(bad)
    assert_state_equal(rollout_state(rollout), before)
    assert rollout.version == version
    rollout.load_weights(good)  # the good update still applies afterwards
    assert rollout.version == good.version


def test_stale_version_raises(pair) -> None:
    _, rollout, actor, _ = pair
    rollout.load_weights(actor.export_weights("default"))  # v1
    stale = dataclasses.replace(actor.export_weights("default"), version=0)
    before = rollout_state(rollout)
    with pytest.raises(SyncError, match="stale"):
        rollout.load_weights(stale)
    assert_state_equal(rollout_state(rollout), before)


def test_missing_rollout_slot_fails_at_construction(tiny_model) -> None:
    with pytest.raises(SyncError, match="no weight slot"):
        MergedLoraTarget(tiny_model, ["net.blocks.0.attn.nope"])
    with pytest.raises(SyncError, match="net.blocks.0.attn.q"):
        MergedLoraTarget(
            tiny_model,
            ["net.blocks.0.attn.qkv"],
            SlotMap({"net.blocks.0.attn.qkv": [Slot("net.blocks.0.attn.q")]}),
        )


# --- slot maps: fused <-> split layouts ------------------------------------------------------

D, R = 6, 2


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)


class Split(nn.Module):
    def __init__(self, fused: Fused) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(fused.qkv.weight[i * D : (i + 1) * D])
                lin.bias.copy_(fused.qkv.bias[i * D : (i + 1) * D])

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def _delta(seed: int, out: int = 3 * D) -> LoraDelta:
    g = torch.Generator().manual_seed(seed)
    return LoraDelta(
        a=torch.randn(R, D, generator=g), b=torch.randn(out, R, generator=g), scale=0.5
    )


def fused_prints(fused: nn.Module) -> BasePrints:
    """The trained (fused) module's base prints, as the actor would send them."""
    return BasePrints.of({"qkv": fused.qkv.weight})


def test_slot_map_splits_fused_qkv_rows() -> None:
    torch.manual_seed(0)
    fused = Fused()
    split = Split(fused)
    base = {n: split.get_submodule(n).weight.detach().clone() for n in "qkv"}
    slot_map = SlotMap(
        {
            "qkv": [
                Slot("q", rows=slice(0, D)),
                Slot("k", rows=slice(D, 2 * D)),
                Slot("v", rows=slice(2 * D, 3 * D)),
            ]
        }
    )
    target = MergedLoraTarget(split, ["qkv"], slot_map, base_prints=fused_prints(fused))
    d = _delta(1)
    report = target.apply(WeightUpdate.build(1, "default", {"qkv": d}))
    assert report.applied == 1 and report.max_checksum_err < 1e-4
    full = d.scale * d.b @ d.a  # (3D, D)
    for i, n in enumerate("qkv"):
        torch.testing.assert_close(
            split.get_submodule(n).weight, base[n] + full[i * D : (i + 1) * D], rtol=0, atol=1e-6
        )
    # the split module now computes what the fused one would with W + delta
    x = torch.randn(5, D)
    expected = x @ (fused.qkv.weight + full).T + fused.qkv.bias
    torch.testing.assert_close(split(x), expected, rtol=1e-5, atol=1e-5)
    # a second update replaces the first (deltas are applied to the frozen base)
    d2 = _delta(2)
    target.apply(WeightUpdate.build(2, "default", {"qkv": d2}))
    full2 = d2.scale * d2.b @ d2.a
    torch.testing.assert_close(split.k.weight, base["k"] + full2[D : 2 * D], rtol=0, atol=1e-6)


def test_slot_map_fuses_split_deltas_with_dst_rows() -> None:
    torch.manual_seed(0)
    fused = Fused()
    base = fused.qkv.weight.detach().clone()
    slot_map = SlotMap(
        {n: [Slot("qkv", dst_rows=slice(i * D, (i + 1) * D))] for i, n in enumerate("qkv")}
    )
    rows = {n: fused.qkv.weight[i * D : (i + 1) * D] for i, n in enumerate("qkv")}
    target = MergedLoraTarget(fused, ["q", "k", "v"], slot_map, base_prints=BasePrints.of(rows))
    deltas = {n: _delta(10 + i, out=D) for i, n in enumerate("qkv")}
    target.apply(WeightUpdate.build(1, "default", deltas))
    expected = base + torch.cat([deltas[n].scale * deltas[n].b @ deltas[n].a for n in "qkv"])
    torch.testing.assert_close(fused.qkv.weight, expected, rtol=0, atol=1e-6)


def test_slot_rows_that_do_not_fit_raise_and_leave_weights() -> None:
    fused = Fused()
    split = Split(fused)
    before = {k: v.clone() for k, v in split.state_dict().items()}
    slot_map = SlotMap(
        {
            "qkv": [
                Slot("q", rows=slice(0, D)),
                Slot("k", rows=slice(D, 2 * D)),
                Slot("v", rows=slice(2 * D, 3 * D - 1)),
            ]
        }
    )  # one row short
    with pytest.raises(SyncError, match="do not fit|cover"):
        MergedLoraTarget(split, ["qkv"], slot_map, base_prints=fused_prints(fused))
    assert_state_equal({k: v.clone() for k, v in split.state_dict().items()}, before)
