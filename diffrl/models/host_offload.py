"""A frozen module that lives in host memory and visits the accelerator for each use.

MiniMax-H3's 32 B Qwen3-VL encoder does not fit beside the 33 B DiT on one GPU, so it stays in
host memory and comes to the GPU to encode a prompt batch. ``module.to(gpu)`` then
``module.to("cpu")`` made that a 47 s round trip: pageable memory copies at a fraction of the
link's speed and synchronously, and the way back allocates and fills 50+ GB of fresh host
memory for weights that never changed. ``HostResident`` removes both costs:

- **Pinned, flat, once.** Each unit's (a decoder layer's, or the rest's) parameters and
  buffers move into one page-locked host buffer and become views of it, so a visit is one
  large asynchronous copy per unit at the link's full bandwidth. One buffer per unit, not per
  tensor: the pinned allocator rounds each allocation up to a power of two, which for a
  tensor-per-allocation layout can nearly double the host memory held.
- **Nothing comes back.** The module is frozen, so leaving the device only points every
  parameter back at its host view; the device copies are dropped, not copied.
- **Streamed** (``stream=True``): the repeated blocks (the longest ``nn.ModuleList``, the
  decoder layers) are not all brought at once. Each block's copy is issued on a side stream one
  block ahead of its forward and dropped after it, so the device holds the small rest plus two
  blocks, and the copies overlap the compute. The encoder's share of the encode phase's peak
  memory falls from the whole encoder to about two layers.

The numerics are the module's own: the same weights, the same kernels, in the same order. On
a CPU-only host (or a visit to the CPU) ``visit`` does nothing unless ``copy=True`` (tests use
it to run the mechanics on the CPU).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: every view starts on a boundary any dtype's element size divides


@dataclass
class _Slot:
    """One parameter or buffer: where it hangs, and its view in the unit's flat buffer."""

    owners: list[tuple[nn.Module, str]]  # every (module, attribute) that holds the tensor
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


@dataclass
class _Unit:
    """A group of tensors moved together: one flat host buffer and, while visiting, its device
    copy."""

    slots: list[_Slot]
    host: Tensor  # uint8, pinned where CUDA is available
    device_flat: Tensor | None = None
    ready: object | None = None  # the copy stream's event for device_flat
    views: list[Tensor] = field(default_factory=list)  # the host views, in slot order


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _tensors(mod: nn.Module, skip: set[int]) -> list[tuple[list, bool, Tensor]]:
    """Every tensor under ``mod`` once, as (its holders [(module, name)], is_param, tensor),
    leaving out the submodules whose ids are in ``skip`` (another unit's). A tied tensor keeps
    all its holders, so repointing it repoints every one."""
    found: dict[int, tuple[list, bool, Tensor]] = {}
    seen_mods: set[int] = set()
    stack = [mod]
    while stack:
        m = stack.pop()
        if id(m) in seen_mods:
            continue
        seen_mods.add(id(m))
        for is_param, table in ((True, m._parameters), (False, m._buffers)):
            for name, t in table.items():
                if t is not None:
                    found.setdefault(id(t), ([], is_param, t))[0].append((m, name))
        stack.extend(c for c in m.children() if id(c) not in skip)
    return list(found.values())


def _longest_list(mod: nn.Module) -> nn.ModuleList | None:
    lists = [m for m in mod.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len, default=None)


class HostResident:
    """Keeps a frozen ``module`` in (pinned) host memory; ``with resident.visit(device):``
    runs it on ``device`` and leaves nothing of it there afterwards.

    ``blocks`` are the units streamed one ahead of their forward (default: the module's longest
    ``nn.ModuleList``); everything else moves as one unit at the start of a visit."""

    def __init__(
        self, module: nn.Module, *, stream: bool = True, blocks: nn.ModuleList | None = None
    ) -> None:
        if any(p.requires_grad for p in module.parameters()):
            raise ValueError("HostResident keeps frozen modules only (a parameter needs grad)")
        if any(t.device.type != "cpu" for _, _, t in _tensors(module, set())):
            raise ValueError("HostResident takes a module whose tensors are in host memory")
        self.module = module
        self.stream = stream
        self.blocks = list(blocks if blocks is not None else (_longest_list(module) or []))
        pin = torch.cuda.is_available()
        skip = {id(b) for b in self.blocks}
        self.rest = self._unit(module, skip, pin)
        self.units = [self._unit(b, set(), pin) for b in self.blocks]
        self.on_device = 0  # blocks resident on the device now (the tests' window check)
        self.peak_on_device = 0
        self.visits, self.last_s = 0, 0.0

    @staticmethod
    def _unit(mod: nn.Module, skip: set[int], pin: bool) -> _Unit:
        slots, total = [], 0
        found = _tensors(mod, skip)
        for owners, is_param, t in found:
            nbytes = t.numel() * t.element_size()
            slots.append(_Slot(owners, is_param, total, nbytes, t.dtype, t.shape))
            total = _aligned(total + nbytes)
        host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        unit = _Unit(slots, host)
        for slot, (_, _, t) in zip(slots, found, strict=True):
            view = _view(host, slot)
            view.copy_(t.detach())
            unit.views.append(view)
        _point(unit, unit.views)  # the old storage is freed once nothing else holds it
        return unit

    @property
    def host_bytes(self) -> int:
        return sum(u.host.numel() for u in [self.rest, *self.units])

    # --- moving -----------------------------------------------------------------------------
    def _bring(self, unit: _Unit, device: torch.device, side) -> None:
        """Issue ``unit``'s host -> device copy (on ``side``, a CUDA stream, when given)."""
        ctx = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
        with ctx:
            unit.device_flat = unit.host.to(device, non_blocking=True, copy=True)
            if side is not None:
                unit.ready = torch.cuda.Event()
                unit.ready.record(side)

    def _use(self, unit: _Unit) -> None:
        """Point ``unit``'s tensors at its device copy, once the copy has landed."""
        flat = unit.device_flat
        assert flat is not None, "a unit is used before it was brought"
        if unit.ready is not None:
            torch.cuda.current_stream().wait_event(unit.ready)
            # allocated on the side stream, read on this one: the allocator must not hand the
            # block back to the side stream before this stream is done with it
            flat.record_stream(torch.cuda.current_stream())
            unit.ready = None
        _point(unit, [_view(flat, s) for s in unit.slots])

    @staticmethod
    def _drop(unit: _Unit) -> None:
        _point(unit, unit.views)
        unit.device_flat = None

    @contextlib.contextmanager
    def visit(self, device: torch.device | str, *, copy: bool = False) -> Iterator[None]:
        """Run the module on ``device`` inside the block. A visit to the CPU is a no-op unless
        ``copy`` (then the units are copied into fresh CPU memory: the mechanics, testable
        without a GPU)."""
        device = torch.device(device)
        if device.type == "cpu" and not copy:
            yield
            return
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        hooks: list = []
        start = time.perf_counter()
        try:
            self._bring(self.rest, device, None)
            self._use(self.rest)
            if self.stream and self.units:
                hooks = self._stream_hooks(device, side)
                self._bring(self.units[0], device, side)
                self._arrive()
            else:
                for u in self.units:
                    self._bring(u, device, None)
                    self._use(u)
                    self._arrive()
            yield
        finally:
            for h in hooks:
                h.remove()
            for u in [self.rest, *self.units]:
                if u.device_flat is not None:
                    self._drop(u)
            self.on_device = 0
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the visit's true length
            self.visits += 1
            self.last_s = time.perf_counter() - start
            if self.visits <= 3:  # the first visits (the last one warms nothing further)
                log.info(
                    "%s: visit %d to %s from %s host memory, %s, %.2f s (%.1f GB)",
                    type(self.module).__name__, self.visits, device,
                    "pinned" if self.rest.host.is_pinned() else "pageable",
                    "streamed a layer ahead" if self.stream else "whole", self.last_s,
                    self.host_bytes / 1e9,
                )  # fmt: skip

    def _arrive(self) -> None:
        self.on_device += 1
        self.peak_on_device = max(self.peak_on_device, self.on_device)

    def _stream_hooks(self, device: torch.device, side) -> list:
        n = len(self.units)

        def before(i: int):
            def hook(_mod, _args):
                unit = self.units[i]
                if unit.device_flat is None:  # a block run twice, or out of order
                    self._bring(unit, device, side)
                    self._arrive()
                self._use(unit)
                if i + 1 < n and self.units[i + 1].device_flat is None:
                    self._bring(self.units[i + 1], device, side)
                    self._arrive()

            return hook

        def after(i: int):
            def hook(_mod, _args, _out):
                self._drop(self.units[i])
                self.on_device -= 1

            return hook

        hooks = []
        for i, block in enumerate(self.blocks):
            hooks.append(block.register_forward_pre_hook(before(i)))
            hooks.append(block.register_forward_hook(after(i)))
        return hooks


def visiting_bytes(module: nn.Module, stream: bool = True) -> int:
    """What a visit of ``module`` holds on the device at most: everything but the blocks plus
    the two largest blocks when streamed (the running one and the next), the whole module
    otherwise. ``diffrl plan`` counts this for an offloaded encoder; the module may be on the
    meta device."""

    def size(m: nn.Module, skip: set[int]) -> int:
        return sum(t.numel() * t.element_size() for _, _, t in _tensors(m, skip))

    blocks = list(_longest_list(module) or [])
    if not stream or not blocks:
        return size(module, set())
    each = sorted((size(b, set()) for b in blocks), reverse=True)
    return size(module, {id(b) for b in blocks}) + sum(each[:2])


def _view(flat: Tensor, s: _Slot) -> Tensor:
    return flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)


def _point(unit: _Unit, tensors: list[Tensor]) -> None:
    for s, t in zip(unit.slots, tensors, strict=True):
        for owner, name in s.owners:
            if s.is_param:
                owner._parameters[name].data = t  # type: ignore[union-attr]
            else:
                owner._buffers[name] = t
