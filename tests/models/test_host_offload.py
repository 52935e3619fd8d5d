"""HostResident: a frozen module kept in host memory that visits a device per use. The
mechanics run on the CPU with ``copy=True`` (every unit copied into fresh memory, as a GPU visit
copies it); the GPU's pinned, streamed path is measured by benchmarks/real_size_omni.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffrl.models.host_offload import HostResident, visiting_bytes


class Toy(nn.Module):
    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two holders
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h)) * self.scale


def _frozen() -> Toy:
    torch.manual_seed(0)
    return Toy().requires_grad_(False).eval()


def _in(t: torch.Tensor, flat: torch.Tensor) -> bool:
    lo = flat.data_ptr()
    return lo <= t.data_ptr() < lo + flat.numel()


@pytest.mark.parametrize("stream", [True, False])
def test_a_visit_computes_the_same_and_leaves_nothing_behind(stream: bool) -> None:
    ids = torch.randint(0, 11, (2, 5))
    want = _frozen()(ids)
    toy = _frozen()
    home = HostResident(toy, stream=stream)
    assert len(home.units) == 4  # the longest ModuleList: one unit per block
    assert torch.equal(toy(ids), want)  # at home, views of the flat buffers
    with home.visit("cpu", copy=True):
        # inside: every tensor is a view of a fresh device copy, not of the host buffers
        assert not _in(toy.embed.weight, home.rest.host)
        assert toy.head.weight is toy.embed.weight
        assert torch.equal(toy(ids), want)
        assert torch.equal(toy(ids), want)  # twice in one visit: blocks come back as needed
    # streamed: at most the running block and the next one at a time; whole: all four
    assert home.peak_on_device == (2 if stream else 4)
    assert _in(toy.embed.weight, home.rest.host) and _in(toy.scale, home.rest.host)
    for b, u in zip(toy.blocks, home.units, strict=True):
        assert _in(b[0].weight, u.host) and u.device_flat is None
        assert not b._forward_pre_hooks and not b._forward_hooks
    assert torch.equal(toy(ids), want)


def test_a_failed_forward_still_goes_home() -> None:
    toy = _frozen()
    home = HostResident(toy)
    with pytest.raises(IndexError), home.visit("cpu", copy=True):
        toy(torch.tensor([[99]]))  # out of the vocabulary
    assert all(u.device_flat is None for u in home.units) and home.on_device == 0
    assert _in(toy.blocks[0][0].weight, home.units[0].host)


def test_only_frozen_host_modules() -> None:
    with pytest.raises(ValueError, match="frozen"):
        HostResident(Toy())
    with pytest.raises(ValueError, match="host memory"):
        HostResident(_frozen().to("meta"))


def test_visiting_bytes_counts_the_rest_and_two_blocks() -> None:
    toy = _frozen()
    block = (8 * 8 + 8) * 4
    rest = 11 * 8 * 4 + 2 * 8 * 4 + 4  # embedding (tied to the head: once), norm, scale
    assert visiting_bytes(toy) == rest + 2 * block
    assert visiting_bytes(toy, stream=False) == rest + 4 * block
