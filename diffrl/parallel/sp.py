"""Ulysses sequence parallelism for DiT attention: an all-to-all that swaps a sequence shard for
a head shard, so each rank attends over the *whole* sequence with ``H / sp`` of the heads.

Parked: reached only from tests (``tests/parallel/test_sp_gloo.py``); the parallel issue (38)
wires it into `diffrl train`. A family's record says whether its class has a ``_cp_plan``
(``FamilySpec.sp_plan``).

Each of the ``sp`` ranks of a group holds a contiguous slice of the sequence (rank r holds
tokens ``[r * S/sp, (r+1) * S/sp)``). Around attention::

    q, k, v  (B, S/sp, H, D)  --all-to-all-->  (B, S, H/sp, D)   # sequence gathered, heads split
    SDPA over the full sequence, H/sp local heads
    out      (B, S, H/sp, D)  --all-to-all-->  (B, S/sp, H, D)   # back to a sequence shard

Everything outside attention (projections, norms, MLPs) is per token and runs on the shard as it
is. Anchor: DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509).

Two ways in:

* :func:`ulysses_attention`: the op itself over tensors, a few lines around SDPA, differentiable
  (the all-to-all's backward is the reverse all-to-all). It is the reference for what diffusers
  does, and the path for a model of our own with no context-parallel plan.
* :func:`enable_ulysses`: a diffusers transformer through diffusers' own machinery: the class's
  ``_cp_plan`` (which inputs to split, which outputs to gather) applied by
  ``ModelMixin.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp, mesh=...))``,
  whose attention backends then run ``TemplatedUlyssesAttention``. We do not write a second plan.

Which families declare ``_cp_plan`` (diffusers 0.42.1): Wan (``WanTransformer3DModel``), Flux
(``FluxTransformer2DModel``), Qwen-Image (``QwenImageTransformer2DModel``), LTX-2
(``LTX2VideoTransformer3DModel``), MiniMax-H3 (``MiniMaxH3Transformer3DModel``). SD3
(``SD3Transformer2DModel``) declares none: :func:`enable_ulysses` refuses it.

What blocks diffusers' path on a machine with no accelerator (CPU + gloo): not the collectives
(gloo runs ``all_to_all_single``, plain and functional, in torch 2.13) and not the attention (the
"native" SDPA backend supports context parallelism on any device), but one line of bookkeeping,
``ModelMixin._resolve_parallel_config`` (``diffusers/models/modeling_utils.py``, line 1719)::

    device = torch.device(device_type, rank % torch.accelerator.device_count())

which divides by zero when there is no accelerator. The device it computes is only recorded on
the config. :func:`enable_ulysses` refuses such a machine with that explanation rather than
patching diffusers; ``tests/parallel/test_sp_gloo.py`` shows (with ``device_count`` stubbed in the
test's rank processes only) that the rest of the path, hooks and all-to-alls, matches the
unsharded transformer over gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from diffrl.errors import ConfigError, DiffrlError

KEY = "parallel.sp"  # the config key error messages name


def check_heads(heads: int, sp: int) -> None:
    """Ulysses gives each rank ``heads / sp`` whole heads: ``ConfigError`` unless sp divides."""
    if heads % sp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(
            f"{KEY}={sp}: Ulysses sequence parallelism splits the {heads} attention heads across "
            f"the {sp} ranks of the group, so sp must divide {heads}; set {KEY} to one of {ok}"
        )


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Equal chunks of dim 0 to each rank in turn; differentiable (backward: the reverse)."""
    out = funcol.all_to_all_single_autograd(x, None, None, group)
    return funcol.wait_tensor(out)  # the next permute needs the data, not a pending handle


def _seq_to_heads(x: Tensor, sp: int, group: dist.ProcessGroup) -> Tensor:
    """(B, S/sp, H, D) sequence shard -> (B, S, H/sp, D) head shard."""
    b, s_local, h, d = x.shape
    # Chunk j along dim 0 goes to rank j: this rank's tokens of head group j.
    send = x.reshape(b, s_local, sp, h // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group)
    # Chunk j received is rank j's tokens of our head group; ranks hold consecutive slices.
    return recv.permute(1, 0, 2, 3, 4).reshape(b, sp * s_local, h // sp, d)


def _heads_to_seq(x: Tensor, sp: int, group: dist.ProcessGroup) -> Tensor:
    """(B, S, H/sp, D) head shard -> (B, S/sp, H, D) sequence shard (the inverse)."""
    b, s, h_local, d = x.shape
    send = x.reshape(b, sp, s // sp, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = _all_to_all(send, group)
    # Chunk i received is head group i of our tokens: heads in rank order.
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h_local, d)


def ulysses_attention(
    q: Tensor,  # (B, S_q/sp, H, D): this rank's slice of the query sequence
    k: Tensor,  # (B, S_kv/sp, H, D)
    v: Tensor,  # (B, S_kv/sp, H, D)
    group: dist.ProcessGroup,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:  # (B, S_q/sp, H, D): attention over the whole sequence, this rank's slice
    """Full-sequence attention on sequence shards: equal to SDPA on the gathered q, k, v, sliced.

    Every rank of ``group`` calls it in step with its own contiguous, equal-length slice of the
    sequence (S divisible by sp; e.g. 18 tokens over 2 ranks is 9 each). The heads must divide
    by sp (checked before any communication). Gradients flow back through both all-to-alls.
    """
    sp = dist.get_world_size(group)
    check_heads(q.shape[2], sp)
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"q, k, v need the same heads; got {q.shape}, {k.shape}, {v.shape}")
    q, k, v = (_seq_to_heads(x, sp, group) for x in (q, k, v))  # (B, S, H/sp, D)
    # SDPA takes (B, heads, S, D).
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, scale=scale
    ).transpose(1, 2)
    return _heads_to_seq(out, sp, group)


def _sp_mesh(mesh_or_group: DeviceMesh | dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """The 1-D SP mesh: the ``sp`` axis of a main mesh (``Meshes.main``), a 1-D mesh as it is,
    or a process group wrapped as one."""
    if not isinstance(mesh_or_group, DeviceMesh):
        return DeviceMesh.from_group(mesh_or_group, device_type, mesh_dim_names=("sp",))
    if mesh_or_group.ndim == 1:
        return mesh_or_group
    if "sp" not in (mesh_or_group.mesh_dim_names or ()):
        raise ValueError(
            f"a mesh of {mesh_or_group.ndim} axes needs an 'sp' axis; got {mesh_or_group}"
        )
    return mesh_or_group["sp"]


def enable_ulysses(transformer: nn.Module, mesh_or_group: DeviceMesh | dist.ProcessGroup) -> None:
    """Shard ``transformer``'s sequence over an SP group with diffusers' own ``_cp_plan``.

    Collective: every rank of the group calls it, in step, on a replica with the same weights.

    Does: checks the class declares ``_cp_plan`` and that sp divides
    ``config.num_attention_heads``, then calls ``enable_parallelism`` with
    ``ContextParallelConfig(ulysses_degree=sp, mesh=...)``. From then on each forward takes the
    *full* inputs on every rank; the plan's hooks split them along the sequence, every attention
    runs Ulysses, and the output is gathered, so each rank returns the full output. Diffusers
    checks that the attention backend supports context parallelism ("native" SDPA does; a
    backend that does not raises there, naming those that do).

    Does not cover: a family with no ``_cp_plan`` (SD3: ``ConfigError``, use ``parallel.sp=1``);
    ring attention; sequence lengths not divisible by sp (diffusers' ``ulysses_anything`` is not
    exposed); combining with diffusers' own TP in one config (diffusers refuses; our TP plans are
    applied separately); calling it twice; machines with no accelerator (``DiffrlError``, see the
    module docstring). Parameter gradients of the sharded model are each rank's share: all-reduce
    them over the SP group (FSDP over a mesh that includes ``sp`` does). A plan that leaves the
    text unsplit (Wan's) sends cross-attention's whole text keys through the all-to-all too:
    each rank then attends over sp identical copies, exact (softmax weighs copies equally) but
    sp times that attention's work.
    """
    family = type(transformer).__name__
    if getattr(transformer, "_cp_plan", None) is None:
        raise ConfigError(
            f"{KEY}: {family} declares no context-parallel plan (`_cp_plan`) in diffusers, so "
            f"Ulysses sequence parallelism is not available for it; set {KEY}=1"
        )
    sp_mesh = _sp_mesh(mesh_or_group, next(transformer.parameters()).device.type)
    sp = sp_mesh.size()
    check_heads(transformer.config.num_attention_heads, sp)
    if torch.accelerator.device_count() == 0:
        raise DiffrlError(
            f"{KEY}={sp}: diffusers' context parallelism needs an accelerator: "
            "ModelMixin._resolve_parallel_config computes "
            "`rank % torch.accelerator.device_count()`, which is 0 on this machine; run on GPUs "
            f"(or set {KEY}=1)"
        )
    from diffusers import ContextParallelConfig

    # ContextParallelConfig wants a ("ring", "ulysses") mesh; ring degree 1 is Ulysses alone.
    # ``_unflatten`` (torch 2.13) reshapes the sp mesh, reusing its ranks.
    mesh = sp_mesh._unflatten(0, (1, sp), ("ring", "ulysses"))
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp, mesh=mesh))
