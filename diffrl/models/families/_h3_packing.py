"""Several MiniMax-H3 samples in ONE transformer call: each sample's packed sequence becomes a
document of one longer sequence (batch 1), and attention is block-diagonal over the documents.

Why not the batch axis: ``MiniMaxH3Transformer3DModel``'s batch axis replicates ONE layout and
ONE timestep table (``timestep_indices`` is ``(seq_len,)``, shared by every batch item), so
samples at different sigmas, as the actor trains them, cannot share a call along it. The
sequence axis can: every row picks its own timestep and modality (``timestep_indices``,
``token_tags``), and every op of a block but attention is per row. So the documents'
layouts are concatenated (their index tensors offset), their rows' times share one table of
distinct values, and every attention of the transformer (the blocks' over the packed rows,
the token refiner's over the text rows) is wrapped in ``DocumentAttention``, which hands
diffusers' own processor one document at a time, or all of them as a batch where they have
one length (then one layout: the same rotary rows). Nothing of the attention maths is
copied, and each sample's velocity is its own call's, up to the matmuls' summation order.

Documents are told to the wrappers through ``Documents``, bound around the call. Activation
checkpointing re-runs a block's forward in the backward, after the call has returned:
``Documents.recompute_context`` (a ``torch.utils.checkpoint`` ``context_fn``; the actor's
checkpointing passes it, ``diffrl/actor/engine.py``) binds the documents the forward saw
for that re-run. Diffusers' context parallelism (``parallel.sp``) splits the one sequence
over ranks, so documents would straddle them: the net does not pack under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Docs:
    """The documents of one packed call, by rows."""

    seq: tuple[int, ...]  # each sample's packed-sequence rows (the blocks' attention)
    text: tuple[int, ...]  # each sample's text rows (the token refiner's attention)


class Documents:
    """The packed call in progress (``current``; None outside one, where every wrapper is the
    processor it wraps), shared by the ``DocumentAttention``s of one transformer."""

    def __init__(self) -> None:
        self.current: Docs | None = None

    @contextlib.contextmanager
    def bound(self, docs: Docs | None) -> Iterator[None]:
        before, self.current = self.current, docs
        try:
            yield
        finally:
            self.current = before

    def recompute_context(self):
        """``torch.utils.checkpoint``'s ``context_fn``, called as a checkpointed block runs
        forward: (nothing for the forward, the forward's documents bound for the re-run)."""
        return contextlib.nullcontext(), self.bound(self.current)


class DocumentAttention:
    """diffusers' ``MiniMaxH3AttnProcessor`` (``inner``), made block-diagonal over the bound
    documents of ``stream`` ("seq": the packed rows, with rotary tables; "text": the token
    refiner's rows, without)."""

    def __init__(self, inner, documents: Documents, stream: str) -> None:
        self.inner, self.documents, self.stream = inner, documents, stream

    # diffusers sets the attention backend and context-parallel config on the processor
    _attention_backend = property(
        lambda self: self.inner._attention_backend,
        lambda self, v: setattr(self.inner, "_attention_backend", v),
    )
    _parallel_config = property(
        lambda self: self.inner._parallel_config,
        lambda self, v: setattr(self.inner, "_parallel_config", v),
    )

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        docs = self.documents.current
        if docs is None:
            return self.inner(attn, hidden_states, rotary_emb, attention_mask)
        lengths = docs.seq if self.stream == "seq" else docs.text
        if len(set(lengths)) == 1:  # one length, one layout: the documents as a batch
            b, n = len(lengths), lengths[0]
            rot = None if rotary_emb is None else (rotary_emb[0][:n], rotary_emb[1][:n])
            out = self.inner(attn, hidden_states.reshape(b, n, -1), rot, attention_mask)
            return out.reshape(1, b * n, -1)  # (b, n, h) -> (1, b n, h)
        outs, start = [], 0
        for n in lengths:  # (1, n, h) each, its own rotary rows
            rot = None
            if rotary_emb is not None:
                rot = (rotary_emb[0][start : start + n], rotary_emb[1][start : start + n])
            rows = hidden_states[:, start : start + n]
            outs.append(self.inner(attn, rows, rot, attention_mask))
            start += n
        return torch.cat(outs, dim=1)


def install(transformer: nn.Module, documents: Documents) -> None:
    """Wrap every attention of ``transformer`` (once): the blocks' over the packed rows, the
    token refiner's over the text rows (a stand-in without them, as tests use: none)."""
    refiner = getattr(transformer, "token_refiner", None)
    streams = [(b.attn, "seq") for b in getattr(transformer, "transformer_blocks", ())]
    streams += [(b.attn, "text") for b in getattr(refiner, "refiner_blocks", ())]
    for attn, stream in streams:
        if not isinstance(attn.processor, DocumentAttention):
            attn.set_processor(DocumentAttention(attn.processor, documents, stream))


def concat_layouts(layouts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-sample layouts (``MiniMaxH3Net.layout``'s dicts) as one sequence's: positions and
    tags concatenated, each sample's row indices offset by the rows ahead of it."""
    out: dict[str, list[Tensor]] = {k: [] for k in layouts[0]}
    start = 0
    for lay in layouts:
        for k, v in lay.items():
            out[k].append(v + start if k.endswith("_indices") else v)
        start += lay["position_ids"].shape[0]
    return {k: torch.cat(v) for k, v in out.items()}
