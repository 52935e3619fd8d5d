"""CUDA-graph replay of a transformer's forward for the shapes the rollout repeats
(``rollout.cuda_graphs``).

At one request (two rows with CFG) a real-size forward is bound by kernel launches: SD3.5-M at
256 px launches about 4,000 kernels per forward and takes 45 ms eager, where replaying a
captured graph of the same kernels takes 12 ms (the performance issue's H200 figures). A
rollout repeats a handful of shapes for every step of every batch, so each shape is captured
once and replayed from then on.

``GraphedForward`` stands in for a module's ``forward``. A call's key is its arguments' tree
structure with every tensor's shape, dtype and device and every other argument's value, plus
the grad and autocast modes. The first call with a key runs eagerly (it also compiles and
autotunes whatever ``torch.compile`` owns inside). The second warms up on a side stream and
captures a graph into static input buffers. Later calls copy their inputs into those buffers,
replay, and return clones of the static outputs, so a caller may keep a result across calls.

What the graph sees:
- Weights are read where they live. Weight sync and adapter updates write them in place
  (``sync/weights.py``), so a replay uses the current weights.
- Anything the forward decides on the host (a Python branch on a value, a shape from a
  tensor's contents) is frozen at capture. A forward that needs the host (``.item()``, a copy
  from host memory) cannot be captured: the capture fails, that key runs eagerly from then on,
  and one warning says so.
- Calls with gradients enabled, or with a tensor off the GPU, always run eagerly.

All graphs share one memory pool, and at most ``max_graphs`` are kept (the least recently
replayed goes first): a stream of mixed shapes (continuous batching) cannot pin unbounded
memory.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

log = logging.getLogger(__name__)


@dataclass
class Captured:
    """One key's graph: replaying ``replay`` recomputes ``outputs`` from ``inputs``."""

    replay: Callable[[], None]
    inputs: list[Tensor]  # the static buffers of the call's tensor arguments, in order
    outputs: Any  # the static outputs, in the forward's own structure


class GraphedForward:
    def __init__(self, forward: Callable, max_graphs: int = 16, warmup: int = 2) -> None:
        """``forward``: the callable replaced (a module's bound ``forward``). ``warmup``: eager
        runs on the side stream before each capture (cuBLAS workspaces, allocator state)."""
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.forward = forward
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.seen: set[tuple] = set()  # keys run once eagerly, captured at their next call
        self.failed: set[tuple] = set()  # keys whose capture failed: eager from then on
        self.pool = None
        self.stats = {"eager": 0, "captured": 0, "replayed": 0, "failed": 0, "evicted": 0}

    def __call__(self, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(leaves, spec)
        if key is None or key in self.failed:
            self.stats["eager"] += 1
            return self.forward(*args, **kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:  # the shape's first call: eager (compiles, autotunes)
                self.seen.add(key)
                self.stats["eager"] += 1
                return self.forward(*args, **kwargs)
            entry = self._try_capture(key, leaves, spec)
            if entry is None:
                return self.forward(*args, **kwargs)
        self.graphs.move_to_end(key)
        tensors = [v for v in leaves if isinstance(v, Tensor)]
        for buf, value in zip(entry.inputs, tensors, strict=True):
            buf.copy_(value)
        entry.replay()
        self.stats["replayed"] += 1
        return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, entry.outputs)

    def _key(self, leaves: list, spec) -> tuple | None:
        """The call's signature, or None when it must run eagerly."""
        if torch.is_grad_enabled() or not self.capturable():
            return None
        sig = []
        for v in leaves:
            if isinstance(v, Tensor):
                if not self.on_device(v) or v.requires_grad:
                    return None
                sig.append(("t", tuple(v.shape), v.dtype, v.device, v.stride()))
            else:
                try:
                    hash(v)
                except TypeError:
                    return None
                sig.append(("v", v))
        dev = next((v.device.type for v in leaves if isinstance(v, Tensor)), "cuda")
        amp = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return (str(spec), tuple(sig), amp)

    def _try_capture(self, key: tuple, leaves: list, spec) -> Captured | None:
        try:
            entry = self.capture(leaves, spec)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this key eagerly
            self.failed.add(key)
            self.stats["failed"] += 1
            log.warning(
                "rollout.cuda_graphs: a forward of this shape cannot be captured (%s: %s); "
                "it runs eagerly",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            return None
        self.seen.discard(key)
        self.graphs[key] = entry
        self.stats["captured"] += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats["evicted"] += 1
        return entry

    # --- the CUDA parts (tests replace them to check the bookkeeping on a CPU) -------------
    def capturable(self) -> bool:
        """Whether graphs can be captured now (not already inside a capture)."""
        return torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()

    def on_device(self, t: Tensor) -> bool:
        return t.is_cuda

    def capture(self, leaves: list, spec) -> Captured:
        """Static copies of the call's tensors, a few warm-up runs on a side stream, then the
        capture (torch.cuda.graph) into the shared pool."""
        inputs, args, kwargs = static_call(leaves, spec)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.forward(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (the actor's update in async mode) does not
        # invalidate this thread's capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.forward(*args, **kwargs)
        check_outputs(outputs)
        return Captured(graph.replay, inputs, outputs)


def static_call(leaves: list, spec) -> tuple[list[Tensor], tuple, dict]:
    """A call's static buffers (clones of its tensor leaves, in order) and the arguments that
    read them: what a capture records and each replay's inputs are copied into."""
    inputs = [v.clone() for v in leaves if isinstance(v, Tensor)]
    it = iter(inputs)
    args, kwargs = tree_unflatten([next(it) if isinstance(v, Tensor) else v for v in leaves], spec)
    return inputs, args, kwargs


def check_outputs(outputs) -> None:
    """The forward's outputs must be tensors in containers pytree knows, so that each call
    gets clones, never the static buffers the next replay overwrites."""
    leaves, _ = tree_flatten(outputs)
    odd = [v for v in leaves if v is not None and not isinstance(v, (Tensor, int, float, bool))]
    if odd:
        raise TypeError(f"outputs hold {type(odd[0]).__name__}, not tensors a replay can clone")


def graph_transformer(model: torch.nn.Module, max_graphs: int = 16) -> GraphedForward:
    """Replay ``model``'s transformer (``model.net.transformer``, a diffusers family's denoiser)
    from CUDA graphs: its ``forward`` is replaced on the instance, so module paths, state-dict
    keys and the weight-sync targets stay as they were. Returns the wrapper (its ``stats``)."""
    transformer = getattr(model.net, "transformer", None)
    if not isinstance(transformer, torch.nn.Module):
        raise ValueError(
            f"rollout.cuda_graphs: {type(model.net).__name__} has no diffusers transformer "
            "(net.transformer) to capture"
        )
    graphed = GraphedForward(transformer.forward, max_graphs=max_graphs)
    transformer.forward = graphed
    return graphed
