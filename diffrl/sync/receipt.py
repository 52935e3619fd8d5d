"""The sync receipt: after each weight sync the rollout says what it holds, and the sender
compares it with what the actor sent.

``MergedLoraTarget.apply`` checks each update as it merges it. That cannot see an apply that
never ran, ran as a no-op, or was undone afterwards (a second "base" sync that reloads the base
weights: verl-omni PR #624): the rollout then samples with base weights and nothing notices.
So after ``load_weights`` the sender asks the rollout for a receipt, read from the weights its
model uses now (looked up by name again, not through the target's cached tensors):

- the version it says it applied;
- per trained module, PROBES numbers: u^T ((W - W_base) r) over a few fixed rows of every slot
  the module's rows land in, r the module's row-print probes (``sync/weights.py``) and u fixed
  N(0, 1) weights per row, both seeded by the name. Rows, shards and fused slots read in the
  wrong order, or a weight still on its base, change them.

The sender computes the same numbers from the delta prints it sent (u^T delta_rows) and raises
``SyncError`` naming the module when they differ by more than the merge's rounding. It costs a
float64 pass over RECEIPT_ROWS rows per slot, and 2 x PROBES float64 per module on the wire.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from diffrl.sync.weights import (
    PROBES,
    MergedLoraTarget,
    SyncError,
    SyncReport,
    WeightUpdate,
    eps_of,
    probe,
    slot_prints,
    slot_weights,
)

# trained rows read per module, one from each of RECEIPT_ROWS equal strata of its rows: a
# skipped or undone apply moves every row, so a few see it, and any slot holding a contiguous
# eighth of the rows or more (a fused part, a shard of up to 8) is read at least once. The
# merge's own row-by-row check (MergedLoraTarget.apply) covers every row
RECEIPT_ROWS = 16


@lru_cache(maxsize=4096)
def receipt_rows(name: str, out: int) -> tuple[Tensor, Tensor]:
    """(rows, u): the trained rows of module ``name`` (``out`` rows) that the receipt reads,
    ascending, and their N(0, 1) float64 weights; seeded by the name, not by torch's global
    RNG. Shared and cached: do not modify."""
    digest = hashlib.blake2b(f"receipt:{name}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    k = min(out, RECEIPT_ROWS)
    edges = torch.linspace(0, out, k + 1, dtype=torch.float64)
    pick = edges[:-1] + torch.rand(k, dtype=torch.float64, generator=gen) * (edges[1:] - edges[:-1])
    rows = pick.floor().long().clamp_(0, out - 1).unique()
    return rows, torch.randn(len(rows), dtype=torch.float64, generator=gen)


@dataclass(frozen=True)
class SyncReceipt:
    """What a rollout holds after a sync."""

    version: int
    held: dict[str, Tensor]  # trained module -> (PROBES,) float64
    tol: dict[str, Tensor]  # its rounding tolerance, (PROBES,)


def receipt_of(target: MergedLoraTarget, version: int) -> SyncReceipt:
    """The receipt of a rollout's merged weights, read from the weights ``target.model`` uses
    now (looked up by name), through the slot map: per trained module, u^T ((W - W_base) r)
    over its receipt rows wherever the serving layout put them."""
    if target.verified is None:
        raise SyncError("no base row prints: the receipt cannot size the trained modules")
    live = slot_weights(target.model, target.slot_map, target.expected)
    held, tol = {}, {}
    with torch.no_grad():
        for name in target.expected:
            out = target.verified.rows[name].shape[0]
            rows, u = receipt_rows(name, out)
            s = torch.zeros(PROBES, dtype=torch.float64)
            t2 = torch.zeros(PROBES, dtype=torch.float64)
            for slot in target.slot_map.slots_for(name):
                w = live[slot.module]
                src = torch.arange(out)[slot.rows]  # trained rows this slot holds, in order
                dst = torch.arange(w.shape[0])[slot.dst_rows]
                hit = torch.isin(src, rows)
                if not hit.any():
                    continue
                at = dst[hit]
                weights = u[torch.searchsorted(rows, src[hit])]
                base = target.base[slot.module][at.to(target.base[slot.module].device)]
                r = probe(name, w.shape[1]).to(w.device)
                eps = eps_of(w.dtype, torch.float32)
                got, t = slot_prints(w[at.to(w.device)], base.to(w.device), r, eps)
                s += weights @ got.cpu()
                t2 += weights.square() @ t.cpu().square()
            held[name], tol[name] = s, t2.sqrt()
    return SyncReceipt(version, held, tol)


def expected_of(update: WeightUpdate) -> dict[str, Tensor]:
    """Trained module -> (PROBES,) float64: what a rollout that merged ``update`` reports,
    from the delta prints the actor sent (u^T delta_rows over the receipt rows)."""
    out = {}
    for name, prints in update.delta_rows.items():
        rows, u = receipt_rows(name, prints.shape[0])
        out[name] = u @ prints[rows].double()
    return out


def check_receipt(
    version: int, expected: dict[str, Tensor], receipt: SyncReceipt, who: str = "rollout"
) -> float:
    """Raise SyncError unless the receipt shows update ``version`` merged (naming the first
    module that differs); return the worst error as a fraction of its tolerance."""
    if receipt.version != version:
        raise SyncError(
            f"{who} reports weights v{receipt.version} after update v{version} was sent: it "
            "did not apply the update (stale version)"
        )
    missing = sorted(set(expected) - set(receipt.held))
    if missing:
        raise SyncError(f"{who}'s receipt after update v{version} lacks modules {missing[:5]}")
    worst = 0.0
    for name in sorted(expected):
        want, got, tol = expected[name], receipt.held[name], receipt.tol[name]
        err = (got - want).abs()
        bad = (err > tol).nonzero()
        if len(bad):
            j = int(bad[0, 0])
            on_base = bool((got.abs() <= tol).all())
            why = (
                "the rollout is still on its base weights for it (the update was not applied, "
                "or was undone)"
                if on_base
                else "the rollout holds other weights than the actor sent"
            )
            raise SyncError(
                f"{who} after update v{version}: {name} holds receipt {float(got[j]):.9g}, the "
                f"actor sent {float(want[j]):.9g} (probe {j}, tolerance {float(tol[j]):.3g}): "
                f"{why}"
            )
        worst = max(worst, float((err / tol.clamp_min(1e-300)).max()))
    return worst


def sent(update: Any) -> tuple[int, dict[str, Tensor]]:
    """(version, expected receipt) of what the sender sent: computed from a ``WeightUpdate``,
    or asked of a remote handle (``backends/ray.py``'s ``RemoteWeights.sent``), whose actor
    host computed it from the update it exported."""
    if isinstance(update, WeightUpdate):
        return update.version, expected_of(update)
    return update.sent()


def load_verified(rollout: Any, update: Any, who: str = "rollout") -> dict[str, float]:
    """``rollout.load_weights(update)``, then its receipt checked against what was sent;
    returns the sync's metrics (``sync/*``, with ``sync/receipt_frac``)."""
    report: SyncReport = rollout.load_weights(update)
    version, expected = sent(update)
    frac = check_receipt(version, expected, rollout.receipt(), who)
    return {**report.as_metrics(), "sync/receipt_frac": frac}
