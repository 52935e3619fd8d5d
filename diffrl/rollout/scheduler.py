"""Request-level continuous batching: the training rollout's scheduler (``rollout.engine=
scheduler``, ``diffrl/rollout/scheduled.py``) and ``benchmarks/continuous_batching.py``'s.

A *request* is one prompt's G samples (one group) with its own seeds, latent shape
(resolution, frames), sigma schedule and SDE mask. Requests wait in a FIFO queue; the
scheduler keeps one *bucket* of running rows per latent shape, and each ``step()`` runs one
forward over one bucket. Rows of a bucket may sit at different steps of their own schedules
(the model takes a sigma per row), so a request is admitted into a running bucket between two
steps as soon as the bucket has room for it under the token budget: step-level admission.
When a request's G rows reach sigma 0 its latents are decoded and it is handed back, so
results stream out request by request.

State machine and its invariants:

- ``waiting`` (FIFO) -> a bucket's rows (``_start``) -> handed back (``_retire``); a request is
  in exactly one of them, and its G rows enter, step and leave a bucket together, contiguous
  and in admission order (a request's rows are always one slice of its bucket).
- A bucket's cost (rows x latent positions) stays within ``token_budget``, except a bucket of
  one request bigger than the budget (it runs alone).
- Which bucket runs: the one holding the oldest request, unless another bucket is full (no
  room for its next waiting request) and the oldest request has waited less than
  ``max_wait_s``; a full batch goes first, but nothing waits longer than that.

A step of a row is the rollout engine's step: an Euler (ODE) step, or, where the request's
``sde_mask`` says so, a stochastic step (``samplers.STOCHASTIC_STEPS``) with its Gaussian
log-prob, drawn with the request's own noise for that step. Every row's noise comes from its
own seed exactly as ``RolloutEngine`` draws it (or is handed in whole by it, group tricks
applied), so the same seeds give the same trajectories as the micro-batch engine, up to the
float noise of matmuls over other batches (fp32: ~1e-6; bf16: ~1e-2).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diffrl.rollout.samplers import (
    STOCHASTIC_STEPS,
    euler_step,
    guided_velocity,
    modality_log_probs,
    noise_from_seeds,
    null_row,
    sigma_schedule,
)
from diffrl.types import host_to_device


@dataclass
class Request:
    """One prompt's G samples: ``input_ids`` (L,), ``seeds`` (G,), the latent ``shape`` of
    one sample, and its own ``num_steps``; ``cond`` (G, ...) per-row conditions or None.

    The training rollout also gives the whole plan of the request: ``sigmas`` (T+1,) (default
    ``sigma_schedule(num_steps, shift)``), ``sde_mask`` (T,) bool (default: every step ODE) and
    ``noise`` (G, T+1, *shape): the initial state and each step's noise (default: the initial
    state drawn from the seeds; an SDE step needs it), or a function that draws it, called
    when the request is admitted (so waiting requests hold no noise)."""

    input_ids: Tensor
    seeds: Tensor
    shape: tuple[int, ...]
    num_steps: int
    cond: Tensor | None = None
    rid: int = -1  # set by submit() when left at -1
    arrival: float = 0.0  # set by submit()
    sigmas: Tensor | None = None
    sde_mask: Tensor | None = None
    noise: Tensor | Callable[[], Tensor] | None = None
    keep_latents: bool = False  # hand back x at every sigma (G, T+1, *shape)
    # the rows start as bitwise copies in runs of ``copies`` (a group sharing its initial
    # noise), and after SDE step i the runs are min(runs, after[i]) long (a tree's branches;
    # default 1): one forward per run, as the micro-batch engine takes them
    copies: int = 1
    after: tuple[int, ...] = ()

    def cost(self) -> int:
        return len(self.seeds) * tokens(self.shape)


@dataclass
class Finished:
    request: Request
    x0: Tensor  # (G, *shape) float32, on the host
    media: dict[str, Tensor]  # the family's decode of x0 (empty without decode)
    latency_s: float  # from submit() to hand-back
    log_probs: Tensor | None = None  # (G, T) float32 on the host: each step's (0 for ODE steps)
    latents: Tensor | None = None  # (G, T+1, *shape) float32 on the host (keep_latents)
    step_versions: list[int] = field(default_factory=list)  # (T,) the version that took a step
    modality_log_probs: Tensor | None = None  # (G, T, 2) (a video+audio family, SDE steps)


@dataclass
class _Track:
    """A running request's records so far, one entry per step taken."""

    request: Request
    sigmas: Tensor  # (T+1,) on the host
    sigmas_dev: Tensor  # (T+1,) on the device, in the model's dtype
    mask: Tensor  # (T,) bool, on the host
    noise: Tensor | None  # (G, T+1, *shape) on the device, or None (ODE only)
    copies: int = 1  # the rows are bitwise copies in runs of this
    step: int = 0
    latents: list[Tensor] = field(default_factory=list)
    log_probs: list[Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    by_modality: list[Tensor] = field(default_factory=list)


@dataclass
class _Rows:
    """A bucket's running rows: state (n, *shape), and its requests in row order (each holds
    one contiguous slice of rows). A bucket starts afresh once it has emptied."""

    x: Tensor  # (n, *shape)
    ids: Tensor  # (n, L)
    cond: Tensor | None = None  # (n, ...)
    tracks: list[_Track] = field(default_factory=list)

    def cost(self) -> int:
        return len(self.x) * tokens(tuple(self.x.shape[1:])) if self.tracks else 0

    def spans(self) -> Iterator[tuple[_Track, int, int]]:
        start = 0
        for t in self.tracks:
            g = len(t.request.seeds)
            yield t, start, start + g
            start += g


@dataclass
class _StepRows:
    """One step of a bucket: its requests' row spans, each row's sigma and next sigma (n,) on
    the device, whether it takes an SDE step (n,) on the host, the rows that run (``heads``:
    the first of each run of copies) and, with copies, each row's head (``of_row``)."""

    spans: list[tuple[_Track, int, int]]
    sig: Tensor
    nxt: Tensor
    sde: Tensor
    heads: Tensor
    of_row: Tensor | None

    @staticmethod
    def of(rows: _Rows) -> _StepRows:
        spans = list(rows.spans())
        sig = torch.cat([t.sigmas_dev[t.step].expand(b - a) for t, a, b in spans])
        nxt = torch.cat([t.sigmas_dev[t.step + 1].expand(b - a) for t, a, b in spans])
        sde = torch.cat([t.mask[t.step].expand(b - a) for t, a, b in spans])
        heads: list[int] = []
        of_row: list[int] = []  # each row's head, as a position in `heads`
        for t, a, b in spans:
            of_row += [len(heads) + j // t.copies for j in range(b - a)]
            heads += range(a, b, t.copies)
        copied = len(heads) < len(rows.x)
        return _StepRows(
            spans, sig, nxt, sde, torch.tensor(heads, dtype=torch.long),
            torch.tensor(of_row, dtype=torch.long) if copied else None,
        )  # fmt: skip


def tokens(shape: Sequence[int]) -> int:
    """A sample's cost in latent positions (everything but the channel axis): the unit of the
    token budget (a family's patch size divides both sides alike)."""
    return math.prod(shape[1:])


def initial_noise(seeds: Tensor, num_steps: int, shape: tuple[int, ...]) -> Tensor:
    """(G, *shape): what ``RolloutEngine`` starts a sample from (the first of its T+1 noise
    slices, drawn from the sample's seed), so both paths start alike."""
    return noise_from_seeds(seeds, (num_steps + 1, *shape), "cpu")[:, 0]


def _check_noise(r: Request, noise: Tensor) -> Tensor:
    want = (len(r.seeds), r.num_steps + 1, *r.shape)
    if tuple(noise.shape) != want:
        raise ValueError(f"noise is {tuple(noise.shape)}, not {want}")
    return noise


@dataclass(frozen=True)
class StepRule:
    """How the stochastic steps are taken (the rollout's ``sde_step`` and ``noise_level``),
    whether ODE steps' forwards run under bf16 autocast (``rollout.ode_dtype``), and, for a
    video+audio family, its (n_video, n_audio) split for per-modality log-probs."""

    sde_step: str = "flow_grpo"
    noise_level: float = 0.7
    low_precision_ode: bool = False
    modality_split: tuple[int, int] | None = None


class ContinuousBatcher:
    """Schedules requests over ``velocity(x, sigma, ids[, cond])`` (a family model in its
    canonical convention). ``token_budget``: the most latent positions (rows x positions) one
    forward takes; a request bigger than the budget still runs, alone. ``decode``: the family's
    ``decode`` or None. ``clock``: seconds, for arrival and waiting. ``before_step`` runs
    before each forward (the rollout applies an offered weight update there) and ``version``
    says which policy version takes the step."""

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
        rule: StepRule = StepRule(),
        before_step: Callable[[], None] | None = None,
        version: Callable[[], int] = lambda: 0,
        packed: Callable[..., list[Tensor]] | None = None,
    ) -> None:
        """``ids_device``: where the model wants ``input_ids`` (``FamilyModel.ids_device``;
        default ``device``). ``packed``: ``models.packed.packed_velocity`` bound to the model
        (xs, sigmas, ids per shape -> velocities): then every bucket runs in one packed
        forward under one shared budget, instead of a bucket per forward."""
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if cfg_scale != 1.0 and not len(null_ids):
            raise ValueError("classifier-free guidance needs the empty prompt's null_ids")
        if rule.sde_step not in STOCHASTIC_STEPS:
            raise ValueError(f"unknown sde_step {rule.sde_step!r}; one of {list(STOCHASTIC_STEPS)}")
        self.velocity, self.device, self.dtype = velocity, device, dtype
        self.budget, self.max_wait = token_budget, max_wait_s
        self.cfg_scale, self.null_ids, self.shift = cfg_scale, tuple(null_ids), shift
        self.decode, self.clock = decode, clock
        self.ids_device = device if ids_device is None else ids_device
        self.rule, self.before_step, self.version = rule, before_step, version
        self.packed = packed
        self.waiting: deque[Request] = deque()
        self.buckets: dict[tuple[int, ...], _Rows] = {}
        self._in_flight: set[int] = set()
        self._next_rid = 0
        self.forwards = 0  # forward calls so far (each over one bucket)

    # --- queue --------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        r = request
        if r.input_ids.ndim != 1:
            raise ValueError(f"a request's input_ids are (L,), got {tuple(r.input_ids.shape)}")
        if r.seeds.ndim != 1 or not len(r.seeds):
            raise ValueError("a request needs a (G,) tensor of seeds, G >= 1")
        if r.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {r.num_steps}")
        if r.cond is not None and len(r.cond) != len(r.seeds):
            raise ValueError(f"cond has {len(r.cond)} rows for {len(r.seeds)} seeds")
        if r.sigmas is not None and r.sigmas.shape != (r.num_steps + 1,):
            raise ValueError(f"sigmas are {tuple(r.sigmas.shape)}, not ({r.num_steps + 1},)")
        if r.sde_mask is not None and r.sde_mask.shape != (r.num_steps,):
            raise ValueError(f"sde_mask is {tuple(r.sde_mask.shape)}, not ({r.num_steps},)")
        if isinstance(r.noise, Tensor):
            _check_noise(r, r.noise)
        if r.sde_mask is not None and bool(r.sde_mask.any()) and r.noise is None:
            raise ValueError("a request with SDE steps needs its (G, T+1, *shape) noise")
        if r.cond is not None and self.packed is not None:
            raise ValueError("a packed forward takes no per-row conditions beyond the text")
        if r.rid < 0:
            r.rid = self._next_rid
        if r.rid in self._in_flight:
            raise ValueError(f"request id {r.rid} is already in flight")
        self._in_flight.add(r.rid)
        self._next_rid = max(self._next_rid, r.rid + 1)
        r.arrival = self.clock()
        self.waiting.append(r)
        return r.rid

    @property
    def idle(self) -> bool:
        return not self.waiting and not any(b.tracks for b in self.buckets.values())

    def run(self) -> Iterator[Finished]:
        """Steps until every submitted request has finished, yielding each as it does."""
        while not self.idle:
            yield from self.step()

    # --- scheduling ---------------------------------------------------------------------
    def _room(self, request: Request) -> bool:
        """Packed, the buckets share the budget (they run as one forward); else each has it."""
        if self.packed is not None:
            used = sum(r.cost() for r in self.buckets.values())
        else:
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
            if shape in blocked or keep and self.packed is not None or not self._room(req):
                blocked.add(shape)  # packed: one budget, so FIFO over every shape
                keep.append(req)
                continue
            self._start(req)
        self.waiting = keep

    def _start(self, req: Request) -> None:
        shape = tuple(req.shape)
        g = len(req.seeds)
        sigmas = req.sigmas if req.sigmas is not None else sigma_schedule(req.num_steps, self.shift)
        mask = (
            req.sde_mask
            if req.sde_mask is not None
            else torch.zeros(req.num_steps, dtype=torch.bool)
        )
        noise = None
        if req.noise is not None:
            drawn = req.noise if isinstance(req.noise, Tensor) else _check_noise(req, req.noise())
            noise = host_to_device(drawn, self.device, self.dtype)
            x = noise[:, 0]
        else:
            x = host_to_device(initial_noise(req.seeds, req.num_steps, shape), self.device)
            x = x.to(self.dtype)
        sig_dev = host_to_device(sigmas, self.device, self.dtype)
        track = _Track(req, sigmas, sig_dev, mask, noise, copies=req.copies)
        track.latents.append(x)
        ids = req.input_ids.to(self.ids_device).expand(g, -1)
        cond = None if req.cond is None else req.cond.to(self.device, self.dtype)
        rows = self.buckets.get(shape)
        if rows is None or not rows.tracks:
            rows = self.buckets[shape] = _Rows(x, ids, cond)
        else:
            if (rows.cond is None) != (cond is None) or rows.ids.shape[1] != ids.shape[1]:
                raise ValueError(
                    "requests of one latent shape must agree on conditions and token length"
                )
            rows.x, rows.ids = torch.cat([rows.x, x]), torch.cat([rows.ids, ids])
            if rows.cond is not None and cond is not None:  # both or neither, as checked
                rows.cond = torch.cat([rows.cond, cond])
        rows.tracks.append(track)

    def _pick(self) -> list[tuple[int, ...]]:
        """The buckets the next forward runs: every live one when packed, else one."""
        live = {s: r for s, r in self.buckets.items() if r.tracks}
        if not live or self.packed is not None:
            return list(live)

        def oldest_of(s: tuple[int, ...]) -> float:
            return min(t.request.arrival for t in live[s].tracks)

        oldest = min(live, key=oldest_of)
        if self.clock() - oldest_of(oldest) >= self.max_wait:
            return [oldest]
        # just after _admit, a shape with a request still waiting has no room for it
        pending = {tuple(q.shape) for q in self.waiting}
        full = [s for s in live if s in pending or live[s].cost() >= self.budget]
        return [min(full, key=oldest_of) if full else oldest]

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Admit what fits, then one forward over one bucket (packed: over every bucket);
        returns the requests it finished (decoded)."""
        self._admit()
        shapes = self._pick()
        if not shapes:
            return []
        if self.before_step is not None:
            self.before_step()
        buckets = [self.buckets[s] for s in shapes]
        steps = [_StepRows.of(rows) for rows in buckets]
        for rows, st, v in zip(buckets, steps, self._velocities(buckets, steps), strict=True):
            rows.x = self._advance(rows, st, v)
        self.forwards += 1
        return [f for rows in buckets for f in self._retire(rows)]

    def _advance(self, rows: _Rows, st: _StepRows, v: Tensor) -> Tensor:
        """Every row of ``rows`` one step along its own schedule, given its velocity ``v``:
        (n, *shape)."""
        spans, sig, nxt, sde = st.spans, st.sig, st.nxt, st.sde
        x = euler_step(rows.x, v, sig, nxt)  # ODE steps, and the last step to sigma=0
        lp = torch.zeros(len(x), device=x.device)
        by_mod = torch.zeros(len(x), 2, device=x.device)
        if sde.any():
            on = host_to_device(sde.nonzero().squeeze(1), x.device)
            noise = torch.cat(
                [t.noise[:, t.step + 1] for t, _, _ in spans if t.mask[t.step]]  # type: ignore[index]
            )
            # sde_std's stand-in for sigma=1 is the schedule's second sigma, per request
            cap = torch.cat([t.sigmas_dev[1].expand(b - a) for t, a, b in spans if t.mask[t.step]])
            step_fn = STOCHASTIC_STEPS[self.rule.sde_step]
            x_s, lp_s, mean, std = step_fn(
                rows.x[on], v[on], sig[on], nxt[on], self.rule.noise_level, cap, noise=noise
            )
            x[on], lp[on] = x_s, lp_s.to(lp)
            if self.rule.modality_split is not None:
                by_mod[on] = modality_log_probs(x_s, mean, std, self.rule.modality_split).float()
        version = self.version()
        for t, a, b in spans:
            if t.request.keep_latents:
                t.latents.append(x[a:b])
            t.log_probs.append(lp[a:b])
            t.versions.append(version)
            if self.rule.modality_split is not None:
                t.by_modality.append(by_mod[a:b])
            if t.mask[t.step]:  # the SDE noise splits the runs of copies
                after = t.request.after[t.step] if t.request.after else 1
                t.copies = min(t.copies, after)
            t.step += 1
        return x

    def _velocities(self, buckets: list[_Rows], steps: list[_StepRows]) -> list[Tensor]:
        """Each bucket's guided velocity, (n, *shape) per bucket. Rows run once per run of
        copies (``Request.copies``), their output copied to the run. Under
        ``low_precision_ode`` the rows at an ODE step run under bf16 autocast and those at an
        SDE step in the model's dtype (their log-probs stay exact): one forward per kind, as
        the micro-batch engine runs them. Packed, each kind is one call over every bucket."""
        heads = [st.heads for st in steps]
        v_heads = [
            torch.empty((len(h), *r.x.shape[1:]), dtype=self.dtype, device=r.x.device)
            for h, r in zip(heads, buckets, strict=True)
        ]
        for low in (False, True):
            # per bucket, the positions (among its heads) that run at this precision
            runs = []
            for st, h in zip(steps, heads, strict=True):
                sde_h = st.sde[h]
                wants = ~sde_h if low else sde_h
                if not self.rule.low_precision_ode:
                    wants = torch.ones_like(sde_h) if not low else torch.zeros_like(sde_h)
                runs.append(wants.nonzero().squeeze(1))
            if not any(len(r) for r in runs):
                continue
            with torch.autocast(self.device.type, torch.bfloat16, enabled=low):
                outs = self._forward(buckets, steps, heads, runs)
            for vh, at, out in zip(v_heads, runs, outs, strict=True):
                if len(at):
                    vh[host_to_device(at, vh.device)] = out.to(self.dtype)
        return [
            vh if st.of_row is None else vh[host_to_device(st.of_row, vh.device)]
            for vh, st in zip(v_heads, steps, strict=True)
        ]

    def _forward(
        self, buckets: list[_Rows], steps: list[_StepRows], heads: list[Tensor], runs: list[Tensor]
    ) -> list[Tensor]:
        """The guided velocity of rows ``heads[k][runs[k]]`` of each bucket k."""
        picked = []
        for rows, st, h, at in zip(buckets, steps, heads, runs, strict=True):
            idx = h[at]  # rows of the bucket, on the host
            on = host_to_device(idx, rows.x.device)
            c = None if rows.cond is None else rows.cond[on]
            picked.append((rows.x[on], st.sig[on], rows.ids[idx.to(rows.ids.device)], c))
        if self.packed is None:
            return [
                guided_velocity(self.velocity, x, s, i, self.cfg_scale, self.null_ids, c)
                if len(x) else x
                for x, s, i, c in picked
            ]  # fmt: skip
        live = [k for k, p in enumerate(picked) if len(p[0])]
        xs = [picked[k][0] for k in live]
        ss = [picked[k][1] for k in live]
        ids = [picked[k][2] for k in live]
        if self.cfg_scale != 1.0:  # both branches in the one call, as guided_velocity
            null = [null_row(self.null_ids, i).expand_as(i) for i in ids]
            xs, ss, ids = xs + xs, ss + ss, ids + null
        vs = self.packed(xs, ss, ids)
        if self.cfg_scale != 1.0:
            n = len(live)
            vs = [u + self.cfg_scale * (c - u) for c, u in zip(vs[:n], vs[n:], strict=True)]
        out = [p[0] for p in picked]
        for k, v in zip(live, vs, strict=True):
            out[k] = v
        return out

    def _retire(self, rows: _Rows) -> list[Finished]:
        """Take the requests whose rows reached sigma 0 out of the bucket, decoded, and hand
        them back (a request's G rows enter together and share a schedule, so they finish
        together)."""
        spans = list(rows.spans())
        done = [(t, a, b) for t, a, b in spans if t.step == t.request.num_steps]
        if not done:
            return []
        keep = [k for t, a, b in spans if t.step < t.request.num_steps for k in range(a, b)]
        out = []
        for t, a, b in done:
            req = t.request
            x0 = rows.x[a:b].float()
            media = self.decode(x0) if self.decode is not None else {}
            self._in_flight.discard(req.rid)
            lat = torch.stack(t.latents, 1).float().cpu() if req.keep_latents else None
            by_mod = None
            if self.rule.modality_split is not None and t.mask.any():
                by_mod = torch.stack(t.by_modality, 1).cpu()
            out.append(
                Finished(
                    req,
                    x0.cpu(),
                    media,
                    self.clock() - req.arrival,
                    log_probs=torch.stack(t.log_probs, 1).float().cpu(),
                    latents=lat,
                    step_versions=t.versions,
                    modality_log_probs=by_mod,
                )
            )
        at = torch.tensor(keep, dtype=torch.long)  # on the host: the ids may live there
        on_x = host_to_device(at, rows.x.device)
        rows.x, rows.ids = rows.x[on_x], rows.ids[at.to(rows.ids.device)]
        rows.cond = None if rows.cond is None else rows.cond[on_x]
        rows.tracks = [t for t in rows.tracks if t.step < t.request.num_steps]
        return out
