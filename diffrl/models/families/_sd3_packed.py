"""SD3's transformer over a packed sequence (``models/packed.py``): samples of several
resolutions in one call.

``SD3Transformer2DModel.forward`` takes one (B, C, H, W) tensor, so one shape per call. Here
the same modules run in the same order on a packed layout: the image stream is every sample's
patches end to end, (N_img, d), with no padding; the text stream keeps its (B, L, d) batch
(every sample has the same L). Each sample's adaLN modulation is computed once, (B, k d), and
gathered per image token; the text stream calls the blocks' own context norms. Joint attention
lays each sample's [image; text] tokens out as one segment, and SD3.5's image-only ``attn2``
its image tokens: both block-diagonal (``packed.attend``).

The math and the order of operations are ``JointTransformerBlock.forward`` with
``JointAttnProcessor2_0`` and ``AttnProcessor2_0`` (diffusers 0.37), so LoRA layers, merged
weights and the serving layout's ``RowView``s of a fused QKV run as they do there. Not
covered: ControlNet residuals, skip layers, IP-Adapter, chunked feed-forward (the rollout uses
none of them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from diffrl.models.packed import Packing, attend, interleave


def _heads(lin: nn.Module, x: Tensor, heads: int) -> Tensor:
    """(..., d) -> (N, heads, head_dim): a projection's rows as packed heads."""
    y = lin(x)
    return y.reshape(-1, heads, y.shape[-1] // heads)


def _joint(
    attn: nn.Module, img: Tensor, txt: Tensor, order: Tensor, pack: Packing, backend: str
) -> tuple[Tensor, Tensor | None]:
    """``JointAttnProcessor2_0`` on packed image tokens (N_img, d) and batched text (B, L, d):
    (image out (N_img, d), text out (B, L, d) or None for a context-pre-only block)."""
    h = attn.heads
    q, k, v = (_heads(p, img, h) for p in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    cq, ck, cv = (_heads(p, txt, h) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    if attn.norm_added_q is not None:
        cq = attn.norm_added_q(cq)
    if attn.norm_added_k is not None:
        ck = attn.norm_added_k(ck)
    # sample by sample: [its image tokens; its text tokens], one segment each (``order``)
    qs, ks, vs = (
        torch.cat([a, b.reshape(-1, *a.shape[1:])]) for a, b in ((q, cq), (k, ck), (v, cv))
    )
    out = attend(qs, ks, vs, pack, backend=backend, order=order).to(q.dtype)
    n = len(img)
    img_out = attn.to_out[1](attn.to_out[0](out[:n].reshape(n, -1)))
    if attn.context_pre_only:
        return img_out, None
    return img_out, attn.to_add_out(out[n:].reshape(*txt.shape[:2], -1))


def _self(attn: nn.Module, img: Tensor, pack: Packing, backend: str) -> Tensor:
    """``AttnProcessor2_0`` (SD3.5's image-only ``attn2``) on packed image tokens."""
    q, k, v = (_heads(p, img, attn.heads) for p in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    o = attend(q, k, v, pack, backend=backend).to(q.dtype)
    out = attn.to_out[1](attn.to_out[0](o.reshape(len(img), -1)))
    if attn.residual_connection:
        out = out + img
    return out / attn.rescale_output_factor


def _block(
    blk: nn.Module, img: Tensor, txt: Tensor, temb: Tensor, seg: Tensor, packs: tuple, backend: str
) -> tuple[Tensor | None, Tensor]:
    """``JointTransformerBlock.forward`` on packed image tokens: (text, image)."""
    order, joint, alone = packs
    mod = blk.norm1.linear(blk.norm1.silu(temb))  # (B, 6d) or (B, 9d) with dual attention
    parts = [m[seg] for m in mod.chunk(9 if blk.use_dual_attention else 6, dim=1)]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = parts[:6]
    normed = blk.norm1.norm(img)
    norm_img = normed * (1 + scale_msa) + shift_msa
    if blk.context_pre_only:
        norm_txt = blk.norm1_context(txt, temb)
    else:
        norm_txt, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = blk.norm1_context(
            txt, emb=temb
        )
    attn_img, attn_txt = _joint(blk.attn, norm_img, norm_txt, order, joint, backend)
    img = img + gate_msa * attn_img
    if blk.use_dual_attention:
        shift2, scale2, gate2 = parts[6:]
        img = img + gate2 * _self(blk.attn2, normed * (1 + scale2) + shift2, alone, backend)
    norm_img = blk.norm2(img) * (1 + scale_mlp) + shift_mlp
    img = img + gate_mlp * blk.ff(norm_img)
    if blk.context_pre_only:
        return None, img
    txt = txt + c_gate_msa.unsqueeze(1) * attn_txt
    norm_txt = blk.norm2_context(txt) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return txt + c_gate_mlp.unsqueeze(1) * blk.ff_context(norm_txt), img


def forward_packed(
    tr: nn.Module,
    xs: Sequence[Tensor],
    ts: Sequence[Tensor],
    prompts: Sequence[Tensor],
    pooled: Sequence[Tensor],
    backend: str,
) -> list[Tensor]:
    """``SD3Transformer2DModel`` over groups ``xs`` (n_j, C, H_j, W_j) of several sizes in one
    call, with their timesteps (n_j,), prompt embeddings (n_j, L, D) and pooled embeddings
    (n_j, P); returns each group's output (n_j, C_out, H_j, W_j)."""
    img = [tr.pos_embed(x).contiguous() for x in xs]  # (n_j, N_j, d) each
    d = img[0].shape[-1]
    n_img = torch.tensor([t.shape[1] for t in img for _ in range(len(t))])
    flat = torch.cat([t.reshape(-1, d) for t in img])  # (N_img, d), sample-major
    temb = tr.time_text_embed(torch.cat(list(ts)), torch.cat(list(pooled)))  # (B, d)
    txt = tr.context_embedder(torch.cat(list(prompts)))  # (B, L, d)
    n_txt = torch.full_like(n_img, txt.shape[1])
    order, joint = interleave([(flat, n_img), (txt.reshape(-1, d), n_txt)], flat.device)
    alone = Packing.of(n_img.tolist(), flat.device)
    seg = alone.seg  # each image token's sample
    packs = (order, joint, alone)
    h: Tensor | None = txt
    for blk in tr.transformer_blocks:
        assert h is not None, "only the last block is context-pre-only"
        h, flat = _block(blk, flat, h, temb, seg, packs, backend)
    norm = tr.norm_out  # AdaLayerNormContinuous, per image token
    scale, shift = norm.linear(norm.silu(temb).to(flat.dtype)).chunk(2, dim=1)
    out = tr.proj_out(norm.norm(flat) * (1 + scale)[seg] + shift[seg])
    p, c = tr.config.patch_size, tr.out_channels
    outs, at = [], 0
    for x in xs:
        n, (hh, ww) = len(x), (x.shape[-2] // p, x.shape[-1] // p)
        t = out[at : at + n * hh * ww].reshape(n, hh, ww, p, p, c)
        outs.append(torch.einsum("nhwpqc->nchpwq", t).reshape(n, c, hh * p, ww * p))
        at += n * hh * ww
    return outs
