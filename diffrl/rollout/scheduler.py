"""Request-level continuous batching for ODE rollouts.

Parked: reached only from tests and ``benchmarks/continuous_batching.py`` (through
``RolloutEngine.batcher``); the parallel issue (38) wires it into `diffrl train` as the
training rollout.

A *request* is one prompt with its own G seeds, latent shape (resolution, frames) and step
count. Requests wait in a FIFO queue; the scheduler keeps one *bucket* of running rows per
latent shape, and each ``step()`` runs one forward over one bucket. Rows of a bucket may sit
at different steps of their own schedules (the model takes a sigma per row), so a request is
admitted into a running bucket between two steps as soon as the bucket has room for it under
the token budget: step-level admission. When the last of a request's G rows reaches sigma 0
its latents are decoded and it is handed back, so results stream out request by request.

Which bucket runs: the one holding the oldest request, unless another bucket is full (no
room for its next waiting request) and the oldest request has waited less than
``max_wait_s``; a full batch goes first, but nothing waits longer than that.

Every row's initial noise comes from its own seed exactly as ``RolloutEngine`` draws it, so the
same seeds give the same latents as unbatched generation, up to the float noise of batched
matmuls (fp32: ~1e-6; bf16: ~1e-2).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diffrl.rollout.samplers import euler_step, guided_velocity, noise_from_seeds, sigma_schedule
from diffrl.types import host_to_device


@dataclass
class Request:
    """One prompt's G samples: ``input_ids`` (L,), ``seeds`` (G,), the latent ``shape`` of
    one sample, and its own ``num_steps``; ``cond`` (G, ...) per-row conditions or None."""

    input_ids: Tensor
    seeds: Tensor
    shape: tuple[int, ...]
    num_steps: int
    cond: Tensor | None = None
    rid: int = -1  # set by submit() when left at -1
    arrival: float = 0.0  # set by submit()

    def cost(self) -> int:
        return len(self.seeds) * tokens(self.shape)


@dataclass
class Finished:
    request: Request
    x0: Tensor  # (G, *shape) float32, on the host
    media: dict[str, Tensor]  # the family's decode of x0 (empty without decode)
    latency_s: float  # from submit() to hand-back


@dataclass
class _Rows:
    """A bucket's running rows: state (n, *shape), each row's request, member and step. A
    bucket starts with its first request's rows, and starts afresh once it has emptied."""

    x: Tensor  # (n, *shape)
    ids: Tensor  # (n, L)
    cond: Tensor | None = None  # (n, ...)
    owner: list[Request] = field(default_factory=list)
    step: list[int] = field(default_factory=list)

    def cost(self) -> int:
        return len(self.owner) * tokens(tuple(self.x.shape[1:]))


def tokens(shape: Sequence[int]) -> int:
    """A sample's cost in latent positions (everything but the channel axis): the unit of the
    token budget (a family's patch size divides both sides alike)."""
    return math.prod(shape[1:])


def initial_noise(seeds: Tensor, num_steps: int, shape: tuple[int, ...]) -> Tensor:
    """(G, *shape): what ``RolloutEngine`` starts a sample from (the first of its T+1 noise
    slices, drawn from the sample's seed), so both paths start alike."""
    return noise_from_seeds(seeds, (num_steps + 1, *shape), "cpu")[:, 0]


class ContinuousBatcher:
    """Schedules requests over ``velocity(x, sigma, ids[, cond])`` (a family model in its
    canonical convention). ``token_budget``: the most latent positions (rows x positions) one
    forward takes; a request bigger than the budget still runs, alone. ``decode``: the family's
    ``decode`` or None. ``clock``: seconds, for arrival and waiting."""

    def __init__(
        self,
        velocity: Callable[..., Tensor],
        device: torch.device,
        *,
        token_budget: int,
        max_wait_s: float = 0.0,
        cfg_scale: float = 1.0,
        null_ids: Sequence[int] = (),
        shift: float = 1.0,
        dtype: torch.dtype = torch.float32,
        decode: Callable[[Tensor], dict[str, Tensor]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        ids_device: torch.device | None = None,
    ) -> None:
        """``ids_device``: where the model wants ``input_ids`` (``FamilyModel.ids_device``;
        default ``device``)."""
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if cfg_scale != 1.0 and not len(null_ids):
            raise ValueError("classifier-free guidance needs the empty prompt's null_ids")
        self.velocity, self.device, self.dtype = velocity, device, dtype
        self.budget, self.max_wait = token_budget, max_wait_s
        self.cfg_scale, self.null_ids, self.shift = cfg_scale, tuple(null_ids), shift
        self.decode, self.clock = decode, clock
        self.ids_device = device if ids_device is None else ids_device
        self.waiting: deque[Request] = deque()
        self.buckets: dict[tuple[int, ...], _Rows] = {}
        self._sigmas: dict[int, Tensor] = {}
        self._in_flight: set[int] = set()
        self._next_rid = 0
        self.forwards = 0  # forward calls so far (each over one bucket)

    # --- queue --------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        if request.input_ids.ndim != 1:
            raise ValueError(
                f"a request's input_ids are (L,), got {tuple(request.input_ids.shape)}"
            )
        if request.seeds.ndim != 1 or not len(request.seeds):
            raise ValueError("a request needs a (G,) tensor of seeds, G >= 1")
        if request.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {request.num_steps}")
        if request.cond is not None and len(request.cond) != len(request.seeds):
            raise ValueError(f"cond has {len(request.cond)} rows for {len(request.seeds)} seeds")
        if request.rid < 0:
            request.rid = self._next_rid
        if request.rid in self._in_flight:
            raise ValueError(f"request id {request.rid} is already in flight")
        self._in_flight.add(request.rid)
        self._next_rid = max(self._next_rid, request.rid + 1)
        request.arrival = self.clock()
        self.waiting.append(request)
        return request.rid

    @property
    def idle(self) -> bool:
        return not self.waiting and not any(b.owner for b in self.buckets.values())

    def run(self) -> Iterator[Finished]:
        """Steps until every submitted request has finished, yielding each as it does."""
        while not self.idle:
            yield from self.step()

    # --- scheduling ---------------------------------------------------------------------
    def _room(self, request: Request) -> bool:
        rows = self.buckets.get(tuple(request.shape))
        used = 0 if rows is None else rows.cost()
        return used == 0 or used + request.cost() <= self.budget

    def _admit(self) -> None:
        """Move waiting requests into their buckets, in arrival order, while they fit. A
        request that does not fit blocks only later requests of its own shape (FIFO per
        shape), not the other buckets."""
        blocked: set[tuple[int, ...]] = set()
        keep: deque[Request] = deque()
        for req in self.waiting:
            shape = tuple(req.shape)
            if shape in blocked or not self._room(req):
                blocked.add(shape)
                keep.append(req)
                continue
            self._start(req)
        self.waiting = keep

    def _start(self, req: Request) -> None:
        shape = tuple(req.shape)
        g = len(req.seeds)
        x = initial_noise(req.seeds, req.num_steps, shape)
        x = host_to_device(x, self.device, self.dtype)
        ids = req.input_ids.to(self.ids_device).expand(g, -1)
        cond = None if req.cond is None else req.cond.to(self.device, self.dtype)
        rows = self.buckets.get(shape)
        if rows is None or not rows.owner:
            rows = self.buckets[shape] = _Rows(x, ids, cond)
        else:
            if (rows.cond is None) != (cond is None) or rows.ids.shape[1] != ids.shape[1]:
                raise ValueError(
                    "requests of one latent shape must agree on conditions and token length"
                )
            rows.x, rows.ids = torch.cat([rows.x, x]), torch.cat([rows.ids, ids])
            if rows.cond is not None and cond is not None:  # both or neither, as checked
                rows.cond = torch.cat([rows.cond, cond])
        rows.owner += [req] * g
        rows.step += [0] * g
        if req.num_steps not in self._sigmas:
            self._sigmas[req.num_steps] = sigma_schedule(req.num_steps, self.shift)

    def _pick(self) -> tuple[int, ...] | None:
        live = {s: r for s, r in self.buckets.items() if r.owner}
        if not live:
            return None
        oldest = min(live, key=lambda s: min(q.arrival for q in live[s].owner))
        waited = self.clock() - min(q.arrival for q in live[oldest].owner)
        if waited >= self.max_wait:
            return oldest
        # just after _admit, a shape with a request still waiting has no room for it
        pending = {tuple(q.shape) for q in self.waiting}
        full = [s for s in live if s in pending or live[s].cost() >= self.budget]
        return min(full, key=lambda s: min(q.arrival for q in live[s].owner)) if full else oldest

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Admit what fits, then one forward over one bucket; returns the requests it
        finished (decoded)."""
        self._admit()
        shape = self._pick()
        if shape is None:
            return []
        rows = self.buckets[shape]
        sig = torch.stack(
            [self._sigmas[q.num_steps][i] for q, i in zip(rows.owner, rows.step, strict=True)]
        )
        nxt = torch.stack(
            [self._sigmas[q.num_steps][i + 1] for q, i in zip(rows.owner, rows.step, strict=True)]
        )
        sig, nxt = (host_to_device(t, self.device, self.dtype) for t in (sig, nxt))
        v = guided_velocity(
            self.velocity, rows.x, sig, rows.ids, self.cfg_scale, self.null_ids, rows.cond
        )
        rows.x = euler_step(rows.x, v.to(self.dtype), sig, nxt)
        self.forwards += 1
        rows.step = [i + 1 for i in rows.step]
        return self._retire(rows)

    def _retire(self, rows: _Rows) -> list[Finished]:
        """Take the rows that reached sigma 0 out of the bucket and hand back their requests
        (a request's G rows enter together and share a schedule, so they finish together)."""
        done = [
            k
            for k, (q, i) in enumerate(zip(rows.owner, rows.step, strict=True))
            if i == q.num_steps
        ]
        if not done:
            return []
        x_done = rows.x[torch.tensor(done, device=rows.x.device)].float().cpu()
        keep = [
            k for k, (q, i) in enumerate(zip(rows.owner, rows.step, strict=True)) if i < q.num_steps
        ]
        at = torch.tensor(keep, dtype=torch.long)  # on the host: the ids may live there
        on_x = host_to_device(at, rows.x.device)
        finished = [rows.owner[k] for k in done]
        rows.x, rows.ids = rows.x[on_x], rows.ids[at.to(rows.ids.device)]
        rows.cond = None if rows.cond is None else rows.cond[on_x]
        rows.owner = [rows.owner[k] for k in keep]
        rows.step = [rows.step[k] for k in keep]
        out, start = [], 0
        while start < len(finished):
            req = finished[start]
            g = len(req.seeds)
            x0 = x_done[start : start + g]
            start += g
            self._in_flight.discard(req.rid)
            media = self.decode(x0) if self.decode is not None else {}
            out.append(Finished(req, x0, media, self.clock() - req.arrival))
        return out
