"""Ulysses sequence parallelism for DiT attention: an all-to-all that swaps a sequence shard for
a head shard, so each rank attends over the *whole* sequence with ``H / sp`` of the heads.

``diffrl train`` applies it to the actor under ``parallel.sp`` > 1 (:func:`sp_hook`, called by
``ActorEngine`` after TP, whose heads it splits again, and before precision, activation
checkpointing, compile and FSDP2, torchtitan's order); the rollout stays unsharded
(every rank of an sp group holds a whole, replicated rollout copy). A family's record says
whether its class has a ``_cp_plan`` (``FamilySpec.sp_plan``); what each plan splits is listed
in ``docs/parallel.md``.

Each of the ``sp`` ranks of a group holds a contiguous slice of the sequence (rank r holds
tokens ``[r * S/sp, (r+1) * S/sp)``). Around attention::

    q, k, v  (B, S/sp, H, D)  --all-to-all-->  (B, S, H/sp, D)   # sequence gathered, heads split
    SDPA over the full sequence, H/sp local heads
    out      (B, S, H/sp, D)  --all-to-all-->  (B, S/sp, H, D)   # back to a sequence shard

Everything outside attention (projections, norms, MLPs) is per token and runs on the shard as it
is. Anchor: DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509).

Two ways in:

* :func:`ulysses_attention`: the op itself over tensors, a few lines around SDPA, differentiable
  (the all-to-all's backward is the reverse all-to-all), on shards of any lengths. It is what
  every attention of a transformer under :func:`enable_ulysses` runs, and the path for a model
  of our own with no context-parallel plan.
* :func:`enable_ulysses`: a diffusers transformer through diffusers' own machinery: the class's
  ``_cp_plan`` (which inputs to split, which outputs to gather) applied by
  ``ModelMixin.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp, mesh=...,
  ulysses_anything=True))``, whose attention backends then hand every attention to
  :func:`ulysses_attention` (see "Lengths" below). We do not write a second plan.

Which families declare ``_cp_plan`` (diffusers 0.42.1): Wan (``WanTransformer3DModel``), Flux
(``FluxTransformer2DModel``), Qwen-Image (``QwenImageTransformer2DModel``), LTX-2
(``LTX2VideoTransformer3DModel``), MiniMax-H3 (``MiniMaxH3Transformer3DModel``). SD3
(``SD3Transformer2DModel``) declares none: :func:`enable_ulysses` refuses it. LTX-2's plan
splits the video stream only (see :data:`REFUSED`), so ``diffrl train`` refuses it too.

Gradients. The plan's split is a plain slice and its gather's backward hands each rank the
slice of the output gradient for its own tokens, so every parameter's gradient on a rank is the
share of its tokens; the whole gradient is the sum over the sp group (measured against one
process, the shares unequal to the whole and their sum equal to it, for H3, Wan, FLUX and
Qwen-Image: ``tests/parallel/test_sp_train_gloo.py``). A stream that is not split (Wan's
text; its cross-attention keys go through the all-to-all as sp identical copies, exact, sp
times that attention's work) still gets a share per rank, as the copies split the attention
weights. The actor sums the adapters' gradients over the sp group before clipping.

Lengths. A split length need not divide by sp: H3's packed sequence is text + keyframes +
audio + video rows, and the text length is each prompt's own (AVBench's prompts give 260 and 261
rows). :func:`enable_ulysses` sets diffusers' ``ulysses_anything``: the plan's hooks cut with
``tensor_split`` (131 and 130 rows) and gather what each rank holds, and the attention goes
through :func:`ulysses_attention`, which takes shards of any lengths. diffusers' own attention
for that mode (``TemplatedUlyssesAnythingAttention``) has no backward in 0.42.1, so
:func:`enable_ulysses` puts :class:`_UlyssesAnything` in its place in
``diffusers.models.attention_dispatch`` (only a config with ``ulysses_anything`` reaches it).
Padding was not an option: none of the plans' attentions takes a mask over padded rows. Each
rank must hold at least one row of every split length (:func:`check_lengths`, a
``ConfigError`` naming the rows before the forward; the ranks of a group hold the same rows,
so they raise together and none hangs in a collective).

No accelerator (CPU + gloo): not the collectives (gloo runs ``all_to_all_single``, plain and
functional, in torch 2.13) and not the attention (the "native" SDPA backend supports context
parallelism on any device) stand in the way, but one line of bookkeeping,
``ModelMixin._resolve_parallel_config`` (``diffusers/models/modeling_utils.py``, line 1719)::

    device = torch.device(device_type, rank % torch.accelerator.device_count())

which divides by zero when there is no accelerator. The device it computes is only recorded on
the config, so :func:`enable_ulysses` runs that one call under :func:`_one_device_counted`,
which reports one device for its duration on a machine that has none, and nowhere else.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from diffrl.errors import ConfigError

KEY = "parallel.sp"  # the config key error messages name


def check_heads(heads: int, sp: int) -> None:
    """Ulysses gives each rank ``heads / sp`` whole heads: ``ConfigError`` unless sp divides."""
    if heads % sp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(
            f"{KEY}={sp}: Ulysses sequence parallelism splits the {heads} attention heads across "
            f"the {sp} ranks of the group, so sp must divide {heads}; set {KEY} to one of {ok}"
        )


def _all_to_all(x: Tensor, out_sizes: list[int], in_sizes: list[int], group) -> Tensor:
    """Chunks of dim 0 (``in_sizes`` rows, in rank order) to each rank in turn, ``out_sizes``
    rows back from each; differentiable (backward: the reverse)."""
    out = funcol.all_to_all_single_autograd(x, out_sizes, in_sizes, group)
    return funcol.wait_tensor(out)  # the next permute needs the data, not a pending handle


def _seq_to_heads(x: Tensor, sizes: list[int], group: dist.ProcessGroup) -> Tensor:
    """(B, S_r, H, D) this rank's sequence shard -> (B, S, H/sp, D) head shard, S = sum(sizes)
    (the ranks' shard lengths, in rank order: equal or not)."""
    b, s_local, h, d = x.shape
    sp = len(sizes)
    # (sp, S_r, B, H/sp, D) flattened: chunk j (S_r rows) is this rank's tokens of head group j
    send = x.reshape(b, s_local, sp, h // sp, d).permute(2, 1, 0, 3, 4).reshape(-1, b, h // sp, d)
    recv = _all_to_all(send.contiguous(), sizes, [s_local] * sp, group)
    # chunk j received is rank j's tokens of our head group; ranks hold consecutive slices
    return recv.permute(1, 0, 2, 3)


def _heads_to_seq(x: Tensor, sizes: list[int], rank: int, group: dist.ProcessGroup) -> Tensor:
    """(B, S, H/sp, D) head shard -> (B, S_r, H, D) this rank's sequence shard (the inverse)."""
    b, _, h_local, d = x.shape
    sp, s_local = len(sizes), sizes[rank]
    send = x.permute(1, 0, 2, 3).contiguous()  # chunk j (sizes[j] rows): rank j's tokens
    recv = _all_to_all(send, [s_local] * sp, sizes, group)
    # chunk i received is head group i of our tokens: heads in rank order
    recv = recv.reshape(sp, s_local, b, h_local, d).permute(2, 1, 0, 3, 4)
    return recv.reshape(b, s_local, sp * h_local, d)


def _shard_lengths(q: Tensor, k: Tensor, group: dist.ProcessGroup) -> tuple[list[int], list[int]]:
    """Every rank's (query, key) shard lengths, in rank order (one small all-gather)."""
    sp = dist.get_world_size(group)
    mine = torch.tensor([q.shape[1], k.shape[1]], device=q.device, dtype=torch.int64)
    every = torch.empty(2 * sp, device=q.device, dtype=torch.int64)
    dist.all_gather_single(every, mine, group=group)
    rows = every.view(sp, 2).tolist()
    return [r[0] for r in rows], [r[1] for r in rows]


def ulysses_attention(
    q: Tensor,  # (B, S_q_r, H, D): this rank's slice of the query sequence
    k: Tensor,  # (B, S_kv_r, H, D)
    v: Tensor,  # (B, S_kv_r, H, D)
    group: dist.ProcessGroup,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    key_mask: Tensor | None = None,  # (B, 1, 1, S_kv) over the *gathered* keys, or None
) -> Tensor:  # (B, S_q_r, H, D): attention over the whole sequence, this rank's slice
    """Full-sequence attention on sequence shards: equal to SDPA on the gathered q, k, v, sliced.

    Every rank of ``group`` calls it in step with its own contiguous slice of the sequence
    (rank r holds the r-th slice; the slices may differ in length, e.g. 131 and 130 rows of a
    261-row sequence, as ``tensor_split`` cuts it). The heads must divide by sp (checked before
    any communication). Gradients flow back through both all-to-alls.
    """
    sp = dist.get_world_size(group)
    check_heads(q.shape[2], sp)
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"q, k, v need the same heads; got {q.shape}, {k.shape}, {v.shape}")
    q_sizes, kv_sizes = _shard_lengths(q, k, group)
    q = _seq_to_heads(q, q_sizes, group)  # (B, S, H/sp, D)
    k, v = (_seq_to_heads(x, kv_sizes, group) for x in (k, v))
    # SDPA takes (B, heads, S, D).
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=key_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    ).transpose(1, 2)
    return _heads_to_seq(out, q_sizes, dist.get_rank(group), group)


class _UlyssesAnything:
    """Stands in for diffusers' ``TemplatedUlyssesAnythingAttention`` (0.42.1), whose backward
    raises ``NotImplementedError``: the same call (``apply`` with the backend's arguments),
    answered by :func:`ulysses_attention`, differentiable. Installed by :func:`enable_ulysses`;
    reached only by a transformer whose config has ``ulysses_anything`` (no one else in diffrl
    sets it)."""

    @staticmethod
    def apply(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op, backward_op, _parallel_config=None,
    ):  # fmt: skip
        local_keys = attn_mask is None or (
            attn_mask.dim() == 4 and attn_mask.shape[1:3] == (1, 1)
            and attn_mask.shape[-1] == key.shape[1]
        )  # fmt: skip
        if return_lse or not local_keys:
            raise NotImplementedError(
                f"{KEY}: diffrl's Ulysses attention takes a mask over this rank's keys only "
                "(B, 1, 1, S_kv_r), and returns no log-sum-exp; this transformer's attention "
                f"asked for more (mask {None if attn_mask is None else tuple(attn_mask.shape)}); "
                f"set {KEY}=1"
            )
        assert _parallel_config is not None, "diffusers passes the context-parallel config"
        group = _parallel_config.context_parallel_config._ulysses_mesh.get_group()
        if attn_mask is not None:  # Qwen-Image's padded text: every rank's keys' mask, in order
            dtype = attn_mask.dtype
            attn_mask = _all_gather_uneven(attn_mask.to(torch.float32), 3, group).to(dtype)
        return ulysses_attention(
            query, key, value, group, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
            enable_gqa=enable_gqa, key_mask=attn_mask,
        )  # fmt: skip


def _all_gather_uneven(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` joined along ``dim`` in rank order, the ranks' lengths along
    ``dim`` free to differ: each pads to the longest, one all-gather, the pads dropped. Stands
    in for diffusers' ``_all_gather_anything``, whose list all-gather of unequal tensors gloo
    refuses ("invalid tensor size"); diffusers' autograd function around it keeps its own
    backward (this rank's slice of the gradient)."""
    tensor = tensor.contiguous()
    sp = dist.get_world_size(group)
    mine = torch.tensor([tensor.shape[dim]], device=tensor.device, dtype=torch.int64)
    every = torch.empty(sp, device=tensor.device, dtype=torch.int64)
    dist.all_gather_single(every, mine, group=group)
    sizes = every.tolist()
    most = max(sizes)
    if tensor.shape[dim] < most:
        shape = list(tensor.shape)
        shape[dim] = most - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(shape)], dim)
    parts = [torch.empty_like(tensor) for _ in range(sp)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim)


def _install_ulysses_anything() -> None:
    """Our attention and gather in diffusers' "anything" path (reached by no other config);
    diffusers looks both up by module name at each call."""
    from diffusers.hooks import context_parallel
    from diffusers.models import attention_dispatch

    attention_dispatch.TemplatedUlyssesAnythingAttention = _UlyssesAnything  # type: ignore[misc,assignment]
    context_parallel._all_gather_anything = _all_gather_uneven  # type: ignore[assignment]


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


# What each class's ``_cp_plan`` splits (diffusers 0.42.1), for the start-up line; the same
# table is in docs/parallel.md.
SPLITS = {
    "MiniMaxH3Transformer3DModel": (
        "the packed [text | keyframes | audio | video] sequence, at the first block, with its "
        "rope rows and AdaLN indices; gathered at the two output heads"
    ),
    "WanTransformer3DModel": (
        "the video tokens at the first block, with their rope; the text whole on every rank; "
        "gathered at proj_out"
    ),
    "FluxTransformer2DModel": "the image and the text tokens, with their ids; gathered at proj_out",
    "QwenImageTransformer2DModel": (
        "the image and the text tokens at the first block, with their rope and masks; gathered "
        "at proj_out"
    ),
}

# Families whose class declares a ``_cp_plan`` that diffrl train still refuses, and why.
REFUSED = {
    "ltx2": (
        "its _cp_plan (diffusers 0.42.1) splits the video tokens and their rope but not the "
        "audio-to-video cross-attention's rope (on ltx2-tiny at sp=2 that attention fails: 40 "
        "query rows against 80 rope rows), and leaves the audio stream whole on every rank, "
        "its output not gathered, so the audio path's gradients would be whole on each rank "
        "while the video path's are shares"
    ),
}


def _lengths(transformer: nn.Module, args: dict) -> dict[str, int]:
    """The sequence lengths ``transformer``'s plan splits, named, from its forward's
    arguments (nothing for a class not listed)."""
    family = type(transformer).__name__
    hidden = args.get("hidden_states")
    text = args.get("encoder_hidden_states")
    if family == "MiniMaxH3Transformer3DModel":
        rows = {k: int(args[f"{k}_indices"].numel()) for k in ("text", "video", "audio")}
        parts = " + ".join(f"{n} {k}" for k, n in rows.items())
        return {f"packed sequence ({parts} rows)": int(args["position_ids"].shape[0])}
    if family == "WanTransformer3DModel" and hidden is not None:
        pt, ph, pw = transformer.config.patch_size
        _, _, f, h, w = hidden.shape
        return {
            f"video tokens ({f // pt} x {h // ph} x {w // pw})": (f // pt) * (h // ph) * (w // pw)
        }
    if family in ("FluxTransformer2DModel", "QwenImageTransformer2DModel"):
        out = {}
        if hidden is not None:
            out["image tokens"] = int(hidden.shape[1])
        if text is not None:
            out["text tokens"] = int(text.shape[1])
        return out
    return {}


def check_lengths(transformer: nn.Module, sp: int, args: dict) -> None:
    """``ConfigError`` naming the rows unless every length the plan splits gives each of the
    sp ranks at least one row (diffusers would fail an assert deep in the forward)."""
    family = type(transformer).__name__
    for what, n in _lengths(transformer, args).items():
        if n < sp:
            raise ConfigError(
                f"{KEY}={sp}: {family}'s context-parallel plan splits the {what} = {n} rows "
                f"over the {sp} ranks of the sp group, fewer rows than ranks; set {KEY} to at "
                f"most {n}"
            )


def _check_lengths_hook(transformer: nn.Module, sp: int) -> None:
    """Run :func:`check_lengths` before each forward of ``transformer`` (a pre-hook runs before
    diffusers' own hooks, which replace ``forward``)."""
    signature = inspect.signature(transformer.forward)

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = signature.bind_partial(*args, **kwargs).arguments
        check_lengths(module, sp, bound)

    transformer.register_forward_pre_hook(pre, with_kwargs=True)


@contextmanager
def _one_device_counted(device_type: str):
    """On a machine with no accelerator, ``torch.accelerator.device_count()`` reports 1 inside
    the block (diffusers divides a rank by it to name a device it only records; see the module
    docstring); elsewhere, and on any machine with an accelerator, nothing changes."""
    if device_type != "cpu" or torch.accelerator.device_count() > 0:
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.device_count = count  # type: ignore[assignment]


def enable_ulysses(transformer: nn.Module, mesh_or_group: DeviceMesh | dist.ProcessGroup) -> None:
    """Shard ``transformer``'s sequence over an SP group with diffusers' own ``_cp_plan``.

    Collective: every rank of the group calls it, in step, on a replica with the same weights.

    Does: checks the class declares ``_cp_plan`` and that sp divides
    ``config.num_attention_heads``, then calls ``enable_parallelism`` with
    ``ContextParallelConfig(ulysses_degree=sp, mesh=..., ulysses_anything=True)``. From then
    on each forward takes the *full* inputs on every rank; the plan's hooks split them along
    the sequence, every attention runs Ulysses, and the output is gathered, so each rank
    returns the full output. A length sp does not divide is cut unevenly (module docstring);
    before each forward every rank is checked to get a row (:func:`check_lengths`). Diffusers
    checks that the attention backend supports context parallelism ("native" SDPA does; a
    backend that does not raises there, naming those that do).

    Does not cover: a family with no ``_cp_plan`` (SD3: ``ConfigError``, use ``parallel.sp=1``);
    ring attention; an attention mask other than one over the keys (``NotImplementedError``
    from :class:`_UlyssesAnything`; Qwen-Image's padded-text mask is one over the keys);
    combining with diffusers' own TP in one config (diffusers refuses; our TP plans are applied
    separately); calling it twice. Parameter gradients of the sharded model are each rank's
    share: sum them over the SP group (the module docstring says why).
    """
    family = type(transformer).__name__
    if getattr(transformer, "_cp_plan", None) is None:
        raise ConfigError(
            f"{KEY}: {family} declares no context-parallel plan (`_cp_plan`) in diffusers, so "
            f"Ulysses sequence parallelism is not available for it; set {KEY}=1"
        )
    device_type = next(transformer.parameters()).device.type
    sp_mesh = _sp_mesh(mesh_or_group, device_type)
    sp = sp_mesh.size()
    check_heads(transformer.config.num_attention_heads, sp)
    from diffusers import ContextParallelConfig

    # ContextParallelConfig wants a ("ring", "ulysses") mesh; ring degree 1 is Ulysses alone.
    # ``_unflatten`` (torch 2.13) reshapes the sp mesh, reusing its ranks.
    mesh = sp_mesh._unflatten(0, (1, sp), ("ring", "ulysses"))
    # "anything": the plan's hooks split with ``tensor_split`` (uneven where sp does not divide
    # a length) and gather what each rank holds; the attention is ours (_UlyssesAnything)
    config = ContextParallelConfig(ulysses_degree=sp, mesh=mesh, ulysses_anything=True)
    _install_ulysses_anything()
    _check_lengths_hook(transformer, sp)
    with _one_device_counted(device_type):
        transformer.enable_parallelism(config=config)


def check_family(family: str, sp_plan: str, sp: int) -> None:
    """``parallel.sp`` > 1 for ``family`` (its record's ``sp_plan``), before anything loads:
    a ConfigError naming the family and the axis unless diffrl train runs its plan."""
    if sp_plan != "diffusers":
        raise ConfigError(
            f"{KEY}={sp}: model family {family!r} has no context-parallel plan for the sp axis "
            f"(FamilySpec.sp_plan is empty: its diffusers class declares no _cp_plan); set "
            f"{KEY}=1 (shard with parallel.dp_shard instead)"
        )
    if family in REFUSED:
        raise ConfigError(
            f"{KEY}={sp}: model family {family!r} on the sp axis: {REFUSED[family]}; set {KEY}=1"
        )


def sp_hook(mesh: DeviceMesh, family: str, sp_plan: str, tp: int = 1):
    """The actor's ``sequence_parallel`` hook for ``mesh`` (the main mesh's ``sp`` axis), or a
    ConfigError naming the family when it has no plan diffrl train runs. ``tp``: the degree
    the model is already tensor-parallel at (its attentions then hold heads / tp heads, which
    Ulysses splits again)."""
    check_family(family, sp_plan, mesh.size())

    def hook(model: nn.Module) -> str:
        """Shard ``model``'s transformer over the sequence; the layout, in a line."""
        from diffrl.models.family import transformer_root
        from diffrl.parallel.dims import ParallelDims

        root = transformer_root(model)
        cls = type(root).__name__
        # tp and tp * sp must divide the heads; ConfigError naming both keys
        sp = mesh.size()
        heads = root.config.num_attention_heads
        ParallelDims(sp=sp, tp=tp, world_size=sp * tp).validate(dit_heads=heads)
        enable_ulysses(root, mesh)
        return (
            f"sequence parallel: Ulysses over sp={mesh.size()} (ranks {mesh.mesh.tolist()}) "
            f"with {cls}'s _cp_plan, splitting {SPLITS.get(cls, 'what its plan says')}; the "
            "adapters' gradients summed over sp; the rollout replicated (unsharded)"
        )

    return hook
