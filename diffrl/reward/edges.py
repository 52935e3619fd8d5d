"""The reward engine's two edges, per sample: rollout -> reward -> actor.

```
 rollout.stream ─▶ PerSample ─samples─▶ score_ready ─scored samples─▶ collect ─▶ on_part
 (micro-batches)   one record per row   ready rows of one micro-       whole micro-batches,
                                        batch per pool call            in rollout order
```

- ``PerSample`` is the channel a rollout engine writes: each micro-batch it puts (when it is
  decoded) goes on as one ``Sample`` per row, all at once (``put_many``), so a channel's
  consumer sees a micro-batch's rows together.
- ``score_ready`` (the reward side) takes every ready sample, and scores the ready rows of one
  micro-batch (the lowest-numbered that has any, up to ``cap`` rows) in one pool call, so a
  model scorer still batches; each scored row goes on as a ``ScoredSample``. A pool call never
  mixes micro-batches: a scorer's own metrics (accuracy, size_kb) are means over its call,
  weighted by the call's rows, and with one call per micro-batch (the default: no cap, and a
  micro-batch's rows arrive together) they are today's figures bit for bit, whatever the
  timing.
- ``collect`` (the actor side) hands micro-batch k to ``on_part`` once all its rows are scored
  and micro-batches before it are handed: whole groups (a micro-batch holds whole groups), in
  rollout order, the same rows as the micro-batch the rollout produced.

Scorers are row-independent (each row's score depends on that row only; a model scorer's
batched forward up to its kernels' batch-size rounding), so the rows equal those of scoring
whole micro-batches. A ``groupwise`` pool (a group scorer, or ``reward.aggregate=gdpo``) is
not: its calls take whole groups only (a sample waits until its group's rows are all here;
a cap is rounded up to whole groups), and a pool without one streams per sample as before.
The channels may be the in-process ``Channel`` (``run_local``) or TransferQueue channels
between processes (``backends/ray_edges.py``); this module only needs
``put``/``put_many``/``get_ready``/``close``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from diffrl.channel import Channel, ChannelClosed
from diffrl.types import ScoredBatch, Trajectory, select_rows

OnPart = Callable[[ScoredBatch], Awaitable[None]]


@dataclass(frozen=True)
class Sample:
    """One row of a rollout micro-batch, on the rollout -> reward edge."""

    traj: Trajectory  # 1 row
    part: int  # its micro-batch, numbered in rollout order from 0
    row: int  # its row in that micro-batch
    rows: int  # the micro-batch's rows
    ready_at: float  # time.time() when the rollout put it (its micro-batch decoded)
    group_rows: int  # rows of its micro-batch in its group (a micro-batch holds whole groups)


@dataclass(frozen=True)
class ScoredSample:
    """One scored row, on the reward -> actor edge. The first row of each pool call carries
    the call's metrics and row count (``call``); the others carry none (``call`` 0)."""

    scored: ScoredBatch  # 1 row
    part: int
    row: int
    rows: int
    wait_s: float  # from the sample's put to the start of its pool call
    call: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


async def _put_many(out: Any, records: list, version: int) -> None:
    if hasattr(out, "put_many"):
        await out.put_many(records, version)
    else:
        for r in records:
            await out.put(r, version)


class PerSample:
    """A channel for ``RolloutEngine.stream``: each trajectory put becomes one ``Sample`` per
    row in ``out``; ``close`` closes ``out``."""

    def __init__(self, out: Any) -> None:
        self.out, self.parts = out, 0

    async def put(self, traj: Trajectory, version: int) -> None:
        now, n = time.time(), len(traj)
        ids = traj.group.tolist()
        size = {g: ids.count(g) for g in set(ids)}
        records = [
            Sample(select_rows(traj, torch.tensor([i])), self.parts, i, n, now, size[ids[i]])
            for i in range(n)
        ]
        self.parts += 1
        await _put_many(self.out, records, version)

    def close(self) -> None:
        self.out.close()


class ScoresTrajectories(Protocol):
    """What ``score_ready`` needs of a reward engine (and, optionally, ``groupwise``: True
    when each call must hold whole groups)."""

    async def score(self, traj: Trajectory) -> tuple[ScoredBatch, dict[str, float]]: ...


async def score_ready(samples: Any, out: Any, rewards: ScoresTrajectories, cap: int = 0) -> None:
    """The reward side. Consumes ``samples``; waits for a sample when it holds none, else
    takes what is ready without waiting; scores the ready rows of the lowest-numbered micro-
    batch (at most ``cap``, 0 = all) in one pool call, and puts each scored row into ``out``.
    For a ``groupwise`` pool only rows of whole groups are ready, and it waits for a sample
    while no group is whole. Ends when ``samples`` is closed and every sample is scored (or,
    groupwise, when only partial groups are left: the collector reports the cut); closes
    ``out`` however it ends (a scorer's error then reaches the collector as a short stream)."""
    pending: dict[int, list[Sample]] = {}
    closed = False
    whole = bool(getattr(rewards, "groupwise", False))
    try:
        while True:
            if not closed:
                try:
                    ready = _ready_part(pending, whole)
                    for s in await samples.get_ready(wait=ready is None):
                        pending.setdefault(s.part, []).append(s)
                except ChannelClosed:
                    closed = True
            part = _ready_part(pending, whole)
            if part is None:
                if closed:
                    return
                continue
            take = _take(pending[part], cap, whole)
            taken = {id(s) for s in take}
            pending[part] = [s for s in pending[part] if id(s) not in taken]
            if not pending[part]:
                del pending[part]
            start = time.time()
            batch, metrics = await rewards.score(Trajectory.concat([s.traj for s in take]))
            scored = [
                ScoredSample(
                    _row(batch, j, s.traj),
                    s.part,
                    s.row,
                    s.rows,
                    start - s.ready_at,
                    len(take) if j == 0 else 0,
                    metrics if j == 0 else {},
                )
                for j, s in enumerate(take)
            ]
            await _put_many(out, scored, batch.traj.policy_version)
    finally:
        out.close()


def _whole_groups(samples: list[Sample]) -> list[list[Sample]]:
    """``samples`` (of one micro-batch) grouped by their group, in arrival order, keeping only
    the groups whose rows are all here."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(int(s.traj.group[0]), []).append(s)
    return [g for g in groups.values() if len(g) == g[0].group_rows]


def _ready_part(pending: dict[int, list[Sample]], whole: bool) -> int | None:
    """The lowest-numbered micro-batch with rows to score now (``whole``: a whole group)."""
    ready = [p for p, got in pending.items() if not whole or _whole_groups(got)]
    return min(ready) if ready else None


def _take(samples: list[Sample], cap: int, whole: bool) -> list[Sample]:
    """The rows of one pool call: the first ``cap`` (0 = all), or with ``whole`` the whole
    groups, as many as fit in ``cap`` but at least one."""
    if not whole:
        return samples[: cap or None]
    take: list[Sample] = []
    for group in _whole_groups(samples):
        if take and cap and len(take) + len(group) > cap:
            break
        take += group
    return take


def _row(batch: ScoredBatch, j: int, traj: Trajectory) -> ScoredBatch:
    """Row ``j`` of ``batch``, around ``traj`` (that row's own sample: its tensors are not
    copied again)."""
    i = torch.tensor([j])
    per_scorer = {k: v[i] for k, v in batch.per_scorer.items()}
    by_modality = {k: v[i] for k, v in batch.modality_rewards.items()}
    return ScoredBatch(traj, batch.rewards[i], per_scorer, batch.valid[i], by_modality)


class StreamCut(RuntimeError):
    """The scored stream ended with a micro-batch not fully scored (its producer failed)."""


@dataclass
class Collected:
    """What ``collect`` gathered: the scored micro-batches in rollout order, each pool call's
    (first part, first row, metrics, rows), and the samples' waits for scoring."""

    parts: list[ScoredBatch] = field(default_factory=list)
    calls: list[tuple[int, int, dict[str, float], int]] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The pool calls' metrics, each sample-weighted by its call's rows, in rollout order
        (one call per micro-batch: the sums the one-call-per-micro-batch loop made)."""
        extra: dict[str, list[tuple[float, int]]] = {}
        for _, _, m, n in sorted(self.calls, key=lambda c: (c[0], c[1])):
            for k, v in m.items():
                extra.setdefault(k, []).append((v, n))
        out = {
            k: sum(v * n for v, n in vals) / sum(n for _, n in vals) for k, vals in extra.items()
        }
        if self.waits:  # how long a sample waited for its pool call (it starts before its
            # micro-batch's last row is scored when calls are capped or rows arrive apart)
            out["perf/score_wait_s"] = sum(self.waits) / len(self.waits)
            out["perf/score_calls"] = float(len(self.calls))
        return out


async def collect(scored: Any, on_part: OnPart | None = None) -> Collected:
    """The actor side. Consumes ``scored`` (waits on it; unblocked by each put and by its
    close); hands each micro-batch to ``on_part`` as soon as all its rows are scored and the
    ones before it are handed. ``StreamCut`` when the stream closes with a micro-batch
    incomplete."""
    out = Collected()
    waiting: dict[int, dict[int, ScoredSample]] = {}
    while True:
        try:
            got = await scored.get_ready()
        except ChannelClosed:
            break
        for s in got:
            waiting.setdefault(s.part, {})[s.row] = s
            out.waits.append(s.wait_s)
            if s.call:
                out.calls.append((s.part, s.row, s.metrics, s.call))
        while (rows := waiting.get(len(out.parts))) and len(rows) == next(iter(rows.values())).rows:
            del waiting[len(out.parts)]
            part = ScoredBatch.concat([rows[i].scored for i in range(len(rows))])
            out.parts.append(part)
            if on_part is not None:
                await on_part(part)
    if waiting:
        k = min(waiting)
        raise StreamCut(
            f"the scored stream ended with micro-batch {k} at {len(waiting[k])} of "
            f"{next(iter(waiting[k].values())).rows} rows (its rollout or scorer failed)"
        )
    return out


async def first_error(*aws: Awaitable[Any]) -> list[Any]:
    """Runs ``aws`` together; returns their results, or raises the first error after
    cancelling the rest. A ``StreamCut`` is only a symptom: the others then get a moment to
    finish, and the error that cut the stream (a scorer's, the rollout's) is raised instead."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = _errors(tasks)
        if errors and all(isinstance(e, StreamCut) for e in errors):
            await asyncio.wait(tasks, timeout=30)
            errors = _errors(tasks)
        causes = [e for e in errors if not isinstance(e, StreamCut)]
        if causes or errors:
            raise (causes or errors)[0]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _errors(tasks: Sequence[asyncio.Future]) -> list[BaseException]:
    return [e for t in tasks if t.done() and not t.cancelled() and (e := t.exception())]


async def run_local(
    stream: Callable[[PerSample], Awaitable[None]],
    rewards: ScoresTrajectories,
    on_part: OnPart | None = None,
    cap: int = 0,
) -> Collected:
    """Both edges in this process: ``stream(channel)`` is the rollout writing its micro-
    batches; in-process channels carry the samples (unbounded: a micro-batch's rows land
    together) and the scored samples."""
    samples, scored = Channel(), Channel()
    _, _, got = await first_error(
        stream(PerSample(samples)),
        score_ready(samples, scored, rewards, cap),
        collect(scored, on_part),
    )
    return got
