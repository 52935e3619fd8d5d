"""What a family tells ``diffrl plan`` about its activations: its tokens and blocks at a
recipe's size, in bytes per sample (``FamilySpec.geometry`` returns a ``Geometry``).

The planner (``parallel/plan.py``) owns the arithmetic that turns these into GiB per GPU; each
family owns its per-token formula (what autograd keeps for the backward in one block), derived
in ``parallel/plan.py``'s docstring and checked against autograd in ``tests/parallel``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Widths:
    """Per-token widths on one GPU: h replicated, a and f divided where TP shards them."""

    h: int
    a: float  # attention inner width (heads x head_dim) / tp
    f: float  # FFN hidden width / tp where the plan shards the FFN
    heads: float  # attention heads / tp
    r: int  # LoRA rank
    rms: int  # bytes per element nn.RMSNorm keeps (2: CUDA's fused kernel; 4: CPU)


@dataclass(frozen=True)
class BlockCost:
    """One kind of transformer block, per sample, in bytes: what autograd keeps for the
    backward (``saved``), the block's inputs (all checkpointing keeps), and the largest set
    alive at once in a no-grad forward (``live``)."""

    kind: str
    count: int
    saved: float
    inputs: float
    live: float


@dataclass(frozen=True)
class Geometry:
    """A family's tokens and blocks at the recipe's size."""

    tokens: str  # what one sample is, for the header
    blocks: list[BlockCost]
    encoder_tokens: dict[str, int]  # frozen encoder -> tokens per prompt
    decode: float = 0.0  # bytes per sample of the VAE decode's working set (0 = not modelled)


def merge_blocks(blocks: list[BlockCost]) -> list[BlockCost]:
    """Blocks of one kind summed into one ``BlockCost`` (their counts added)."""
    out: dict[str, BlockCost] = {}
    for b in blocks:
        if b.kind in out:
            b = dataclasses.replace(b, count=out[b.kind].count + b.count)
        out[b.kind] = b
    return list(out.values())
