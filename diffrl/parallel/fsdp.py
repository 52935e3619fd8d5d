"""FSDP2 for the actor under data parallelism: the frozen base sharded, the adapters not.

``shard_frozen_base`` applies ``fully_shard`` to each block of the transformer's block lists,
then to the root, over the data-parallel mesh. Each rank keeps 1/dp of the frozen weights
between uses, and a block's weights are all-gathered for its forward and backward. The LoRA
adapters (``default``, ``old``, ``ema``) are left out (``ignored_params``). They are a few MB,
and kept whole on every rank, so the optimizer, the weight export, the EMA blend and the
checkpoint are those of one process. Their gradients are averaged over the ranks in fp32 by the
actor (``actor.engine.average_over``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import fully_shard

from diffrl.models.family import transformer_blocks


def shard_frozen_base(mesh) -> Callable[[torch.nn.Module], None]:
    """The actor's ``shard`` hook for ``mesh`` (the data-parallel mesh, 1-D)."""

    def shard(model: torch.nn.Module) -> None:
        adapters = {p for n, p in model.named_parameters() if "lora_" in n}
        blocks = transformer_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__}: no transformer block lists to shard")
        for block in blocks:
            fully_shard(block, mesh=mesh, ignored_params=adapters)
        fully_shard(model, mesh=mesh, ignored_params=adapters)

    return shard
