"""``diffrl.controller.flops``: the thread-local FLOP count sees the CPU's fused attention and
changes no result. (The stage counts are checked in tests/bench/test_bench.py, the perf/*
metrics in tests/controller/test_train_integration.py.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl.controller.flops import FlopCount


def test_flop_count_sees_fused_attention_and_changes_nothing() -> None:
    """FlopCounterMode counts CPU attention only on the math path (two bmm); FlopCount counts
    the fused kernel the run really takes, the same number, and returns the same output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g) for _ in range(3))
    w = torch.randn(64, 64, generator=g)

    def work() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v)  # (2, 4, 33, 16)
        return out.transpose(1, 2).reshape(2, 33, 64) @ w

    plain = work()
    with FlopCount() as count:
        seen = work()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as reference:
        work()
    assert torch.equal(seen, plain)
    assert count.flops == reference.get_total_flops() == 4 * 2 * 33 * 33 * 64 + 2 * 2 * 33 * 64 * 64
