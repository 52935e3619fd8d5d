"""Sequence packing: samples of different latent shapes in one transformer call.

A packed forward lays every sample's tokens end to end in one (N, ...) sequence, with no
padding, and attention runs block-diagonally: a token attends only to the tokens of its own
sample (its *segment*). Everything else in a DiT block is per token (linears, norms, MLPs) or
per sample (the adaLN modulation, gathered per token by ``Packing.seg``), so one call serves
requests of several resolutions (and, the model taking a sigma per sample, several step
counts) where a padded batch would waste the difference and a bucket per shape would split
the batch.

Attention backends (``attend``):

- ``bylength``: the segments of one length run as one batched SDPA call (a mixed stream of 3
  resolutions makes 3 calls per layer); any device and dtype, key masks allowed. Within a
  length the call is the same SDPA over the same rows as an unpacked batch of that shape.
- ``varlen``: one FlashAttention varlen call over the whole packed sequence
  (``torch.nn.attention.varlen.varlen_attn``, cumulative sequence offsets); CUDA, fp16/bf16,
  no key mask.

A net that can run packed declares ``forward_packed`` (``PacksSequences``); the tiny DiT and
SD3 (``families/_sd3_packed.py``) do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from diffrl.errors import ConfigError, ContractError
from diffrl.models.family import FamilyModel, ResolutionFree

BACKENDS = ("bylength", "varlen")


@runtime_checkable
class PacksSequences(Protocol):
    """A net that runs samples of several latent shapes in one call: ``xs`` are groups of one
    shape each, (n_j, *S_j), ``ts`` their native times (n_j,), ``ids`` their input ids (n_j,
    L); returns the native outputs per group. ``attention`` is a ``BACKENDS`` name."""

    def forward_packed(
        self, xs: Sequence[Tensor], ts: Sequence[Tensor], ids: Sequence[Tensor], attention: str
    ) -> list[Tensor]: ...


@dataclass(frozen=True)
class Packing:
    """Segments laid end to end: ``lengths`` (n,) tokens each; ``seg`` (N,) each token's
    segment; ``cu`` (n+1,) int32 offsets (varlen); per distinct length, the segments of that
    length and their tokens' positions (bylength)."""

    lengths: tuple[int, ...]
    seg: Tensor  # (N,) int64, on the device
    cu: Tensor  # (n+1,) int32, on the device
    by_length: dict[int, tuple[Tensor, Tensor]]  # length -> (segments (m,), positions (m, len))

    @staticmethod
    def of(lengths: Sequence[int], device: torch.device | str) -> Packing:
        lens = torch.tensor(list(lengths), dtype=torch.long)
        starts = torch.cumsum(lens, 0) - lens
        groups = {}
        for n in sorted(set(int(x) for x in lens)):
            which = (lens == n).nonzero().squeeze(1)
            pos = starts[which, None] + torch.arange(n)
            groups[n] = (which.to(device), pos.to(device))
        seg = torch.repeat_interleave(torch.arange(len(lens)), lens).to(device)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)])
        return Packing(tuple(int(x) for x in lens), seg, cu.to(device, torch.int32), groups)

    @property
    def total(self) -> int:
        return int(sum(self.lengths))


def attend(
    q: Tensor, k: Tensor, v: Tensor, pack: Packing, key_mask: Tensor | None = None,
    backend: str = "bylength", order: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Block-diagonal attention over packed (N, heads, head_dim) q, k, v: each token attends
    to its own segment only (and, given ``key_mask`` (N,) bool, to its unmasked keys).
    ``order`` (N,): q, k, v (and the output) are rows of another layout, packed position p
    being row order[p] (``interleave``): read and written in place of a permuted copy."""
    if order is not None and backend == "varlen":
        out = torch.empty_like(q)
        out[order] = attend(q[order], k[order], v[order], pack, None, backend)
        return out
    if backend == "varlen":
        if key_mask is not None or q.device.type != "cuda" or q.dtype == torch.float32:
            raise ConfigError(
                f"packed attention 'varlen' runs on CUDA in fp16/bf16 without key masks; this "
                f"call is {q.device.type}, {q.dtype}, mask={key_mask is not None}: use "
                "'bylength'"
            )
        from torch.nn.attention.varlen import varlen_attn

        m = max(pack.lengths)
        got = varlen_attn(q, k, v, pack.cu, pack.cu, m, m)
        assert isinstance(got, Tensor), "no aux asked for"
        return got
    if backend != "bylength":
        raise ConfigError(f"packed attention backend {backend!r}: one of {BACKENDS}")
    out = torch.empty_like(q)
    for _, (_, pos) in pack.by_length.items():  # pos: (m, n) token positions
        if order is not None:
            pos = order[pos]
        # (m, n, H, D) -> (m, H, n, D): the same SDPA an unpacked batch of this length runs
        qs, ks, vs = (t[pos].transpose(1, 2) for t in (q, k, v))
        mask = None if key_mask is None else key_mask[pos][:, None, None, :]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        out[pos] = o.transpose(1, 2).to(out.dtype)
    return out


def interleave(streams: Sequence[tuple[Tensor, Tensor]], device) -> tuple[Tensor, Packing]:
    """Lay per-sample token runs of several streams out sample by sample. ``streams``: for each
    stream, (tokens (N_s, ...), per-sample counts (B,)), its tokens sample-major. Returns
    ``order`` (N,): for each packed position, its row in ``cat(streams' tokens)``, and the
    packing of the B segments (sample b: its tokens of every stream, in stream order)."""
    counts = torch.stack([c.to(torch.long).cpu() for _, c in streams], 1)  # (B, n_streams)
    base = torch.tensor([0] + [len(t) for t, _ in streams[:-1]]).cumsum(0)  # stream offsets
    starts = torch.cumsum(counts, 0) - counts  # (B, n_streams): a sample's first token
    order = [
        base[s] + starts[b, s] + torch.arange(int(counts[b, s]))
        for b in range(len(counts))
        for s in range(counts.shape[1])
    ]
    return torch.cat(order).to(device), Packing.of(counts.sum(1).tolist(), device)


def packed_velocity(
    model: FamilyModel,
    xs: Sequence[Tensor],
    sigmas: Sequence[Tensor],
    ids: Sequence[Tensor],
    attention: str = "bylength",
) -> list[Tensor]:
    """``FamilyModel.forward`` over groups ``xs`` (n_j, *S_j) of several latent shapes in one
    packed call of the net, with their sigmas (n_j,) and ids (n_j, L): each group's canonical
    velocity (contract 1's conversion at the same boundary)."""
    net, fam = model.net, model.family
    if not isinstance(net, PacksSequences):
        raise ConfigError(
            f"{fam.name}: this family's net has no packed forward; set rollout.packed=false "
            "(a bucket per shape)"
        )
    for x in xs:
        shape = tuple(x.shape[1:])
        if shape != tuple(fam.latent_shape()) and not (
            isinstance(fam, ResolutionFree) and fam.accepts_shape(shape)
        ):
            raise ContractError(f"{fam.name}: the net does not take per-sample shape {shape}")
    dtype = next(net.parameters()).dtype
    ts = []
    for s in sigmas:
        t = model.convention.to_native(s)
        ts.append(t.to(dtype) if t.is_floating_point() else t)
    native = net.forward_packed([x.to(dtype) for x in xs], ts, ids, attention)
    sign = model.convention.velocity_sign
    return [(n * sign).to(x.dtype) for n, x in zip(native, xs, strict=True)]
