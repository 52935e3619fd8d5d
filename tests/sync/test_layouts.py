"""Serving layouts (contract 2): a LoRA update trained on the unfused model lands exactly in the
rollout copy's fused QKV and swapped TP shards, and anything unmappable fails before training."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

from diffrl.models.families import sd3  # noqa: E402
from diffrl.models.families._diffusers import init_weights  # noqa: E402
from diffrl.models.registry import ModelConfig  # noqa: E402
from diffrl.sync import layouts  # noqa: E402
from diffrl.sync.weights import (  # noqa: E402
    BasePrints,
    LoraDelta,
    MergedLoraTarget,
    Slot,
    SlotMap,
    SyncError,
    WeightUpdate,
)

BF16_REL_TOL = 2e-2  # bf16 has 8 mantissa bits: merged W + delta rounds where LoRA's x@A@B does not


def lora_actor(base, seed: int = 0):
    """The actor's view: peft LoRA on a copy of ``base``, with random nonzero B."""
    actor = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=list(sd3.LORA_TARGETS))
    )
    g = torch.Generator().manual_seed(seed)
    layers = {
        n.removeprefix("base_model.model."): m
        for n, m in actor.named_modules()
        if isinstance(m, LoraLayer)
    }
    with torch.no_grad():
        for layer in layers.values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.05)
    return actor, layers


def export(layers, version: int = 1) -> WeightUpdate:
    """As ActorEngine.export_weights does it."""
    deltas = {
        name: LoraDelta(
            a=layer.lora_A["default"].weight.detach().float().cpu().clone(),
            b=layer.lora_B["default"].weight.detach().float().cpu().clone(),
            scale=float(layer.scaling["default"]),
        )
        for name, layer in layers.items()
    }
    prints = BasePrints.of({n: layer.get_base_layer().weight for n, layer in layers.items()})
    return WeightUpdate.build(version, "default", deltas, prints)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model = sd3.load(ModelConfig(family="sd3", preset="sd35-tiny"), torch.device("cpu"))
    # at the presets' std 0.02 the AdaLN gates are tiny and the blocks barely move the output;
    # a larger init makes the LoRA update (and any sync error) visible
    init_weights(model.net.transformer, std=0.2)
    return model


def inputs(model, b: int = 2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn((b, *model.family.latent_shape()), generator=g)
    ids = model.family.tokenize(["a red circle on the left", "two blue squares"][:b]).input_ids
    return x, torch.tensor([0.3, 0.8][:b]), ids


def synced_pair(base, dtype: torch.dtype):
    actor, layers = lora_actor(base)
    rollout = copy.deepcopy(base)
    slot_map = rollout.family.serving_layout(rollout)
    layouts.check_targets(rollout, slot_map, layers)
    MergedLoraTarget(rollout, list(layers), slot_map).apply(export(layers))
    return actor.to(dtype), rollout.to(dtype), slot_map


def test_layout_keeps_forward(base):
    rollout = copy.deepcopy(base)
    slot_map = base.family.serving_layout(rollout)
    x, s, ids = inputs(base)
    with torch.no_grad():
        assert torch.equal(rollout(x, s, ids), base(x, s, ids))
    names = dict(rollout.named_modules())
    assert "net.transformer.transformer_blocks.0.attn.to_qkv" in names
    assert "net.transformer.transformer_blocks.0.attn.to_added_qkv" in names
    q = "net.transformer.transformer_blocks.0.attn.to_q"
    assert slot_map.slots_for(q)[0].module.endswith("attn.to_qkv")
    # shard 0 stores the logical second half of the up-projection (swapped order)
    up = "net.transformer.transformer_blocks.0.ff.net.0.proj"
    w = dict(base.named_modules())[up].weight
    assert torch.equal(names[f"{up}.shards.0"].weight, w[w.shape[0] // 2 :])


def test_sync_exact_fp32(base):
    actor, rollout, slot_map = synced_pair(base, torch.float32)
    assert any(len(s) == 2 for s in slot_map.slots.values())  # the split up-projections
    x, s, ids = inputs(base)
    with torch.no_grad():
        want, got = actor(x, s, ids), rollout(x, s, ids)
        assert (base(x, s, ids) - want).abs().max() > 0.1  # the update does matter
    assert torch.allclose(got, want, atol=1e-5)


def test_sync_bf16_within_tolerance(base):
    actor, rollout, _ = synced_pair(base, torch.bfloat16)
    x, s, ids = inputs(base)
    with torch.no_grad():
        want = actor(x.bfloat16(), s, ids).float()
        got = rollout(x.bfloat16(), s, ids).float()
    rel = (got - want).norm() / want.norm()
    assert rel < BF16_REL_TOL, f"bf16 relative error {rel:.3g}"


def test_unmappable_target_fails_before_training(base):
    rollout = copy.deepcopy(base)
    slot_map = base.family.serving_layout(rollout)
    q = "net.transformer.transformer_blocks.0.attn.to_q"
    unmapped = SlotMap({k: v for k, v in slot_map.slots.items() if k != q})
    with pytest.raises(SyncError, match="to_q"):  # the RowView left there holds no weight
        layouts.check_targets(rollout, unmapped, [q])
    with pytest.raises(SyncError, match="no weight slot"):
        MergedLoraTarget(rollout, [q], unmapped)
    bad = SlotMap({q: [Slot("net.transformer.transformer_blocks.0.attn.to_qkv_missing")]})
    with pytest.raises(SyncError):
        layouts.check_targets(rollout, bad, [q])
    # rows that do not cover the trained module
    short = SlotMap({q: [Slot(slot_map.slots[q][0].module, slice(0, 8), slice(0, 8))]})
    with pytest.raises(SyncError, match="cover"):
        layouts.check_targets(rollout, short, [q], shapes={q: (32, 32)})
    with pytest.raises(SyncError, match="twice"):
        layouts.merge(slot_map, SlotMap({q: slot_map.slots[q]}))


def test_wrong_shape_delta_raises(base):
    actor, layers = lora_actor(base)
    rollout = copy.deepcopy(base)
    target = MergedLoraTarget(rollout, list(layers), base.family.serving_layout(rollout))
    update = export(layers)
    q = "net.transformer.transformer_blocks.0.attn.to_q"
    d = update.deltas[q]
    deltas = {**update.deltas, q: LoraDelta(d.a, torch.cat([d.b, d.b]), d.scale)}
    with pytest.raises(SyncError, match="do not fit"):
        target.apply(WeightUpdate.build(2, "default", deltas, update.base))
    # nothing was written: a failed update leaves the base weights in place
    x, s, ids = inputs(base)
    with torch.no_grad():
        assert torch.equal(rollout(x, s, ids), base(x, s, ids))
