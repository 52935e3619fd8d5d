"""Contract 2 sees order: a sync into a serving layout whose slot map puts rows in the wrong
place, or an update that changed on the way, raises ``SyncError`` naming the module.

A summed checksum passes a slot map with two shards swapped, or Q and K swapped inside a fused
QKV, and reading the delta back through the same slot map inverts the same mistake. Row prints
(W @ r_name, r_name fixed per trained module) of the frozen base, taken before the layout, are
the anchor that does not go through the slot map; row prints of the delta catch what changed in
transit. Each fault below is built so that every shape still fits.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from sync_faults import TINY_FAMILY_PRESETS, family_faults
from torch import nn

from diffrl.sync import layouts
from diffrl.sync.weights import (
    BasePrints,
    LoraDelta,
    MergedLoraTarget,
    SlotMap,
    SyncError,
    WeightUpdate,
    probe,
    row_prints,
)

D, R = 8, 2
NAMES = ["attn.to_q", "attn.to_k", "attn.to_v", "up", "down"]


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_q(x) * torch.sigmoid(self.to_k(x)) + self.to_v(x)


class Tiny(nn.Module):
    """Attention then an MLP; every trained Linear is square (D x D)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.up, self.down = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.attn(x))))


# the layout under test, and the module whose rows it moves
LAYOUTS = {"fused_qkv": "attn.to_q", "swapped_shards": "up"}


def lay_out(model: nn.Module, layout: str) -> SlotMap:
    if layout == "fused_qkv":
        return layouts.fuse_qkv(model, ["attn"])
    return layouts.split_swapped(model, ["up"], n_shards=2)


def wrong_slots(slot_map: SlotMap, layout: str) -> SlotMap:
    """The same slots with two of them exchanged: Q's rows sent to K's place and back, or the
    two shards of ``up`` exchanged. Every shape still fits."""
    slots = dict(slot_map.slots)
    if layout == "fused_qkv":
        slots["attn.to_q"], slots["attn.to_k"] = slots["attn.to_k"], slots["attn.to_q"]
    else:
        s0, s1 = slots["up"]
        slots["up"] = [dataclasses.replace(s0, rows=s1.rows), dataclasses.replace(s1, rows=s0.rows)]
    return SlotMap(slots)


def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def update(base: nn.Module, version: int = 1, seed: int = 1) -> WeightUpdate:
    """As ActorEngine.export_weights: fp32 factors and the base's row prints."""
    g = torch.Generator().manual_seed(seed)
    deltas = {
        n: LoraDelta(
            a=torch.randn(R, D, generator=g) * 0.3,
            b=torch.randn(D, R, generator=g) * 0.3,
            scale=2.0,
        )
        for n in NAMES
    }
    prints = BasePrints.of({n: base.get_submodule(n).weight for n in NAMES})
    return WeightUpdate.build(version, "default", deltas, prints)


def rollout_copy(base: nn.Module, layout: str, dtype: torch.dtype):
    """(rollout copy in ``dtype`` laid out for serving, its slot map, its own base prints)."""
    rollout = copy.deepcopy(base).to(dtype)
    prints = BasePrints.of_model(rollout, NAMES)
    return rollout, lay_out(rollout, layout), prints


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def unchanged(m: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_probe_is_fixed_per_name_and_global_rng_free() -> None:
    torch.manual_seed(123)
    a = probe("net.blocks.0.attn.qkv", 16).clone()
    state_after = torch.get_rng_state()
    probe.cache_clear()
    torch.manual_seed(7)
    assert torch.equal(probe("net.blocks.0.attn.qkv", 16), a)  # seeded by the name only
    assert not torch.equal(probe("net.blocks.0.attn.proj", 16), a)
    torch.manual_seed(123)
    probe.cache_clear()
    probe("x", 16)
    assert torch.equal(torch.get_rng_state(), state_after)  # the global RNG is untouched


def test_row_prints_see_any_permutation() -> None:
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    p = row_prints(w, "m")
    assert not torch.allclose(row_prints(w[[1, 0, 2, 3, 4, 5]], "m"), p)  # rows
    assert not torch.allclose(row_prints(w[:, [1, 0, 2, 3, 4]], "m"), p)  # columns
    assert not torch.allclose(row_prints(w, "n"), p)  # another module's probe
    assert torch.equal(row_prints(w, "m"), p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_correct_layout_syncs_exactly(layout: str, dtype: torch.dtype) -> None:
    base = model()
    rollout, slot_map, own = rollout_copy(base, layout, dtype)
    target = MergedLoraTarget(rollout, NAMES, slot_map, base_prints=own)
    assert target.verified is own  # checked at construction, before any update
    base_w = {k: w.clone() for k, w in target.weights.items()}
    up = update(base)
    report = target.apply(up)
    assert report.applied == len(NAMES) and report.max_print_frac < 1.0
    assert up.base.same_as(target.verified)  # the actor's prints checked (or equal to its own)
    # every weight is exactly base + delta, merged in the rollout's dtype
    for name in NAMES:
        delta = up.deltas[name].delta()
        for slot in slot_map.slots_for(name):
            want = base_w[slot.module].clone()
            want[slot.dst_rows] += delta[slot.rows].to(want)
            got = target.weights[slot.module][slot.dst_rows]
            assert torch.equal(got, want[slot.dst_rows]), (name, slot)
    # and the served forward is the actor's merged model's
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name in NAMES:
            merged.get_submodule(name).weight += up.deltas[name].delta()
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = merged.to(dtype)(x.to(dtype)).float(), rollout(x.to(dtype)).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert target.apply(update(base, version=2, seed=3)).max_print_frac < 1.0


def _fault(fault: str, layout: str, up: WeightUpdate) -> WeightUpdate:
    """``up`` changed on its way to the rollout, every shape still fitting."""
    name = LAYOUTS[layout]
    d = up.deltas[name]
    if fault == "transposed":  # A and B exchanged and transposed: still (r, in), (out, r)
        deltas = {
            **up.deltas,
            name: LoraDelta(a=d.b.T.contiguous(), b=d.a.T.contiguous(), scale=d.scale),
        }
        return dataclasses.replace(up, deltas=deltas)
    if fault == "dropped":
        deltas = {k: v for k, v in up.deltas.items() if k != name}
        return WeightUpdate.build(up.version, "default", deltas, up.base)
    if fault == "downcast":  # exported fp32, arrived bf16 (and back to fp32 would pass shapes)
        deltas = {**up.deltas, name: LoraDelta(d.a.bfloat16(), d.b.bfloat16(), d.scale)}
        return dataclasses.replace(up, deltas=deltas)
    if fault == "corrupt_row":  # one row of B replaced
        b = d.b.clone()
        b[3] = -b[3]
        return dataclasses.replace(up, deltas={**up.deltas, name: LoraDelta(d.a, b, d.scale)})
    raise AssertionError(fault)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("when", ["construction", "first_update"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_wrong_slot_map_raises(layout: str, when: str, dtype: torch.dtype) -> None:
    """Q/K swapped in the fused slot map, or the two shards swapped: caught against the base
    prints taken before the layout (at construction) or the actor's (on the first update)."""
    base = model()
    rollout, slot_map, own = rollout_copy(base, layout, dtype)
    bad = wrong_slots(slot_map, layout)
    name = {"fused_qkv": "attn.to_k", "swapped_shards": "up"}[layout]  # (to_k checks first)
    if when == "construction":
        with pytest.raises(SyncError, match=rf"base of {name} -> .*slot \d, rows"):
            MergedLoraTarget(rollout, NAMES, bad, base_prints=own)
        return
    target = MergedLoraTarget(rollout, NAMES, bad)
    before = state(rollout)
    with pytest.raises(SyncError, match=rf"base of {name} -> .*the actor's base"):
        target.apply(update(base))
    assert unchanged(rollout, before)


def test_wrong_slot_map_the_sum_cannot_see() -> None:
    """Sums and delta prints read back through the same wrong map agree, so without base prints
    the order cannot be checked: such a sync refuses to run and writes nothing."""
    base = model()
    rollout, slot_map, _ = rollout_copy(base, "swapped_shards", torch.float32)
    target = MergedLoraTarget(rollout, NAMES, wrong_slots(slot_map, "swapped_shards"))
    before = state(rollout)
    with pytest.raises(SyncError, match="no base row prints"):
        target.apply(dataclasses.replace(update(base), base=None))
    assert unchanged(rollout, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fault", ["transposed", "dropped", "downcast", "corrupt_row"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bad_update_raises_naming_the_module(layout: str, fault: str, dtype: torch.dtype) -> None:
    base = model()
    rollout, slot_map, own = rollout_copy(base, layout, dtype)
    target = MergedLoraTarget(rollout, NAMES, slot_map, base_prints=own)
    target.apply(update(base))  # a non-base state to protect
    before = state(rollout)
    bad = _fault(fault, layout, update(base, version=2, seed=5))
    match = {
        "transposed": "row print",
        "dropped": "missing",
        "downcast": "converted in transit",
        "corrupt_row": "row print of trained row 3",
    }[fault]
    with pytest.raises(SyncError, match=match) as e:
        target.apply(bad)
    assert LAYOUTS[layout] in str(e.value)
    assert unchanged(rollout, before)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dropped_slot_raises(layout: str) -> None:
    """A slot map that forgot a module (its rows go nowhere) or one of its shards."""
    base = model()
    rollout, slot_map, own = rollout_copy(base, layout, torch.float32)
    name = LAYOUTS[layout]
    if layout == "fused_qkv":  # identity left where a RowView (no weight) stands
        forgot = SlotMap({k: v for k, v in slot_map.slots.items() if k != name})
        with pytest.raises(SyncError, match=f"no weight slot .{name}."):
            MergedLoraTarget(rollout, NAMES, forgot, base_prints=own)
    else:
        forgot = SlotMap({**slot_map.slots, name: slot_map.slots[name][:1]})
        with pytest.raises(SyncError, match=f"{name}: its slots cover 4 rows"):
            MergedLoraTarget(rollout, NAMES, forgot, base_prints=own)


def test_rollout_on_other_base_weights_raises(tiny_model, actor_factory, lora_names) -> None:
    """The engines end to end: the actor sends its base prints; a rollout that holds other base
    weights (another checkpoint, a stale copy) refuses the first update."""
    from diffrl.rollout.engine import RolloutConfig, RolloutEngine

    other = copy.deepcopy(tiny_model)
    name = lora_names(tiny_model)[0]
    with torch.no_grad():
        other.get_submodule(name).weight[0] += 0.1
    names = lora_names(tiny_model)
    rollout = RolloutEngine(other, RolloutConfig(), names, torch.device("cpu"))
    assert rollout.target.verified is not None  # its own layout checked at construction
    good = RolloutEngine(tiny_model, RolloutConfig(), names, torch.device("cpu"))
    actor = actor_factory(tiny_model)
    up = actor.export_weights("default")
    assert up.base is not None and sorted(up.base.rows) == names
    with pytest.raises(SyncError, match=rf"base of {name} .*the actor's base"):
        rollout.load_weights(up)
    assert good.load_weights(up).max_print_frac < 1.0


# --- every family's own serving layout ---------------------------------------------------------

FAMILY_PRESETS = TINY_FAMILY_PRESETS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, preset", FAMILY_PRESETS)
def test_every_family_layout_passes_and_a_swap_raises(family, preset, dtype) -> None:
    pytest.importorskip("diffusers")
    from diffrl.build import expanded_targets
    from diffrl.models.registry import ModelConfig, load_model

    torch.manual_seed(0)
    base = load_model(ModelConfig(family=family, preset=preset))
    names = expanded_targets(base, list(base.family.lora_targets))
    actor = BasePrints.of_model(base, names)  # the actor's, in fp32
    rollout = copy.deepcopy(base).to(dtype)
    slot_map = rollout.family.serving_layout(rollout)
    assert slot_map.slots, "the family re-lays something out"
    faults = family_faults(slot_map)
    assert faults
    for what, bad in faults.items():
        with pytest.raises(
            SyncError, match="the slot map sends these rows to the wrong place"
        ) as e:
            MergedLoraTarget(rollout, names, bad, base_prints=actor)
        moved = what.removesuffix(" shards").split(" <-> ")
        assert any(f"base of {n} ->" in str(e.value) for n in moved), (what, str(e.value))
    target = MergedLoraTarget(rollout, names, slot_map, base_prints=actor)
    g = torch.Generator().manual_seed(1)
    deltas = {}
    for n in names:
        out, cols = base.get_submodule(n).weight.shape
        a, b = torch.randn(4, cols, generator=g) * 0.1, torch.randn(out, 4, generator=g) * 0.1
        deltas[n] = LoraDelta(a, b, 1.0)
    report = target.apply(WeightUpdate.build(1, "default", deltas, actor))
    assert report.applied == len(names) and report.max_print_frac < 1.0
