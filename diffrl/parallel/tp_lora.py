"""Tensor parallelism of the actor: a family's TP plan applied to a peft-wrapped model, the LoRA
adapters sharded with the layer they wrap.

peft puts each targeted Linear ``P`` under a wrapper with ``P.base_layer`` (the frozen Linear)
and, per adapter (``default``, ``old``, ``ema``), ``P.lora_A.<adapter>`` (in -> r) and
``P.lora_B.<adapter>`` (r -> out); its forward is ``base_layer(x) + lora_B(lora_A(x)) * scale``.
A plan entry on ``P`` becomes:

- ``ColwiseParallel``: ``P.base_layer`` and every ``P.lora_B.*`` column-sharded (each rank
  computes its ``out / tp`` outputs, and the sum adds matching local columns); ``P.lora_A.*``
  stays a plain module computing the whole ``(.., r)`` on the replicated input. The gradient
  reaching ``lora_A``'s output is a partial sum over the ranks' columns; ``lora_B``'s
  Colwise input hook (``DTensor.from_local`` as ``Replicate``) all-reduces it in the backward,
  so every rank's ``lora_A`` gradient is the whole one (``tests/parallel/test_tp_lora_gloo.py``
  checks it against one process).
- ``RowwiseParallel``: ``P.base_layer`` and every ``P.lora_A.*`` row-sharded (each reads this
  rank's ``in / tp`` input columns; the ``(.., r)`` output is all-reduced as the base's is);
  ``P.lora_B.*`` stays plain, on the whole ``(.., r)``, its output replicated like the base's.
- ``FusedColwiseParallel(chunks)``: as Colwise, ``lora_B`` with the same chunked placement;
  ``FusedRowwiseParallel(chunks)`` as Rowwise, ``lora_A`` reading the same strided input columns
  (no family's LoRA targets such a Linear today: FLUX leaves its single blocks' ``proj_out`` out).

Other styles (``LocalHeads``, ``PerHeadNorm``, ...) and entries on modules LoRA does not wrap
apply as in ``tp.apply_plan``, which applies the rewritten plan (every check first).

So every rank holds the same replicated factors and its own shard of the sharded ones; the
elementwise updates (AdamW, the EMA and ``old`` blends) act shard by shard, and whatever leaves
the actor (weight sync, checkpoints) is gathered to whole tensors (``full`` below): the
one-process format, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from diffrl.errors import ConfigError
from diffrl.models.family import transformer_root
from diffrl.parallel.tp import Plan, apply_plan, resolve


def lora_plan(root: nn.Module, plan: Mapping[str, Any]) -> Plan:
    """``plan`` (patterns under ``root``, the transformer) rewritten for the LoRA-wrapped
    modules it matches, as the module docstring says. A pattern whose matches are all wrapped
    becomes pattern-level entries; one matching some wrapped and some plain modules is spelled
    out module by module."""
    matches = resolve(root, dict(plan))
    out: Plan = {}
    for pattern, style in plan.items():
        paths = matches[pattern]
        wrapped = [p for p in paths if isinstance(root.get_submodule(p), LoraLayer)]
        if not wrapped or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            out[pattern] = style
            continue
        if len(wrapped) == len(paths):
            out.update(_lora_entries(pattern, root.get_submodule(wrapped[0]), style))
            continue
        for path in paths:
            mod = root.get_submodule(path)
            entries = _lora_entries(path, mod, style) if path in wrapped else {path: style}
            out.update(entries)
    return out


def _lora_entries(prefix: str, layer: nn.Module, style) -> Plan:
    """The entries for one wrapped module (or a pattern of like ones): the base layer with
    ``style``, and the factor the style shards (B for Colwise, A for Rowwise) per adapter."""
    assert isinstance(layer, LoraLayer)
    factor = "lora_B" if isinstance(style, ColwiseParallel) else "lora_A"
    entries: Plan = {f"{prefix}.base_layer": style}
    for adapter in getattr(layer, factor):
        entries[f"{prefix}.{factor}.{adapter}"] = style
    return entries


def apply_lora_tp(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, Any]) -> nn.Module:
    """Shard the peft-wrapped family model ``model`` in place over the 1-D TP ``mesh`` with its
    family's ``plan`` (adapters sharded with their layers); every pattern and head count is
    checked before anything is sharded (``tp.apply_plan``)."""
    root = transformer_root(model)
    apply_plan(root, mesh, lora_plan(root, plan))
    return model


def tp_hook(
    mesh: DeviceMesh, plan: Mapping[str, Any] | None, family: str, rollout_sharded: bool = False
):
    """The actor's ``tensor_parallel`` hook for ``mesh`` (the ``tp`` axis), or a ConfigError
    naming the family when it declares no TP plan. ``rollout_sharded``: the rollout's copies
    are sharded over the same mesh (``parallel.rollout``), which its console line says."""
    if plan is None:
        raise ConfigError(
            f"parallel.tp={mesh.size()}: model family {family!r} declares no TP plan "
            "(FamilySpec.tp_plan); set parallel.tp=1"
        )

    def hook(model: nn.Module) -> str:
        """Shard ``model``; returns the layout applied, in a line for the console."""
        apply_lora_tp(model, mesh, plan)
        params = dict(model.named_parameters())
        lora = [p for n, p in params.items() if "lora_" in n]
        base_sharded = sum(isinstance(p, DTensor) for n, p in params.items() if "lora_" not in n)
        rollout = (
            "the rollout's and evaluator's DiT copies sharded with the same plan over the "
            "same tp group, synced shard by shard (parallel.rollout=sharded)"
            if rollout_sharded
            else "the rollout's and evaluator's DiT copies whole on every rank, synced with "
            "the gathered LoRA (parallel.rollout=replicated)"
        )
        return (
            f"tensor parallel: {family}'s TP plan over tp={mesh.size()} (ranks "
            f"{mesh.mesh.tolist()}); {base_sharded} of {len(params) - len(lora)} base and "
            f"{sum(isinstance(p, DTensor) for p in lora)} of {len(lora)} LoRA tensors sharded, "
            f"the rest replicated; {rollout}"
        )

    return hook


# --- DTensor-aware helpers for the actor's adapter tensors --------------------------------------


def full(t: Tensor) -> Tensor:
    """The whole tensor: a sharded factor gathered (collective over its mesh), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: Tensor) -> Tensor:
    """This rank's shard of a sharded factor (its storage: writes land in the parameter), else
    ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def like(whole: Tensor, target: Tensor) -> Tensor:
    """``whole`` laid out as ``target`` (split locally, no communication: every rank holds the
    same whole tensor), ready to ``copy_`` into it."""
    if not isinstance(target, DTensor):
        return whole
    return distribute_tensor(
        whole.to(target.device), target.device_mesh, target.placements, src_data_rank=None
    )


def total_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm over every gradient, sharded ones counted once (their squares summed over the
    mesh): a plain 0-d tensor, the same on every rank."""
    squares = []
    for g in grads:
        sq = g.float().pow(2).sum()
        squares.append(sq.full_tensor() if isinstance(sq, DTensor) else sq)
    return torch.stack(squares).sum().sqrt()


def clip_grads(params: list[Tensor], max_norm: float) -> Tensor:
    """``clip_grad_norm_`` over a mix of sharded and plain adapters (torch's groups tensors by
    device and cannot stack a DTensor's norm with a plain one's); returns the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = total_norm(grads)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local(g).mul_(coef.to(g.device))
    return norm
