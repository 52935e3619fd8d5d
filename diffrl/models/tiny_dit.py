"""A tiny pixel-space DiT for the built-in tasks.

Patchified 32x32 RGB image tokens and text tokens attend jointly (in-context text, as in
SD3's MMDiT but with shared weights); sigma conditions every block through AdaLN-zero
(DiT, Peebles & Xie 2023). Native convention is diffrl's canonical one: sigma=1 is noise,
the network predicts v = eps - x0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffrl.errors import check
from diffrl.models.attention import routed
from diffrl.models.packed import attend, interleave


@dataclass(frozen=True)
class TinyDiTConfig:
    image_size: int = 32
    channels: int = 3
    patch: int = 4
    hidden: int = 128
    depth: int = 6
    heads: int = 4
    mlp_ratio: float = 4.0
    vocab_size: int = 64
    max_text_len: int = 12

    def validate(self) -> None:
        check(self.image_size % self.patch == 0, "patch", self.patch, "must divide image_size")
        check(self.hidden % self.heads == 0, "heads", self.heads, "must divide hidden")

    def to_dict(self) -> dict:
        return asdict(self)


def sigma_embedding(sigma: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of 1000*sigma: (B,) -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device) / half)
    args = 1000.0 * sigma.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_backend = "sdpa"  # model.attention (models/attention.py routes it)
        self.qkv = nn.Linear(dim, 3 * dim)  # fused q, k, v: (B, N, 3*dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # key_mask: (B, N) True = attend; broadcast over heads and queries
        mask = None if key_mask is None else key_mask[:, None, None, :]
        with routed(self.attention_backend):  # model.attention; "sdpa" is no context at all
            if q.dtype == torch.bfloat16 and q.device.type == "cpu":
                # under bf16 autocast on the CPU, attention stays fp32 (autocast would cast it
                # back down): torch's CPU flash-attention backward is much slower in bf16 than
                # in fp32 on these shapes
                with torch.autocast("cpu", enabled=False):
                    out = F.scaled_dot_product_attention(
                        q.float(), k.float(), v.float(), attn_mask=mask
                    ).to(q.dtype)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, h, N, d/h)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ada = nn.Linear(dim, 6 * dim)  # AdaLN-zero: shift/scale/gate for attn and mlp
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: Tensor, c: Tensor, key_mask: Tensor | None) -> Tensor:
        s1, sc1, g1, s2, sc2, g2 = self.ada(F.silu(c)).chunk(6, dim=-1)  # each (B, dim)
        x = x + g1[:, None] * self.attn(modulate(self.norm1(x), s1, sc1), key_mask)
        return x + g2[:, None] * self.mlp(modulate(self.norm2(x), s2, sc2))


class TinyDiT(nn.Module):
    """forward(x (B,C,H,W), sigma (B,), input_ids (B,L)) -> v = eps - x0, (B,C,H,W)."""

    def __init__(self, cfg: TinyDiTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d, p = cfg.hidden, cfg.patch
        self.grid = cfg.image_size // p
        self.patch_in = nn.Linear(cfg.channels * p * p, d)
        self.pos_img = nn.Parameter(torch.randn(1, self.grid * self.grid, d) * 0.02)
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_txt = nn.Parameter(torch.randn(1, cfg.max_text_len, d) * 0.02)
        self.sigma_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(Block(d, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(d, 2 * d)
        self.patch_out = nn.Linear(d, cfg.channels * p * p)
        for zero in (self.ada_out, self.patch_out):  # start as v = 0 (DiT's zero init)
            nn.init.zeros_(zero.weight)
            nn.init.zeros_(zero.bias)

    def patchify(self, x: Tensor) -> Tensor:  # (B,C,H,W) -> (B, gh*gw, C*p*p)
        b, c, h, w = x.shape
        p = self.cfg.patch
        gh, gw = h // p, w // p
        return x.view(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)

    def unpatchify(self, t: Tensor, size: tuple[int, int] | None = None) -> Tensor:
        """Inverse of patchify, to (B, C, H, W) of ``size`` (default the model's own)."""
        b = t.shape[0]
        c, p = self.cfg.channels, self.cfg.patch
        h, w = size or (self.cfg.image_size, self.cfg.image_size)
        gh, gw = h // p, w // p
        return t.view(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def pos(self, h: int, w: int) -> Tensor:
        """(1, gh*gw, d) image positions of an h x w input: the top-left gh x gw of the
        table (all of it at the model's own size), so smaller inputs run too."""
        p, g = self.cfg.patch, self.grid
        if (h, w) == (self.cfg.image_size,) * 2:
            return self.pos_img
        table = self.pos_img.view(1, g, g, -1)[:, : h // p, : w // p]
        return table.reshape(1, (h // p) * (w // p), -1)

    def forward(self, x: Tensor, sigma: Tensor, input_ids: Tensor) -> Tensor:
        b, n_txt = x.shape[0], input_ids.shape[1]
        if n_txt > self.cfg.max_text_len:
            raise ValueError(
                f"input_ids has {n_txt} tokens, model max_text_len is {self.cfg.max_text_len}"
            )
        if sigma.ndim == 0:
            sigma = sigma.expand(b)
        size = (x.shape[2], x.shape[3])
        img = self.patch_in(self.patchify(x)) + self.pos(*size)  # (B, Ni, d)
        txt = self.tok_emb(input_ids) + self.pos_txt[:, :n_txt]  # (B, L, d)
        h = torch.cat([txt, img], dim=1)  # (B, L+Ni, d)
        key_mask = torch.cat(
            [input_ids != 0, torch.ones(b, img.shape[1], dtype=torch.bool, device=x.device)], dim=1
        )
        c = self.sigma_mlp(sigma_embedding(sigma, self.cfg.hidden).to(x.dtype))  # (B, d)
        for block in self.blocks:
            h = block(h, c, key_mask)
        shift, scale = self.ada_out(F.silu(c)).chunk(2, dim=-1)
        h = modulate(self.norm_out(h[:, n_txt:]), shift, scale)
        return self.unpatchify(self.patch_out(h), size)

    def forward_packed(
        self, xs: Sequence[Tensor], ts: Sequence[Tensor], ids: Sequence[Tensor], attention: str
    ) -> list[Tensor]:
        """``forward`` over groups of several image sizes in one call (``models/packed.py``):
        each sample's [text; image] tokens are one segment of a packed sequence, attention is
        block-diagonal (text padding masked as in ``forward``), and the adaLN modulation is
        each sample's, gathered per token."""
        d = self.cfg.hidden
        txt = torch.cat([self.tok_emb(i) + self.pos_txt[:, : i.shape[1]] for i in ids])  # (B,L,d)
        img = [self.patch_in(self.patchify(x)) + self.pos(*x.shape[2:]) for x in xs]
        n_img = torch.tensor([t.shape[1] for t in img for _ in range(len(t))])
        n_txt = torch.full_like(n_img, txt.shape[1])
        flat = torch.cat([txt.reshape(-1, d), *(t.reshape(-1, d) for t in img)])
        order, pack = interleave(
            [(txt.reshape(-1, d), n_txt), (flat[len(n_txt) * txt.shape[1] :], n_img)], flat.device
        )
        keep = torch.cat(
            [
                torch.cat(list(ids)).reshape(-1) != 0,
                torch.ones(int(n_img.sum()), dtype=torch.bool, device=flat.device),
            ]
        )
        h, key_mask = flat[order], keep[order]  # (N, d), (N,): sample by sample
        sigma = torch.cat(list(ts))
        c = self.sigma_mlp(sigma_embedding(sigma, d).to(h.dtype))  # (B, d)
        seg = pack.seg
        for block in self.blocks:
            s1, sc1, g1, s2, sc2, g2 = (m[seg] for m in block.ada(F.silu(c)).chunk(6, dim=-1))
            a = block.attn
            qkv = a.qkv(block.norm1(h) * (1 + sc1) + s1).view(len(h), 3, a.heads, -1)
            q, k, v = qkv.unbind(1)  # (N, heads, d/h)
            with routed(a.attention_backend):  # model.attention, as Attention.forward
                if q.dtype == torch.bfloat16 and q.device.type == "cpu":
                    with torch.autocast("cpu", enabled=False):
                        o = attend(q.float(), k.float(), v.float(), pack, key_mask, attention)
                    o = o.to(q.dtype)
                else:
                    o = attend(q, k, v, pack, key_mask, attention)
            h = h + g1 * a.proj(o.reshape(len(h), d))
            h = h + g2 * block.mlp(block.norm2(h) * (1 + sc2) + s2)
        shift, scale = (m[seg] for m in self.ada_out(F.silu(c)).chunk(2, dim=-1))
        out = self.patch_out(self.norm_out(h) * (1 + scale) + shift)
        unpacked = torch.empty_like(out)
        unpacked[order] = out  # back to [all text; group 0's images; group 1's; ...]
        rows = unpacked[len(n_txt) * txt.shape[1] :]
        outs, at = [], 0
        for x in xs:
            n = x.shape[0] * self.patchify(x[:1]).shape[1]
            t = rows[at : at + n].view(x.shape[0], -1, out.shape[-1])
            outs.append(self.unpatchify(t, (x.shape[2], x.shape[3])))
            at += n
        return outs


# LoRA targets are named explicitly per family (contract 2: never "all-linear").
TINY_DIT_LORA_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
