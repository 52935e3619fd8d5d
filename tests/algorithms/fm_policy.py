"""A linear stand-in policy for the flow-matching losses' parity tests: velocity = W[adapter] * x
+ sigma, recording the default adapter's inputs so a test can recover each draw's noise."""

from __future__ import annotations

import torch
from torch import Tensor

from diffrl.types import TrainBatch


class LinearPolicy:
    def __init__(self, shape: tuple[int, ...], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = {
            name: torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 + 1.0
            for name in ("default", "old", None)
        }
        self.w["default"].requires_grad_(True)
        self.seen: list[tuple[Tensor, Tensor]] = []  # the default adapter's (x, sigma)

    def velocity(self, x, sigma, input_ids, adapter="default", cond=None) -> Tensor:
        if adapter == "default":
            self.seen.append((x.detach().clone(), sigma.detach().clone()))
        return self.w[adapter] * x + sigma.view(-1, *[1] * (x.ndim - 1))

    def draws(self, x0: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
        """(x, sigma, eps) of each draw, eps recovered from x = (1 - sigma) x0 + sigma eps."""
        out = []
        for x, sigma in self.seen:
            s = sigma.view(-1, *[1] * (x.ndim - 1))
            out.append((x, sigma, (x - (1 - s) * x0) / s))
        return out


def fm_batch(n: int, group_size: int, seed: int = 0, **fields: Tensor) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(n) // group_size
    return TrainBatch(
        input_ids=torch.zeros((n, 1), dtype=torch.long),
        ids_hash=tuple("0" for _ in range(n)),
        x0=torch.randn((n, 2, 3), generator=g, dtype=torch.float64),
        seeds=torch.arange(n),
        group=group,
        noise_key=group * 7 + 1,
        **fields,
    )
