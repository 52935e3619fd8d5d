"""``rollout.share_base``: one frozen base for the actor, the rollout and the evaluator.

By default the rollout and the held-out evaluator each deep-copy the DiT and merge the synced
LoRA delta into their copy's weights (``MergedLoraTarget``), so one process holds three DiTs.
With ``rollout.share_base`` each of them instead holds an *alias copy*: its own modules whose
parameters and buffers are views of the loaded model's storage (``tp_sync.alias_copy``; the
actor's peft wraps those same weights as its ``base_layer``s and never writes them, since it
trains LoRA only). Each engine then holds the LoRA of the version it samples with unmerged,
as small factors of its own on its own target Linears, applied beside the shared weight by a
forward hook: y = x W^T (+ bias) + (x A^T) (s B)^T. The hook lives in the alias copy's
modules only; the actor's modules never see it, and the actor training its adapter does not
change what the rollout samples until a sync copies new factors in.

``SharedBaseTarget.apply`` gives the same guarantees as ``MergedLoraTarget.apply``: the count
and names of the targets, the factors' shapes and export dtypes, the summed checksum of the
delta, the delta's row prints (computed through the held factors, B (A r), with the rounding
of their cast to the model's dtype in the tolerance), the shared base's row prints against the
actor's, and nothing committed until every module verified. ``receipt_of_shared`` reads the
factors the live modules' hooks apply (looked up by name again) for the sender's receipt
check, and re-checks the base rows it reads against the verified base prints (a shared base
that changed under the rollout, e.g. a full fine-tune, fails the sync).

Factors are allocated at construction (zeros: the hook then adds exactly zero) and updated in
place, so compiled blocks keep their graphs across syncs. There is no serving layout: a fused
QKV or a sharded FC would need storage of its own, which is what sharing avoids.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffrl.errors import ConfigError
from diffrl.sync.receipt import SyncReceipt, receipt_rows
from diffrl.sync.weights import (
    F64_REL,
    PRINT_SIGMAS,
    PROBES,
    BasePrints,
    SyncError,
    SyncReport,
    WeightUpdate,
    check_prints,
    check_targets,
    eps_of,
    probe,
    slot_prints,
)

A_NAME, B_NAME = "shared_lora_a", "shared_lora_b"  # the factor buffers on each target Linear


def apply_shared_lora(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
    """Forward hook of a target Linear of an alias copy: its output plus the held LoRA term,
    (x A^T) (s B)^T, the scale folded into B at sync time."""
    a, b = getattr(module, A_NAME), getattr(module, B_NAME)  # plain attributes: dynamo traces them
    return out + F.linear(F.linear(args[0], a), b)


def _hooked(module: nn.Module) -> bool:
    return any(h is apply_shared_lora for h in module._forward_hooks.values())


def check_share_base(cfg) -> None:
    """The config rules of ``rollout.share_base`` that span sections (``build.check_config``:
    before any backend builds an engine)."""
    if not cfg.rollout.share_base:
        return
    if cfg.run.backend != "local":
        raise ConfigError(
            f"config key 'rollout.share_base' = true with run.backend={cfg.run.backend!r}: the "
            "engines then live in other processes and cannot alias the actor's base weights "
            "(colocated Ray replicas would need CUDA IPC of the base, not built); use "
            "run.backend=local, or rollout.share_base=false"
        )
    if cfg.rollout.cuda_graphs:
        raise ConfigError(
            "config key 'rollout.share_base' = true with rollout.cuda_graphs=true: graph "
            "capture of the hooked LoRA factors is not verified; set one of them to false"
        )


def check_share_ranks(ranks) -> None:
    """``rollout.share_base`` under torchrun: the actor's base must stay whole and in place.
    Data parallelism puts it through FSDP2 (``dp_shard`` shards it), tensor parallelism
    shards it (and a sharded rollout re-shards its copy); either leaves the alias copies
    pointing at weights the actor no longer uses, a full copy held."""
    meshes = ranks.meshes
    if meshes is None:
        return
    dp, tp = ranks.dp_size, meshes.size("tp")
    if dp > 1 or tp > 1:
        raise ConfigError(
            f"config key 'rollout.share_base' = true under torchrun with {dp} data-parallel "
            f"rank(s) and tp={tp}: the actor's base is then FSDP2-sharded (parallel.dp_shard) "
            "or TP-sharded (parallel.tp, and parallel.rollout=sharded shards the rollout "
            "copy), so the rollout cannot share it; needs one data-parallel rank and "
            "parallel.tp=1 (sequence parallelism keeps the weights whole), or "
            "rollout.share_base=false"
        )


class SharedBaseTarget:
    """The rollout side of an alias copy: the LoRA factors held beside the shared base of every
    trained module, and their verified update."""

    def __init__(
        self, model: nn.Module, expected: list[str], rank: int, base_prints: BasePrints
    ) -> None:
        """Installs zero factors of ``rank`` and the hook on each ``expected`` Linear of
        ``model`` (an alias copy: never the actor's modules), then checks the shared base
        against ``base_prints`` (the prints the target's weights had when loaded)."""
        if rank < 1:
            raise ConfigError(f"rollout.share_base: LoRA rank {rank}; must be >= 1")
        self.model = model
        self.expected = sorted(expected)
        self.rank = rank
        modules = dict(model.named_modules())
        linears = [modules.get(name) for name in self.expected]
        for name, m in zip(self.expected, linears, strict=True):  # all checked, then installed
            if not isinstance(m, nn.Linear):
                raise SyncError(f"rollout.share_base: {name!r} is not a Linear of the rollout copy")
            if _hooked(m):  # a second hook would apply the LoRA twice
                raise SyncError(f"rollout.share_base: {name!r} already holds shared factors")
        for m in linears:
            assert isinstance(m, nn.Linear)  # (checked above)
            w = m.weight
            m.register_buffer(A_NAME, w.new_zeros(rank, w.shape[1]), persistent=False)
            m.register_buffer(B_NAME, w.new_zeros(w.shape[0], rank), persistent=False)
            m.register_forward_hook(apply_shared_lora)
        self.verified: BasePrints | None = None
        self.check_base(base_prints, "the loaded model's base")

    def live(self) -> dict[str, nn.Linear]:
        """Trained module name -> its live Linear in the model (looked up by name again, not
        cached: the receipt reads what the model uses now)."""
        modules = dict(self.model.named_modules())
        out = {}
        for name in self.expected:
            m = modules.get(name)
            if not isinstance(m, nn.Linear) or not hasattr(m, A_NAME):
                raise SyncError(
                    f"rollout.share_base: the rollout copy holds no factors for {name!r}"
                )
            out[name] = m
        return out

    @torch.no_grad()
    def check_base(self, prints: BasePrints, source: str) -> float:
        """Raise SyncError unless every trained module's shared base weight prints as
        ``prints`` says; return the worst error as a fraction of its tolerance."""
        worst, live = 0.0, self.live()
        for name in self.expected:
            want = prints.rows.get(name)
            if want is None:
                raise SyncError(f"{source}: no base row prints for trained module {name}")
            w = live[name].weight
            if len(want) != w.shape[0]:
                raise SyncError(
                    f"{source}: {name} has {len(want)} base rows, the shared base {w.shape[0]}"
                )
            r = probe(name, w.shape[1]).to(w.device)
            eps = eps_of(w.dtype, prints.dtypes.get(name, w.dtype))
            got, tol = slot_prints(w, None, r, eps)
            what = f"shared base of {name} against {source}: the rollout holds other base weights"
            rows = torch.arange(len(want))
            worst = max(worst, check_prints(got, want.to(got.device), tol, what, rows))
        self.verified = prints
        return worst

    @torch.no_grad()
    def apply(self, update: WeightUpdate) -> SyncReport:
        check_targets(update, self.expected)
        if update.base is not None and not update.base.same_as(self.verified):
            self.check_base(update.base, f"the actor's base (update v{update.version})")
        staged: dict[str, tuple[Tensor, Tensor]] = {}
        max_err, max_frac = 0.0, 0.0
        live = self.live()
        for name in self.expected:
            d, m = update.deltas[name], live[name]
            a_held, b_held = m.get_buffer(A_NAME), m.get_buffer(B_NAME)
            if d.a.shape != a_held.shape or d.b.shape != b_held.shape:
                raise SyncError(
                    f"{name}: LoRA factors A {tuple(d.a.shape)}, B {tuple(d.b.shape)} do not fit "
                    f"the rollout's A {tuple(a_held.shape)}, B {tuple(b_held.shape)} (rank "
                    f"{self.rank})"
                )
            prints = update.delta_rows[name]
            if prints.shape != (d.b.shape[0], PROBES):
                raise SyncError(f"{name}: {tuple(prints.shape)} row prints for {d.b.shape[0]} rows")
            # the factors as the hook will apply them: in the weight's dtype, the scale in B
            a = d.a.to(a_held.device, a_held.dtype)
            b = (d.b.to(b_held.device, torch.float64) * d.scale).to(b_held.dtype)
            eps = eps_of(a.dtype, d.a.dtype, torch.float32)
            got, tol = factor_prints(a, b, probe(name, a.shape[1]).to(a.device), eps)
            what = f"delta of {name} (held as factors): differs from what the actor sent"
            rows = torch.arange(len(got))
            max_frac = max(max_frac, check_prints(got, prints.to(got.device), tol, what, rows))
            applied = float(b.double().sum(0) @ a.double().sum(1))
            want = update.checksums[name]
            # a cast below fp32 rounds each factor entry by up to eps relative: the sum moves by
            # at most eps (|B| |A|) summed, times two (both factors)
            rounding = 0.0
            if torch.finfo(a.dtype).bits < 32:
                mag = float(b.double().abs().sum(0) @ a.double().abs().sum(1))
                rounding = 2 * torch.finfo(a.dtype).eps * mag
            tol_sum = 1e-4 * max(1.0, abs(want)) + rounding
            err = abs(applied - want)
            if err > tol_sum:
                raise SyncError(
                    f"checksum mismatch for {name}: held factors sum to {applied:.6g}, actor "
                    f"sent {want:.6g} (tolerance {tol_sum:.3g})"
                )
            max_err = max(max_err, err)
            staged[name] = (a, b)
        for name, (a, b) in staged.items():  # commit only after every module verified
            m = live[name]
            m.get_buffer(A_NAME).copy_(a)
            m.get_buffer(B_NAME).copy_(b)
        n = len(self.expected)
        return SyncReport(update.version, update.adapter, n, n, max_err, max_frac)

    def factor_bytes(self) -> int:
        """Bytes of the factors this target holds (what an alias copy adds to the shared base)."""
        return sum(m.get_buffer(k).nbytes for m in self.live().values() for k in (A_NAME, B_NAME))


def factor_prints(a: Tensor, b: Tensor, r: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(B (A r), its tolerance), both (out, PROBES) float64 on the CPU, for factors ``a`` (rank,
    in) and ``b`` (out, rank) held in a dtype of relative rounding ``eps`` against the float64
    prints of the factors before their cast. B's entries round independently: sigma_i =
    eps sqrt(sum_k B_ik^2 (A r)_k^2); A's do too, so (A r)_k is off by eps sqrt(sum_j A_kj^2
    r_j^2) and row i by sqrt(sum_k B_ik^2 of those squared); PRINT_SIGMAS of both, plus float64
    reordering bounded through |B| (|A| |r|)."""
    a64, b64 = a.double(), b.double()
    ar = a64 @ r  # (rank, P)
    got = b64 @ ar
    b2 = b64.square()
    from_b = (b2 @ ar.square()).sqrt()
    from_a = (b2 @ (a64.square() @ r.square())).sqrt()
    reorder = b64.abs() @ (a64.abs() @ r.abs())
    tol = PRINT_SIGMAS * eps * (from_b + from_a) + F64_REL * math.sqrt(a.shape[1]) * reorder
    return got.cpu(), tol.cpu()


def receipt_of_shared(target: SharedBaseTarget, version: int) -> SyncReceipt:
    """The receipt of an alias copy: per trained module, u^T (B A r) over its receipt rows,
    read from the factors its live module's hook applies (a module whose hook is gone reports
    the base, zero). The base rows read on the way are checked against the verified base
    prints: a shared base that changed under the rollout raises here."""
    if target.verified is None:
        raise SyncError("no base row prints: the receipt cannot size the trained modules")
    held, tol = {}, {}
    live = target.live()
    with torch.no_grad():
        for name in target.expected:
            m = live[name]
            a, b, w = m.get_buffer(A_NAME), m.get_buffer(B_NAME), m.weight
            rows, u = receipt_rows(name, w.shape[0])
            r = probe(name, w.shape[1]).to(w.device)
            at = rows.to(w.device)
            got, t = slot_prints(w[at], None, r, eps_of(w.dtype, target.verified.dtypes[name]))
            want = target.verified.rows[name][rows]
            check_prints(
                got, want.to(got.device), t, f"shared base of {name} at receipt time: it changed "
                "after it was verified (the actor must not train the base)", rows,
            )  # fmt: skip
            if not _hooked(m):
                held[name] = torch.zeros(PROBES, dtype=torch.float64)
                tol[name] = torch.zeros(PROBES, dtype=torch.float64)
                continue
            got, t = factor_prints(a, b[at], r, eps_of(a.dtype, torch.float32))
            held[name] = u @ got
            tol[name] = (u.square() @ t.square()).sqrt()
    return SyncReceipt(version, held, tol)
