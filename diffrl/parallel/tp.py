"""Tensor parallelism, applied outside the model from a plan: module-path pattern -> style.

``diffrl train`` reaches ``apply_plan`` for the text encoders' plans under ``parallel.etp``
(``parallel/etp.py``) and for the DiT's under ``parallel.tp`` > 1, through
``parallel/tp_lora.py`` (the plan rewritten for the actor's LoRA wrappers); tests and
``diffrl plan`` (which reads the plans to count bytes) reach it too. This module holds the
generic styles; each family's plan is data in its record (``FamilySpec.tp_plan``, and
``etp_plans`` for its text encoders, ``models/families/_encoder_plans.py``).

A plan is a plain dict read top to bottom like torchtitan's ``parallelize_llama``: attention's
Q/K/V projections column-sharded (each rank computes ``heads / tp`` whole heads), the output
projection row-sharded (one all-reduce per attention), and the MLP up column-, down row-sharded
(one all-reduce per MLP). Patterns are dotted module paths whose parts may hold ``fnmatch``
wildcards (``transformer_blocks.*.attn.to_q``), as ``parallelize_module`` reads them; a pattern
needs to match at least one module, not every block (SD3's last block has no ``to_add_out``,
only its first 13 have ``attn2``).

Besides torch's ``ColwiseParallel`` / ``RowwiseParallel``, these styles are defined here:

- ``LocalHeads``: after Q/K/V are column-sharded an attention module sees ``heads / tp`` heads,
  but diffusers' processors reshape with the count they read off the module
  (``query.unflatten(-1, (attn.heads, -1))``, ``head_dim = inner_dim // attn.heads``), so the
  plan divides those attributes on each rank's module. It also checks counts the module does
  not read (Qwen3's ``config.num_key_value_heads``), so a mesh that does not divide them fails
  before any work.
- ``PerHeadNorm``: a qk-norm over ``head_dim`` runs per head, so its forward needs nothing, but
  its weight is shared by all heads and each rank sees only its own: the weight becomes a
  ``Replicate`` DTensor so its gradient is summed over the mesh.
- ``ShardedRMSNorm``: Wan normalises q and k across all heads (an RMSNorm over ``inner_dim``),
  so a rank's column shard cannot be normalised alone; the style swaps the norm for one whose
  sum of squares is all-reduced across the mesh (``apply_plan`` puts a style's returned module
  in place of the old one).
- ``FusedColwiseParallel(chunks)``: a Linear that computes several projections side by side
  and is then ``chunk``-ed (the SwiGLU of H3's feed-forward: ``[up; gate]``); each rank gets its
  slice of every chunk, where a plain column shard would pair the wrong halves.
- ``FusedRowwiseParallel(chunks)``: its row-sharded counterpart, a Linear whose input is several
  column-sharded tensors concatenated (FLUX's single blocks: ``proj_out(cat([attn, mlp]))``).
  Each rank's input is its slice of every chunk side by side, so the weight's input columns are
  sharded the same strided way (equal chunks: FLUX's ``[attn; mlp]`` is 1 + 4 chunks of the
  width, with ``proj_mlp`` a ``FusedColwiseParallel(4)`` so the MLP's slices come in that order).
- ``LocalRope(attrs, kwargs)``: ``LocalHeads`` for an attention that applies RoPE to the whole
  projected ``(B, S, heads * head_dim)`` before splitting heads (LTX-2): the (cos, sin) tables
  it is passed are cut to this rank's heads' columns (last dim) or heads (dim 1 of a 4-D table).

An entry wrapped in ``optional(...)`` may match nothing: modules only some checkpoints of a
family have (SD3.5's qk-norm, absent from SD3.0; its dual attention, absent from SD3.0 and the
``sd3-shapes`` preset). ``apply_plan`` resolves every pattern and checks every head count before
it shards anything, so a plan that does not fit the model (an unmatched pattern, heads that the
mesh size does not divide) raises a ``ConfigError`` naming what is wrong and leaves the module
untouched. The plans are for unfused attention: a model after diffusers' ``fuse_projections()``
(``to_qkv``) fails ``apply_plan`` on its unmatched ``to_q``.

The plans cover each block's attention and MLP, where the compute is; embeddings, AdaLN
modulation and output heads stay replicated (every rank computes them whole).
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from diffrl.errors import ConfigError

Plan = dict[str, ParallelStyle]


class LocalHeads(ParallelStyle):
    """Divide the head counts an attention module reads (``attrs``, e.g. ``heads``) by the mesh
    size, so its reshape sees this rank's ``heads / tp`` heads; ``check`` names counts (dotted,
    e.g. ``config.num_key_value_heads``) that must divide too but stay as they are (the module
    reshapes with ``-1``, and the config is shared by every layer)."""

    def __init__(self, *attrs: str, check: tuple[str, ...] = ()) -> None:
        self.attrs, self.check = attrs, check

    def counts(self, module: nn.Module) -> dict[str, int]:
        out = {}
        for name in (*self.attrs, *self.check):
            value = module
            for part in name.split("."):
                value = getattr(value, part)
            out[name] = int(value)
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.attrs:
            setattr(module, name, getattr(module, name) // device_mesh.size())
        return module


class PerHeadNorm(ParallelStyle):
    """A qk-norm over ``head_dim`` whose input holds this rank's heads along dim ``heads_dim``
    (SD3: ``(B, H, S, D)`` -> 1; H3: ``(B, S, H, D)`` -> 2). The forward is per head and needs
    nothing, but the weight is shared by every head and a rank sees ``heads / tp`` of them, so
    its gradient would be a partial sum. Here the weight is a ``Replicate`` DTensor and the input
    a ``Shard(heads_dim)`` one, so DTensor sums the weight's gradient over the mesh (and FSDP2
    composes with it as with any TP parameter)."""

    def __init__(self, heads_dim: int) -> None:
        self.heads_dim = heads_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                dp = distribute_tensor(p, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))

        def to_dtensor(mod, inputs, mesh):
            placement = [Shard(self.heads_dim)]
            return tuple(DTensor.from_local(x, mesh, placement, run_check=False) for x in inputs)

        def to_local(mod, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, replicate, to_dtensor, to_local)


class ShardedRMSNorm(ParallelStyle):
    """An ``nn.RMSNorm`` over a dimension that arrives column-sharded (Wan's q/k norm across
    heads): swapped for a ``ColumnShardedRMSNorm`` holding its weight sharded like the columns.
    (``torch.nn.RMSNorm`` itself cannot run on a ``Shard(-1)`` DTensor: its in-place ``add_`` of
    eps on the partial mean-square has no sharding strategy.)"""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return ColumnShardedRMSNorm(module, device_mesh, self.src_data_rank)


class ColumnShardedRMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2) + eps) * weight`` over a last dimension split across ``mesh``:
    the mean-square is all-reduced (one ``(..., 1)`` tensor per rank), the rest is local.
    Computed in fp32 and cast back before the weight, as ``nn.RMSNorm``."""

    def __init__(self, norm: nn.RMSNorm, mesh: DeviceMesh, src_data_rank: int | None = 0) -> None:
        super().__init__()
        self.mesh, self.eps = mesh, norm.eps
        self.weight = None
        if norm.weight is not None:
            w = distribute_tensor(norm.weight, mesh, [Shard(0)], src_data_rank=src_data_rank)
            self.weight = nn.Parameter(w, requires_grad=norm.weight.requires_grad)

    def forward(self, x: Tensor) -> Tensor:  # (..., D / tp): this rank's columns
        # All in DTensor, not a local all-reduce: a rank's share of the mean-square's gradient
        # comes from its own columns only, and DTensor sums those partial gradients.
        xd = DTensor.from_local(x.float(), self.mesh, [Shard(x.ndim - 1)], run_check=False)
        eps = torch.finfo(torch.float32).eps if self.eps is None else self.eps
        # a sum, not a mean: the backward of a Partial(avg) reduction is not supported
        ss = xd.pow(2).sum(-1, keepdim=True).redistribute(self.mesh, [Replicate()])  # (..., 1)
        ms = ss / xd.shape[-1]  # the global D
        y = (xd * torch.rsqrt(ms + eps)).to(x.dtype)
        return (y if self.weight is None else y * self.weight).to_local()


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for one Linear that computes ``chunks`` projections side by side and
    whose output the module then splits with ``chunk(chunks, -1)`` (diffusers' SwiGLU: ``[up;
    gate]``; a fused ``to_qkv``: 3). A contiguous column shard would hand rank 0 all of ``up``;
    here each rank keeps its slice of every chunk (DTensor's ``_StridedShard(0, split_factor=
    chunks)``, the placement FSDP2 uses over TP shards; private in torch), so its local output
    ``[up_r; gate_r]`` splits into matching halves. The Linear's matmul needs no communication
    (the output is strided-sharded the same way) and the weight's global view stays the
    checkpoint's.

    Caveat (torch 2.13): ``fully_shard`` over such a weight (dp x tp) keeps the forward exact,
    but the 2-D placement it records, ``(_StridedShard(0, sf=2), _StridedShard(0, sf=2))``,
    does not describe the local data: ``full_tensor()`` (and so a gathered state dict or a
    weight sync) comes back row-permuted, though each rank's shard and its gradient are right.
    Plain Colwise/Rowwise weights compose with FSDP2 exactly."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placement = [_StridedShard(0, split_factor=self.chunks)]
        for pname, p in list(module.named_parameters(recurse=False)):
            dp = distribute_tensor(p, device_mesh, placement, src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()  # already strided over the chunks: no redistribute


class FusedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a Linear whose input is ``chunks`` equal column-sharded tensors
    concatenated (``cat([attn, mlp], -1)``): rank ``r``'s input holds slice ``r`` of every chunk
    side by side, so its weight holds the same input columns (``_StridedShard(1, split_factor=
    chunks)``; the bias, added after the all-reduce, replicated). The input arrives as a local
    tensor and is read with that placement; the output is all-reduced as the plain style's. The
    weight's global view stays the checkpoint's (``full_tensor()`` is exact on a 1-D mesh; the
    ``FusedColwiseParallel`` caveat under FSDP2 holds here too)."""

    def __init__(self, chunks: int) -> None:
        placement = _StridedShard(-1, split_factor=chunks)
        super().__init__(input_layouts=placement)
        self.desired_input_layouts = (placement,)
        self.chunks = chunks

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        strided = _StridedShard(1, split_factor=self.chunks)
        for pname, p in list(module.named_parameters(recurse=False)):
            placement = strided if pname == "weight" else Replicate()
            dp = distribute_tensor(p, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))


class LocalRope(LocalHeads):
    """``LocalHeads`` for an attention whose RoPE runs on the projected ``(B, S, heads *
    head_dim)`` before the heads are split (LTX-2): the ``(cos, sin)`` tables passed as the
    keyword arguments ``kwargs`` cover every head, so a forward pre-hook cuts them to this rank's
    heads: a 3-D table ``(B, S, heads * head_dim)`` (interleaved RoPE) by its last dimension, a
    4-D one ``(B, heads, S, head_dim / 2)`` (split RoPE) by dim 1. Heads are column-contiguous
    (head ``h`` owns columns ``h * head_dim ...``), so rank ``r``'s slice ``r`` of either is its
    heads' part. The tables are computed from positions, so nothing flows back through the cut."""

    def __init__(self, *attrs: str, kwargs: tuple[str, ...]) -> None:
        super().__init__(*attrs)
        self.kwargs = kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()

        def cut(table: Tensor) -> Tensor:
            dim = 1 if table.ndim == 4 else table.ndim - 1
            if table.shape[dim] % tp:
                raise ConfigError(
                    f"TP: a RoPE table of shape {tuple(table.shape)} for {type(module).__name__} "
                    f"does not split over {tp} ranks along dim {dim}"
                )
            return table.chunk(tp, dim)[rank]

        def hook(mod, args, kwargs):
            if len(args) > 1:  # the tables come by keyword in every call diffusers makes
                raise ConfigError(
                    f"TP ({type(mod).__name__}): LocalRope expects its RoPE tables by keyword "
                    f"{self.kwargs}, got {len(args)} positional arguments"
                )
            for name in self.kwargs:
                if kwargs.get(name) is not None:
                    kwargs[name] = tuple(cut(t) for t in kwargs[name])
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def optional(style: ParallelStyle) -> ParallelStyle:
    """Mark a plan entry whose pattern may match nothing (a module only some checkpoints have)."""
    style.optional = True
    return style


# --- applying a plan ---------------------------------------------------------------------------


def resolve(module: nn.Module, plan: Plan) -> dict[str, list[str]]:
    """Each pattern of ``plan`` -> the module paths it matches (part by part, ``fnmatch``), or
    a ConfigError naming every pattern that matches nothing (bar optional styles')."""
    names = [n for n, _ in module.named_modules() if n]
    parts = {n: n.split(".") for n in names}
    out = {}
    for pattern in plan:
        want = pattern.split(".")
        out[pattern] = [
            n for n in names if len(parts[n]) == len(want) and all(map(fnmatch, parts[n], want))
        ]
    unmatched = [p for p, s in plan.items() if not out[p] and not getattr(s, "optional", False)]
    if unmatched:
        raise ConfigError(
            f"TP plan for {type(module).__name__}: no submodule matches {unmatched} "
            f"(a fused or renamed projection? first module paths: {names[:8]})"
        )
    return out


def _problems(module: nn.Module, style: ParallelStyle, tp: int) -> list[str]:
    """What keeps ``style`` from applying to ``module`` on a mesh of ``tp``: a count the mesh
    does not divide ("name=value"), or a module torch's Colwise/Rowwise cannot shard."""
    kinds = (nn.Linear, nn.Embedding) if isinstance(style, ColwiseParallel) else (nn.Linear,)
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(module, kinds):
        return [f" is a {type(module).__name__}, not a Linear (wrapped, e.g. by LoRA, before TP?)"]
    if isinstance(style, FusedColwiseParallel):
        out = module.out_features
        return [f".out_features={out} ({style.chunks} fused)"] if out % (style.chunks * tp) else []
    if isinstance(style, FusedRowwiseParallel):
        n = module.in_features
        return [f".in_features={n} ({style.chunks} fused)"] if n % (style.chunks * tp) else []
    if isinstance(style, LocalHeads):
        try:
            counts = style.counts(module)
        except AttributeError as e:
            raise ConfigError(f"TP plan: {type(module).__name__} has no {e.name!r}") from e
        return [f".{k}={v}" for k, v in counts.items() if v % tp]
    return []


def check_plan(module: nn.Module, tp: int, plan: Plan) -> dict[str, list[str]]:
    """``resolve``, plus every ``LocalHeads`` count (and each chunk of a ``FusedColwiseParallel``
    Linear) divisible by ``tp`` and every Colwise/Rowwise target a module they shard: else a
    ConfigError naming each module and what is wrong. Touches nothing; returns the paths."""
    paths = resolve(module, plan)
    bad = [
        f"{path}{what}"
        for pattern, style in plan.items()
        for path in paths[pattern]
        for what in _problems(module.get_submodule(path), style, tp)
    ]
    if bad:
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise ConfigError(
            f"TP plan on a mesh of {tp}: every head count and fused chunk must divide by {tp} "
            f"and every Colwise/Rowwise target be a Linear; not {', '.join(bad[:4])}{more}"
        )
    return paths


def apply_plan(module: nn.Module, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Shard ``module`` in place over the 1-D ``mesh`` (the TP mesh for a DiT, the ETP mesh for a
    text encoder) as ``plan`` says; every pattern and head count is checked first, so a plan
    that does not fit raises a ConfigError before anything is sharded. The weights each rank
    holds come from rank 0's copy (``parallelize_module``'s ``src_data_rank=0``)."""
    if mesh.ndim != 1:
        raise ConfigError(f"apply_plan takes a 1-D mesh (one axis, e.g. mesh['tp']); got {mesh}")
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise ConfigError(
            f"apply_plan: {type(module).__name__} already has DTensor parameters (TP applied "
            "twice, or FSDP before TP: apply the TP plan first)"
        )
    paths = check_plan(module, mesh.size(), plan)
    for pattern, style in plan.items():
        for path in paths[pattern]:
            sub = module.get_submodule(path)
            new = parallelize_module(sub, mesh, style)
            if new is not sub:  # a style that swaps the module (ShardedRMSNorm)
                parent, _, leaf = path.rpartition(".")
                module.get_submodule(parent).register_module(leaf, new)
    return module
