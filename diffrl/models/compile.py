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
import logging

import torch

from diffrl.models.family import transformer_blocks

log = logging.getLogger(__name__)

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


def cpu_toolchain() -> str:
    """Why inductor cannot build CPU kernels here ("" when it can): it compiles C++ with the
    compiler ``torch._inductor.config.cpp.cxx`` names (``$CXX``, else g++)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - any failure means: no usable compiler
        return f"{type(e).__name__}: {e}".strip().rstrip(":")
    return ""


def compile_blocks(model: torch.nn.Module, key: str = "rollout.compile") -> int:
    """Compile, in place, every block of the transformer's block lists (``nn.ModuleList``
    children of ``model.net.transformer``, or of the net itself); returns how many. Weight sync
    and adapter updates change the blocks' weights in place, which compiled code reads as
    inputs. ``key`` names the config option in the error for a net without block lists. On the
    CPU without a C++ compiler the blocks stay eager (one warning, 0 compiled): a laptop
    without a toolchain still runs the recipe, only slower."""
    blocks = transformer_blocks(model)
    if not blocks:
        root = getattr(model.net, "transformer", model.net)
        raise ValueError(f"{key}: {type(root).__name__} has no block lists to compile")
    on_cpu = next(model.parameters()).device.type == "cpu"
    missing = cpu_toolchain() if on_cpu else ""
    if missing:
        log.warning("%s: no C++ compiler for torch.compile on the CPU (%s): running eager; "
                    "install g++ or clang, or set CXX, to compile", key, missing)  # fmt: skip
        return 0
    for block in blocks:
        block.compile(dynamic=None, **_limit())
    return len(blocks)
