"""Contract 2: weight sync is exact or fails.

The actor exports a versioned ``WeightUpdate``: per LoRA target module, A (r, in), B (out, r)
and the scale, the dtype it exported them in, a checksum of the delta scale * B @ A, and row
prints of the delta and of the frozen base weight. The rollout side keeps the frozen base
weights and writes W = W_base + delta into its own layout. A ``SlotMap`` says where each
trained module's delta lands: the same module, or row slices of other modules (e.g. a fused
QKV trained as one Linear and served as three, or an FC split into tensor-parallel shards).

A sum cannot see order: rows sent to the wrong shard, or Q's rows written where K's belong,
keep it. So each trained module ``name`` gets a fixed pseudo-random probe vector r_name (its
length is the module's input width, its seed a hash of the name: the same in every process and
untouched by torch's global RNG), and a weight's *row print* is W @ r_name in float64: one
number per row, moved by any permutation of rows, shards, fused slots or columns, or by a
transposed A/B. Reading the delta back through the slot map cannot catch a wrong slot map, as
it inverts the same mistake; the base weights can, because the serving layout builds its fused
or sharded base from the same weights the actor trains on. So the rollout checks, per slot,

- its base rows against the base prints of the trained module's rows the slot says they are
  (at construction from the un-laid-out copy when the caller has it, and against the actor's
  prints on the first update that carries them, or any update whose prints change);
- after the merge, (written - base) rows against the actor's delta prints, before anything is
  committed.

``MergedLoraTarget.apply`` also checks count, shapes, dtypes and the summed checksum, and
raises ``SyncError`` on anything it cannot load, leaving the rollout's weights unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor, nn

from diffrl.errors import ContractError

log = logging.getLogger(__name__)

# A row print's rounding error is a sum of independent per-entry roundings of at most
# eps * |entry| * |r_j| each; by Hoeffding's bound it exceeds PRINT_SIGMAS times their root
# sum of squares with probability under 2 exp(-PRINT_SIGMAS**2 / 2) (~3e-14 per row).
PRINT_SIGMAS = 8.0
# Probe vectors per trained module. One row print misses a changed row when the change happens
# to be near-orthogonal to the probe (chance ~ tolerance / |change|); four independent ones miss
# it only if all four do, at the cost of one thin matmul instead of a matrix-vector product.
PROBES = 4
F64_REL = 1e-12  # float64 accumulation in another order (another device, other chunking)


class SyncError(ContractError):
    """A weight update could not be applied exactly."""


@lru_cache(maxsize=4096)
def probe(name: str, width: int) -> Tensor:
    """(width, PROBES) float64 N(0, 1) probes for trained module ``name``: seeded from a hash
    of the name, so every process draws the same ones without touching the global RNG. Shared
    and cached: do not modify it."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.randn(width, PROBES, dtype=torch.float64, generator=gen)


def _chunk_rows(width: int) -> int:
    """Rows per chunk that keep each float64 temporary near 32 MB."""
    return max(1, (1 << 22) // max(1, width))


def row_prints(weight: Tensor, name: str) -> Tensor:
    """(out, PROBES) float64 on the CPU: ``weight`` (out, in) @ probe(name, in)."""
    r = probe(name, weight.shape[1]).to(weight.device)
    step = _chunk_rows(weight.shape[1])
    parts = [weight[i : i + step].double() @ r for i in range(0, weight.shape[0], step)]
    return (torch.cat(parts) if parts else r.new_zeros(0, PROBES)).cpu()


def slot_prints(rows: Tensor, base: Tensor | None, r: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """((rows - base) @ r, its rounding tolerance), both (k, PROBES) float64 on ``rows``'
    device (``r``: (in, PROBES)).

    ``eps``: the relative rounding of each entry (the coarsest dtype the values went through).
    The tolerance takes m = |rows| + |base| as each entry's magnitude, an upper bound for every
    value rounded on the way (base, delta and their sum): PRINT_SIGMAS eps sqrt(sum m^2 r^2),
    plus F64_REL sum m |r| <= F64_REL sqrt(in) sqrt(sum m^2 r^2) (Cauchy-Schwarz), so that one
    product gives both."""
    step = _chunk_rows(rows.shape[1])
    scale = PRINT_SIGMAS * eps + F64_REL * math.sqrt(rows.shape[1])
    got, tol = [], []
    r_sq = r.square()
    for i in range(0, rows.shape[0], step):
        x = rows[i : i + step].to(torch.float64, copy=True)  # a copy: changed in place below
        if base is None:
            got.append(x @ r)
            mag = x.abs_()
        else:
            b = base[i : i + step].to(x, copy=True)
            got.append((x - b) @ r)
            mag = x.abs_().add_(b.abs_())
        tol.append((mag.square_() @ r_sq).sqrt_().mul_(scale))
    if not got:
        empty = r.new_zeros(0, r.shape[1])
        return empty, empty
    return torch.cat(got), torch.cat(tol)


def eps_of(*dtypes: torch.dtype) -> float:
    """The coarsest relative rounding among ``dtypes``."""
    return max(torch.finfo(d).eps for d in dtypes)


@dataclass(frozen=True)
class LoraDelta:
    a: Tensor  # (r, in)
    b: Tensor  # (out, r)
    scale: float

    def delta(self) -> Tensor:  # (out, in)
        return (self.b.double() @ self.a.double() * self.scale).float()

    def prints(self, name: str) -> Tensor:
        """(out, PROBES) float64: the delta's row prints, through the factors (B (A r))."""
        r = probe(name, self.a.shape[1]).to(self.a.device)
        return ((self.b.double() @ (self.a.double() @ r)) * self.scale).cpu()


@dataclass(frozen=True)
class BasePrints:
    """Row prints of the frozen base weight of every trained module, and its dtype."""

    rows: dict[str, Tensor]  # name -> (out, PROBES) float64
    dtypes: dict[str, torch.dtype]

    @staticmethod
    def of(weights: Mapping[str, Tensor]) -> BasePrints:
        """From trained module name -> its base weight (out, in)."""
        with torch.no_grad():
            rows = {n: row_prints(w.detach(), n) for n, w in weights.items()}
        return BasePrints(rows, {n: w.dtype for n, w in weights.items()})

    @staticmethod
    def of_model(model: nn.Module, names: Iterable[str]) -> BasePrints:
        """From the named Linears of ``model`` before any serving layout (names it lacks are
        left out; the target's own checks name them)."""
        modules = dict(model.named_modules())
        weights = {n: getattr(modules.get(n), "weight", None) for n in names}
        return BasePrints.of({n: w for n, w in weights.items() if isinstance(w, Tensor)})

    def same_as(self, other: BasePrints | None) -> bool:
        return (
            other is not None
            and self.dtypes == other.dtypes
            and self.rows.keys() == other.rows.keys()
            and all(torch.equal(v, other.rows[k]) for k, v in self.rows.items())
        )


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    adapter: str  # which actor adapter this is (e.g. "default" or "old")
    deltas: dict[str, LoraDelta]  # canonical module name (e.g. "net.blocks.0.attn.qkv") -> delta
    checksums: dict[str, float]  # name -> sum of the delta, computed on the actor side
    delta_rows: dict[str, Tensor] = field(default_factory=dict)  # name -> (out, PROBES)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # name -> A/B's export dtype
    base: BasePrints | None = None  # the actor's base prints (the anchor for the slot map)

    @staticmethod
    def build(
        version: int, adapter: str, deltas: dict[str, LoraDelta], base: BasePrints | None = None
    ) -> WeightUpdate:
        sums = {k: float(d.delta().double().sum()) for k, d in deltas.items()}
        rows = {k: d.prints(k) for k, d in deltas.items()}
        dtypes = {k: d.a.dtype for k, d in deltas.items()}
        return WeightUpdate(version, adapter, deltas, sums, rows, dtypes, base)


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
    max_print_frac: float = 0.0  # the worst row print's error as a fraction of its tolerance

    def as_metrics(self) -> dict[str, float]:
        return {
            "sync/version": self.version,
            "sync/applied": self.applied,
            "sync/max_checksum_err": self.max_checksum_err,
            "sync/max_print_frac": self.max_print_frac,
        }


def check_targets(update: WeightUpdate, expected: list[str]) -> None:
    """Raise unless the update carries a delta for exactly the ``expected`` (sorted) modules,
    each with its row prints and its A/B in the dtype the actor exported them in."""
    got = sorted(update.deltas)
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise SyncError(
            f"weight update v{update.version} does not match the rollout's "
            f"targets: missing {missing[:5]}, unexpected {extra[:5]} "
            f"({len(got)} given, {len(expected)} expected)"
        )
    for name in expected:
        d, sent = update.deltas[name], update.dtypes.get(name)
        if sent is None or name not in update.delta_rows:
            raise SyncError(
                f"weight update v{update.version} carries no row prints or export dtype for "
                f"{name} (build it with WeightUpdate.build)"
            )
        if d.a.dtype != sent or d.b.dtype != sent:
            raise SyncError(
                f"{name}: LoRA factors arrived as A {d.a.dtype}, B {d.b.dtype}; the actor "
                f"exported {sent} (converted in transit)"
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


def check_disjoint(slot_map: SlotMap, expected: list[str], n_rows: Mapping[str, int]) -> None:
    """No two trained modules (or slots) write the same rows of one weight."""
    owner: dict[str, Tensor] = {}
    for name in expected:
        for slot in slot_map.slots_for(name):
            n = n_rows[slot.module]
            taken = owner.setdefault(slot.module, torch.zeros(n, dtype=torch.bool))
            dst = torch.arange(n)[slot.dst_rows]
            if taken[dst].any():
                raise SyncError(f"{name}: rows {slot.dst_rows} of {slot.module} are mapped twice")
            taken[dst] = True


def check_cover(name: str, slots: list[Slot], out: int) -> None:
    """Every one of the trained module's ``out`` rows lands in exactly one slot."""
    src = [torch.arange(out)[s.rows] for s in slots]
    covered = torch.cat(src).sort().values if src else torch.zeros(0, dtype=torch.long)
    if not torch.equal(covered, torch.arange(out)):
        raise SyncError(
            f"{name}: its slots cover {len(covered)} rows ({covered.unique().numel()} "
            f"distinct) of the delta's {out}; each must land exactly once"
        )


def _span(s: slice, n: int) -> str:
    start, stop, _ = s.indices(n)
    return f"{start}:{stop}"


def check_prints(got: Tensor, want: Tensor, tol: Tensor, what: str, src_rows: Tensor) -> float:
    """Raise SyncError on the first row whose print is off by more than its tolerance (naming
    the trained row); return the worst error as a fraction of its tolerance."""
    err = (got - want.to(got)).abs()
    bad = (err > tol).nonzero()
    if len(bad):
        i, j = int(bad[0, 0]), int(bad[0, 1])
        rows = int((err > tol).any(dim=1).sum())
        raise SyncError(
            f"{what}: row print of trained row {int(src_rows[i])} is {float(got[i, j]):.9g}, "
            f"expected {float(want[i, j]):.9g} (probe {j}, tolerance {float(tol[i, j]):.3g}; "
            f"{rows} of {len(err)} rows differ)"
        )
    return float((err / tol.clamp_min(1e-300)).max()) if len(err) else 0.0


class MergedLoraTarget:
    """The rollout side's view of one model: frozen base copies of every slot it may write."""

    def __init__(
        self,
        model: nn.Module,
        expected: list[str],
        slot_map: SlotMap | None = None,
        base_device: str = "",
        base_prints: BasePrints | None = None,
    ):
        """``base_device`` holds the frozen base copies ("" = beside the weights; "cpu" keeps a
        real-size model's second copy of its targeted weights off the GPU, in pinned memory, at
        the cost of copying each slot in at sync time). ``base_prints``: the base row prints of
        the trained modules taken before the serving layout (``BasePrints.of_model`` on the
        un-laid-out copy); given, the slot map is checked against them here, else on the first
        update that carries the actor's."""
        self.model = model
        self.slot_map = slot_map or SlotMap()
        self.expected = sorted(expected)
        self.weights = slot_weights(model, self.slot_map, self.expected)
        check_disjoint(
            self.slot_map, self.expected, {k: w.shape[0] for k, w in self.weights.items()}
        )
        self.base = {k: _copy(w, base_device) for k, w in self.weights.items()}
        self.verified: BasePrints | None = None  # the last base prints the slots matched
        if base_prints is not None:
            self.check_base(base_prints, "the rollout's own base before its serving layout")

    @torch.no_grad()
    def check_base(self, prints: BasePrints, source: str) -> float:
        """Raise SyncError unless every slot's base rows print as the trained rows the slot map
        says they are (naming the trained module, the rollout module, the slot and its rows);
        return the worst error as a fraction of its tolerance."""
        worst = 0.0
        for name in self.expected:
            want = prints.rows.get(name)
            if want is None:
                raise SyncError(f"{source}: no base row prints for trained module {name}")
            slots = self.slot_map.slots_for(name)
            check_cover(name, slots, len(want))
            for i, slot in enumerate(slots):
                w = self.base[slot.module]
                # on the weight's device: a base copy kept on the host is copied in, as for a sync
                rows = w[slot.dst_rows].to(self.weights[slot.module].device)
                src = torch.arange(len(want))[slot.rows]
                if rows.shape[0] != len(src):
                    raise SyncError(
                        f"{name} -> {slot.module} (slot {i}): {len(src)} trained rows do not "
                        f"fit rows {_span(slot.dst_rows, w.shape[0])} ({rows.shape[0]})"
                    )
                r = probe(name, w.shape[1]).to(rows.device)
                eps = eps_of(w.dtype, prints.dtypes.get(name, w.dtype))
                got, tol = slot_prints(rows, None, r, eps)
                what = (
                    f"base of {name} -> {slot.module} (slot {i}, rows "
                    f"{_span(slot.dst_rows, w.shape[0])} <- trained rows "
                    f"{_span(slot.rows, len(want))}) against {source}: the slot map sends these "
                    "rows to the wrong place, or the rollout holds other base weights"
                )
                worst = max(
                    worst, check_prints(got, want[slot.rows].to(got.device), tol, what, src)
                )
        self.verified = prints
        return worst

    def _check_base_of(self, update: WeightUpdate) -> None:
        if update.base is not None:
            if not update.base.same_as(self.verified):
                self.check_base(update.base, f"the actor's base (update v{update.version})")
        elif self.verified is None:  # contract 2 is exact or fails: an unchecked order fails
            raise SyncError(
                f"weight update v{update.version}: no base row prints, none given at "
                "construction and none in the update, so the slot map's row order cannot be "
                "checked; pass base_prints=BasePrints.of_model(<the model before its serving "
                "layout>, names), or build the update with the actor's base prints"
            )

    @torch.no_grad()
    def apply(self, update: WeightUpdate) -> SyncReport:
        want = self.expected
        check_targets(update, want)
        self._check_base_of(update)
        new: dict[str, Tensor] = {}
        max_err, max_frac = 0.0, 0.0
        for name in want:
            d = update.deltas[name]
            delta = d.delta()
            prints = update.delta_rows[name]
            slots = self.slot_map.slots_for(name)
            if prints.shape != (delta.shape[0], PROBES):
                raise SyncError(
                    f"{name}: {tuple(prints.shape)} row prints for {delta.shape[0]} rows"
                )
            applied_sum, rounding = 0.0, 0.0
            for i, slot in enumerate(slots):
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
                r = probe(name, target.shape[1]).to(target.device)
                got, tol = slot_prints(
                    target[slot.dst_rows],
                    base[slot.dst_rows],
                    r,
                    eps_of(target.dtype, d.a.dtype, torch.float32),
                )
                what = (
                    f"delta of {name} -> {slot.module} (slot {i}, rows "
                    f"{_span(slot.dst_rows, target.shape[0])} <- trained rows "
                    f"{_span(slot.rows, delta.shape[0])}): the merged weight differs from what "
                    "the actor sent"
                )
                src = torch.arange(delta.shape[0])[slot.rows]
                frac = check_prints(got, prints[slot.rows].to(got.device), tol, what, src)
                max_frac = max(max_frac, frac)
            check_cover(name, slots, delta.shape[0])  # (after the slots' own shape checks)
            err = abs(applied_sum - update.checksums[name])
            # fp32 adds rounding ~1e-7 per entry; a low-precision copy rounds W + delta to its
            # own grid, which shifts the sum by ~sqrt(n) * ulp(|W|) however exact the mapping
            tol_sum = 1e-4 * max(1.0, abs(update.checksums[name])) + rounding
            if err > tol_sum:
                raise SyncError(
                    f"checksum mismatch for {name}: applied {applied_sum:.6g}, "
                    f"actor sent {update.checksums[name]:.6g} (tolerance {tol_sum:.3g})"
                )
            max_err = max(max_err, err)
        for module, w in new.items():  # commit only after every target verified
            self.weights[module].copy_(w)
        return SyncReport(update.version, update.adapter, len(want), len(want), max_err, max_frac)


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
