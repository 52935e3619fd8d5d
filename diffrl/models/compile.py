"""Regional ``torch.compile``: each block of a transformer's block lists compiled in place, on its
own (``rollout.compile``, ``actor.compile``).

Identical blocks share one compiled graph: dynamo caches per code object (the block class's
``forward``), so 24 SD3.5 blocks of three kinds (dual attention, plain, the last context-only
one) compile three graphs, not 24, and compile time stays short. Every guard that fails adds
an entry to that one cache: a block kind, a new shape (then one dynamic-shape graph covers the
rest), grad mode, and in the actor each peft adapter state (``old``, ``default``, disabled),
with the rollout's and the actor's blocks counted together when both compile in one process.
That is about 3 kinds x (4 actor states + 2 rollout shapes) x 2 = 36 entries for SD3.5 with
NFT and a KL term, past dynamo's default of 8 per code object, beyond which a block silently
runs eager. So the blocks compiled here raise that limit to ``RECOMPILE_LIMIT``: for their own
calls only where torch.compile takes a ``recompile_limit`` (dynamo applies it while it converts
these frames; torch >= 2.12), else process-wide (``torch._dynamo.config``, torch 2.11 on our
H200). The global ``accumulated_recompile_limit`` (256) still caps a runaway.
"""

from __future__ import annotations

import inspect

import torch

from diffrl.models.family import transformer_blocks

RECOMPILE_LIMIT = 64
PER_CALL_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def _limit() -> dict:
    """The torch.compile keywords that give a block ``RECOMPILE_LIMIT``."""
    if PER_CALL_LIMIT:
        return {"recompile_limit": RECOMPILE_LIMIT}
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    return {}


def compile_blocks(model: torch.nn.Module, key: str = "rollout.compile") -> int:
    """Compile, in place, every block of the transformer's block lists (``nn.ModuleList``
    children of ``model.net.transformer``, or of the net itself); returns how many. Weight sync
    and adapter updates change the blocks' weights in place, which compiled code reads as
    inputs. ``key`` names the config option in the error for a net without block lists."""
    blocks = transformer_blocks(model)
    if not blocks:
        root = getattr(model.net, "transformer", model.net)
        raise ValueError(f"{key}: {type(root).__name__} has no block lists to compile")
    for block in blocks:
        block.compile(dynamic=None, **_limit())
    return len(blocks)
