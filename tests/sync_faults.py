"""Faulty serving layouts for the sync contract's tests: a family's own slot map with a fused
pair or two shards exchanged (shared by tests/sync and tests/test_silent_failures.py)."""

from __future__ import annotations

import dataclasses

from diffrl.sync.weights import SlotMap, SyncError, SyncReport, WeightUpdate

# every diffusers family's tiny preset, as (family, preset)
TINY_FAMILY_PRESETS = [
    ("sd3", "sd35-tiny"),
    ("flux", "flux1-tiny"),
    ("qwen_image", "qwen-image-tiny"),
    ("wan", "wan-tiny"),
    ("ltx2", "ltx2-tiny"),
    ("minimax_h3", "h3-tiny"),
]


def family_faults(slot_map: SlotMap) -> dict[str, SlotMap]:
    """The family's slot map with the first fused pair exchanged (two trained modules sharing
    one weight, e.g. Q and K) and the first split module's shards exchanged, where it has them."""
    faults: dict[str, SlotMap] = {}
    by_module: dict[str, list[str]] = {}
    for name, slots in slot_map.slots.items():
        if len(slots) == 1:
            by_module.setdefault(slots[0].module, []).append(name)
    fused = next((names for names in by_module.values() if len(names) >= 2), None)
    if fused:
        a, b = fused[:2]
        faults[f"{a} <-> {b}"] = SlotMap(
            {**slot_map.slots, a: slot_map.slots[b], b: slot_map.slots[a]}
        )
    split = next((n for n, s in slot_map.slots.items() if len(s) == 2), None)
    if split:
        s0, s1 = slot_map.slots[split]
        swapped = [dataclasses.replace(s0, rows=s1.rows), dataclasses.replace(s1, rows=s0.rows)]
        faults[f"{split} shards"] = SlotMap({**slot_map.slots, split: swapped})
    return faults


def no_op_apply(update: WeightUpdate) -> SyncReport:
    """A rollout merge that reports every module applied and writes nothing (a second base
    sync, an upgrade that binds the merge to nothing): the sync receipt must catch it."""
    n = len(update.deltas)
    return SyncReport(update.version, update.adapter, n, n, 0.0)


def sync_error_of(fn) -> str:
    """The message of the ``SyncError`` that ``fn()`` raises ("" when it raises none): what a
    gloo rank reports back for the parent to compare."""
    try:
        fn()
    except SyncError as e:
        return str(e) or "SyncError"
    return ""
