"""Contract 2's serving layouts: the rollout copy of a model laid out as a server holds it.

The actor trains LoRA on the model's own Linears (``attn.to_q``, ``ff.net.0.proj``, ...). A
serving engine often holds those weights differently: Q, K and V fused into one ``to_qkv``
matrix, or an MLP up-projection split into tensor-parallel row shards, possibly stored in a
different order than their logical one. Each function here re-lays the ROLLOUT copy in place,
keeps its forward unchanged, and returns the ``SlotMap`` that sends each trained module's delta
rows to the weight that now holds them, so ``MergedLoraTarget.apply`` writes them exactly.

The functions are generic over module names: a family calls them with its own attention
prefixes and Linear names (``serving_layout`` in ``models/families/*.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from diffrl.sync.weights import Slot, SlotMap, SyncError


def _linear(model: nn.Module, name: str) -> nn.Linear:
    try:
        mod = model.get_submodule(name)
    except AttributeError:
        mod = None
    if not isinstance(mod, nn.Linear):
        raise SyncError(f"serving layout: {name!r} is not a Linear of the rollout model ({mod!r})")
    return mod


def _replace(model: nn.Module, name: str, new: nn.Module | None) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if new is None:
        delattr(owner, leaf)
    else:
        setattr(owner, leaf, new)


def _blank_linear(
    n_in: int, n_out: int, bias: bool, device: torch.device, dtype: torch.dtype | None = None
) -> nn.Linear:
    """An ``nn.Linear`` whose weights the caller fills, made without drawing from the RNG
    (no init: its tensors are empty): the serving layout then leaves the global generator
    where it was, so the actor's LoRA init, drawn after the rollout is built, is the same
    whether the rollout copy was laid out in this process or in another (the Ray backend)."""
    out = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(out)
    out.in_features, out.out_features = n_in, n_out
    out.weight = nn.Parameter(torch.empty(n_out, n_in, device=device, dtype=dtype))
    b = nn.Parameter(torch.empty(n_out, device=device, dtype=dtype)) if bias else None
    out.register_parameter("bias", b)
    return out


def _concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight.detach() for p in parts])  # (sum out, in)
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias or p.in_features != w.shape[1] for p in parts):
        raise SyncError("serving layout: parts to fuse differ in input width or in having a bias")
    out = _blank_linear(w.shape[1], w.shape[0], has_bias, w.device, w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if has_bias:
            out.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return out.requires_grad_(False)


class RowView(nn.Module):
    """Rows ``rows`` of a fused Linear, standing where one of its parts stood.

    It holds the fused module in a tuple, so the fused weight is registered once (under the
    attention module's ``to_qkv``) and a sync writes it there. It has no ``weight`` of its
    own: a sync that tried to write the old part would fail rather than write nowhere."""

    def __init__(self, fused: nn.Linear, rows: slice) -> None:
        super().__init__()
        self._fused = (fused,)
        self.rows = rows

    def forward(self, x: Tensor) -> Tensor:
        f = self._fused[0]
        weight: Tensor = f.weight
        bias: Tensor | None = f.bias
        rows = self.rows
        if isinstance(weight, DTensor):
            # the fused Linear under FusedColwiseParallel (parallel/tp_sync.shard_rollout): this
            # rank holds its slice of every equal part, in part order, so this part's rows here
            # are the local part at its index; x is the replicated input, the output this
            # rank's columns (its heads)
            weight = cast(DTensor, weight).to_local()
            bias = None if bias is None else cast(DTensor, bias).to_local()
            size = rows.stop - rows.start
            local = weight.shape[0] // (f.out_features // size)
            part = rows.start // size
            rows = slice(part * local, (part + 1) * local)
        return F.linear(x, weight[rows], None if bias is None else bias[rows])


def fuse_qkv(
    model: nn.Module,
    attn_prefixes: Iterable[str],
    q: str = "to_q",
    k: str = "to_k",
    v: str = "to_v",
    fused: str = "to_qkv",
    native: bool = False,
) -> SlotMap:
    """Fuse ``{prefix}.{q,k,v}`` into one Linear ``{prefix}.{fused}`` (weights and biases
    concatenated, Q rows first) for every attention prefix.

    ``native=False`` leaves ``RowView``s of the fused weight in place of q, k and v, so any
    attention processor computes as before. ``native=True`` deletes q, k and v and sets the
    attention's ``fused_projections`` flag, for diffusers classes whose processor then really
    computes with ``to_qkv``/``to_added_qkv`` (FLUX's ``FluxAttention``): fuse every triple of
    an attention module before running it."""
    slots: dict[str, list[Slot]] = {}
    for prefix in attn_prefixes:
        names = [f"{prefix}.{n}" for n in (q, k, v)]
        parts = [_linear(model, n) for n in names]
        lin = _concat_linear(parts)
        _replace(model, f"{prefix}.{fused}", lin)
        start = 0
        for name, part in zip(names, parts, strict=True):
            rows = slice(start, start + part.out_features)
            slots[name] = [Slot(module=f"{prefix}.{fused}", rows=slice(None), dst_rows=rows)]
            _replace(model, name, None if native else RowView(lin, rows))
            start = rows.stop
        if native:
            # nn.Module.__setattr__ is annotated for tensors and modules; it takes any value
            model.get_submodule(prefix).fused_projections = True  # type: ignore[assignment]
    return SlotMap(slots)


def fuse_parts(model: nn.Module, fused: str, parts: list[str]) -> SlotMap:
    """Fuse the Linears ``parts`` (full names, one parent) into one Linear ``fused`` (rows in
    the order given), leaving ``RowView``s in their place, as ``fuse_qkv(native=False)`` does
    for one attention: the layout a TP-sharded rollout keeps of the family's fusions."""
    lins = [_linear(model, n) for n in parts]
    lin = _concat_linear(lins)
    _replace(model, fused, lin)
    slots, start = {}, 0
    for name, part in zip(parts, lins, strict=True):
        rows = slice(start, start + part.out_features)
        slots[name] = [Slot(module=fused, rows=slice(None), dst_rows=rows)]
        _replace(model, name, RowView(lin, rows))
        start = rows.stop
    return SlotMap(slots)


class SwappedShards(nn.Module):
    """A Linear held as ``n`` row shards stored in reversed order (``shards[j]`` holds logical
    shard ``n-1-j``), as a tensor-parallel server whose ranks hold the shards in another order
    would; ``forward`` concatenates them back in logical order, so the output is unchanged."""

    def __init__(self, linear: nn.Linear, n_shards: int) -> None:
        super().__init__()
        out = linear.out_features
        if n_shards < 1 or out % n_shards:
            raise SyncError(f"serving layout: {out} rows do not split into {n_shards} shards")
        h = out // n_shards
        self.n = n_shards
        shards = []
        for j in range(n_shards):
            logical = slice((n_shards - 1 - j) * h, (n_shards - j) * h)
            bias = linear.bias is not None
            s = _blank_linear(linear.in_features, h, bias, linear.weight.device)
            s = s.to(linear.weight.dtype).requires_grad_(False)
            with torch.no_grad():
                s.weight.copy_(linear.weight[logical])
                if bias:
                    s.bias.copy_(linear.bias[logical])
            shards.append(s)
        self.shards = nn.ModuleList(shards)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.shards[self.n - 1 - i](x) for i in range(self.n)], dim=-1)


def split_swapped(model: nn.Module, linear_names: Iterable[str], n_shards: int = 2) -> SlotMap:
    """Replace each Linear by a ``SwappedShards``; trained rows [i*h, (i+1)*h) land in stored
    shard ``n-1-i`` (``{name}.shards.{n-1-i}``)."""
    slots: dict[str, list[Slot]] = {}
    for name in linear_names:
        linear = _linear(model, name)
        h = linear.out_features // n_shards
        _replace(model, name, SwappedShards(linear, n_shards))
        slots[name] = [
            Slot(module=f"{name}.shards.{n_shards - 1 - i}", rows=slice(i * h, (i + 1) * h))
            for i in range(n_shards)
        ]
    return SlotMap(slots)


def merge(*maps: SlotMap) -> SlotMap:
    """One SlotMap from several; a trained module mapped twice is an error."""
    out: dict[str, list[Slot]] = {}
    for m in maps:
        for name, slots in m.slots.items():
            if name in out:
                raise SyncError(f"serving layout maps {name!r} twice")
            out[name] = list(slots)
    return SlotMap(out)


def check_targets(
    model: nn.Module,
    slot_map: SlotMap,
    trained_names: Iterable[str],
    shapes: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Raise SyncError, before any training, for a trained module whose slots name no weight
    of the rollout ``model``, or (given the trained ``shapes``: name -> (out, in)) whose slots
    do not cover its rows exactly or take a different input width."""
    modules = dict(model.named_modules())
    for name in trained_names:
        covered = 0
        for slot in slot_map.slots_for(name):
            weight = getattr(modules.get(slot.module), "weight", None)
            if not isinstance(weight, Tensor):
                raise SyncError(
                    f"trained module {name!r} maps to {slot.module!r}, which is no weight of "
                    "the rollout model; its update could not be applied"
                )
            dst = weight[slot.dst_rows]
            if shapes and name in shapes:
                out, cols = shapes[name]
                src = torch.empty(out, 0)[slot.rows]
                if dst.shape[0] != src.shape[0] or dst.shape[1] != cols:
                    raise SyncError(
                        f"{name} rows {slot.rows} ({src.shape[0]} x {cols}) do not fit "
                        f"{slot.module} rows {slot.dst_rows} {tuple(dst.shape)}"
                    )
                covered += src.shape[0]
        if shapes and name in shapes and covered != shapes[name][0]:
            raise SyncError(f"{name}: slots cover {covered} of its {shapes[name][0]} rows")
