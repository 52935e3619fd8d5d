"""Contract 2: weight sync is exact or fails.

The actor exports a versioned ``WeightUpdate``: per LoRA target module, A (r, in), B (out, r)
and the scale, plus a checksum of the delta scale * B @ A. The rollout side keeps the frozen
base weights and writes W = W_base + delta into its own layout. A ``SlotMap`` says where each
trained module's delta lands: the same module, or row slices of other modules (e.g. a fused
QKV trained as one Linear and served as three, or an FC split into tensor-parallel shards).
``apply_update`` verifies count, shapes and checksums, and raises on anything it cannot load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from diffrl.errors import ContractError


class SyncError(ContractError):
    """A weight update could not be applied exactly."""


@dataclass(frozen=True)
class LoraDelta:
    a: Tensor  # (r, in)
    b: Tensor  # (out, r)
    scale: float

    def delta(self) -> Tensor:  # (out, in)
        return (self.b.double() @ self.a.double() * self.scale).float()


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    adapter: str  # which actor adapter this is (e.g. "default" or "old")
    deltas: dict[str, LoraDelta]  # canonical module name (e.g. "net.blocks.0.attn.qkv") -> delta
    checksums: dict[str, float]  # name -> sum of the delta, computed on the actor side

    @staticmethod
    def build(version: int, adapter: str, deltas: dict[str, LoraDelta]) -> WeightUpdate:
        sums = {k: float(d.delta().double().sum()) for k, d in deltas.items()}
        return WeightUpdate(version, adapter, deltas, sums)


@dataclass(frozen=True)
class Slot:
    module: str  # rollout module name holding a weight (out, in)
    rows: slice = field(
        default_factory=lambda: slice(None)
    )  # rows of the trained delta that land in this module
    dst_rows: slice = field(
        default_factory=lambda: slice(None)
    )  # rows of the rollout weight they land in


@dataclass
class SlotMap:
    """trained module name -> rollout slots; identity where not listed."""

    slots: dict[str, list[Slot]] = field(default_factory=dict)

    def slots_for(self, name: str) -> list[Slot]:
        return self.slots.get(name, [Slot(name)])


@dataclass(frozen=True)
class SyncReport:
    version: int
    adapter: str
    applied: int  # number of trained modules applied
    expected: int
    max_checksum_err: float

    def as_metrics(self) -> dict[str, float]:
        return {
            "sync/version": self.version,
            "sync/applied": self.applied,
            "sync/max_checksum_err": self.max_checksum_err,
        }


def check_targets(update: WeightUpdate, expected: list[str]) -> None:
    """Raise unless the update carries a delta for exactly the ``expected`` (sorted) modules."""
    got = sorted(update.deltas)
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise SyncError(
            f"weight update v{update.version} does not match the rollout's "
            f"targets: missing {missing[:5]}, unexpected {extra[:5]} "
            f"({len(got)} given, {len(expected)} expected)"
        )


def slot_weights(model: nn.Module, slot_map: SlotMap, expected: list[str]) -> dict[str, Tensor]:
    """The weight of every slot the ``expected`` trained modules map to (slot module -> its
    weight, in slot order); a SyncError names a slot the rollout model lacks."""
    modules = dict(model.named_modules())
    weights: dict[str, Tensor] = {}
    for name in expected:
        for slot in slot_map.slots_for(name):
            weight = getattr(modules.get(slot.module), "weight", None)
            if not isinstance(weight, Tensor):
                raise SyncError(
                    f"rollout model has no weight slot {slot.module!r} for trained module {name!r}"
                )
            weights[slot.module] = weight
    return weights


class MergedLoraTarget:
    """The rollout side's view of one model: frozen base copies of every slot it may write."""

    def __init__(
        self,
        model: nn.Module,
        expected: list[str],
        slot_map: SlotMap | None = None,
        base_device: str = "",
    ):
        """``base_device`` holds the frozen base copies ("" = beside the weights; "cpu" keeps a
        real-size model's second copy of its targeted weights off the GPU, in pinned memory, at
        the cost of copying each slot in at sync time)."""
        self.model = model
        self.slot_map = slot_map or SlotMap()
        self.expected = sorted(expected)
        self.weights = slot_weights(model, self.slot_map, self.expected)
        self.base = {k: _copy(w, base_device) for k, w in self.weights.items()}

    @torch.no_grad()
    def apply(self, update: WeightUpdate) -> SyncReport:
        want = self.expected
        check_targets(update, want)
        new: dict[str, Tensor] = {}
        max_err = 0.0
        for name in want:
            delta = update.deltas[name].delta()
            applied_sum, rounding = 0.0, 0.0
            for slot in self.slot_map.slots_for(name):
                base = self.base[slot.module].to(self.weights[slot.module].device)
                part = delta[slot.rows]
                target = new.get(slot.module, base.clone())
                if target[slot.dst_rows].shape != part.shape:
                    raise SyncError(
                        f"{name} -> {slot.module}: delta rows {tuple(part.shape)} do "
                        f"not fit slot {tuple(target[slot.dst_rows].shape)}"
                    )
                target[slot.dst_rows] += part.to(target)
                new[slot.module] = target
                written = target[slot.dst_rows].double()
                applied_sum += float((written - base[slot.dst_rows].double()).sum())
                rounding += _rounding_bound(written, target.dtype)
            err = abs(applied_sum - update.checksums[name])
            # fp32 adds rounding ~1e-7 per entry; a low-precision copy rounds W + delta to its
            # own grid, which shifts the sum by ~sqrt(n) * ulp(|W|) however exact the mapping
            tol = 1e-4 * max(1.0, abs(update.checksums[name])) + rounding
            if err > tol:
                raise SyncError(
                    f"checksum mismatch for {name}: applied {applied_sum:.6g}, "
                    f"actor sent {update.checksums[name]:.6g} (tolerance {tol:.3g})"
                )
            max_err = max(max_err, err)
        for module, w in new.items():  # commit only after every target verified
            self.weights[module].copy_(w)
        return SyncReport(update.version, update.adapter, len(want), len(want), max_err)


def _rounding_bound(written: Tensor, dtype: torch.dtype) -> float:
    """A bound on how much rounding ``written`` (float64 view) to ``dtype`` moves its sum: zero
    for fp32 and wider (their rounding is inside the relative tolerance), else 4 sqrt(n)
    half-ulps at the entries' RMS magnitude (independent rounding errors add like a random walk;
    a wrong mapping moves the sum by the delta itself, far more)."""
    if torch.finfo(dtype).bits >= 32:
        return 0.0
    rms = float(written.pow(2).mean().sqrt())
    return 4.0 * math.sqrt(written.numel()) * 0.5 * torch.finfo(dtype).eps * rms


def _copy(w: Tensor, device: str) -> Tensor:
    if not device or torch.device(device) == w.device:
        return w.detach().clone()
    out = torch.empty(w.shape, dtype=w.dtype, device=device, pin_memory=w.is_cuda)
    return out.copy_(w.detach())
