"""The asynchronous (bounded off-policy) controller: the rollout runs ahead of the actor.

Two loops share one event loop:

- the **rollout loop** (``produce``) rolls out and scores iteration i = start, start+1, ...
  (prompts ``prompts.at(i)``, seed and SDE window of step i, exactly as sync's step i) and
  puts each as a ``Rollout`` record into a channel;
- the **actor loop** (``train_async``) takes one record per update, trains on it, and
  publishes the algorithm's weight plan for that update.

So while update k trains, the rollout of k+1, k+2, ... runs, at most ``run.max_staleness``
policy versions ahead. A record's ``version`` is the actor version whose weight plan the
rollout had applied when it started the record (the weights are those the sync loop would
sample with after that update; for DiffusionNFT between refreshes of ``old`` they equal an
older sync's). The bound holds twice:

1. at the source: the rollout does not start iteration i before the actor has done
   i - max_staleness updates (``Clock.may_start``), so a record is born within the bound;
2. where records are consumed: the actor measures each record's staleness against its own
   version and drops one past the bound (``run.stale=keep`` trains on it), counting it in
   ``async/dropped`` beside ``async/staleness_max`` and ``async/staleness_mean``.
   ``run.stale=correct`` keeps it too, for an algorithm whose loss weighs each sample by the
   ratio of the current policy to the recorded rollout log-probs (FlowGRPO's clipped ratio:
   the importance correction); an algorithm without one is refused at start-up.

Weights reach the rollout only between its batches: after update k the actor refreshes
``old`` itself (actor state) and exports the plan's adapter; if the rollout is between
batches the actor applies it at once (as sync does), otherwise it is left pending and the
rollout applies the latest pending update before it starts its next batch. The actor never
waits for the rollout to finish a batch. With ``run.async_sync=step`` the update is offered to
a busy rollout instead, which applies it at its next denoising-step boundary and finishes the
batch in flight under it; the record's version for the bound is then read off its per-step
versions (``controller/midsync.py``), and FlowGRPO weighs the older steps by truncated
importance sampling against the update's start weights (``TrainBatch.prox_version``).

That schedule is timing's: which update a batch samples with depends on how fast each loop
ran. ``run.async_weights=fixed`` (``auto`` under torchrun) makes it the bound's instead: the
actor only records each update's weights (``Clock.published``), and before iteration i the
rollout loads exactly those of update i - max_staleness (the one the gate waited for), so a
record's weights, version and staleness, and whether it is dropped, follow from i alone. The
ranks of a torchrun launch, each with its own timing, then roll out and train the same
iterations with the same weights (``parallel/launch.py``); the load's ``sync/*`` travel with
the record.

With ``max_staleness=0`` this is sync by construction: iteration i starts only after update
i is published, when the rollout is idle, so the actor applies the sync itself right after
the update and every rollout samples with the weights, seeds and prompts of sync's step i;
the actor's generator is used in the same order. The rows equal sync's except timing and the
``async/*`` keys (``tests/controller/test_async.py``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from diffrl.build import Engines
from diffrl.channel import Channel
from diffrl.config import Config
from diffrl.controller.dead_steps import DeadSteps
from diffrl.controller.flops import PipelinePerf
from diffrl.controller.midsync import bound_version, check_midsync, step_staleness
from diffrl.controller.run_dir import RunDir
from diffrl.controller.run_start import RunStart, started
from diffrl.controller.signals import StopSignals
from diffrl.controller.step import (
    close_step,
    perf_metrics,
    resume,
    rollout_and_score,
    run_eval,
)
from diffrl.sync.receipt import load_verified
from diffrl.sync.weights import WeightUpdate
from diffrl.types import ScoredBatch


@dataclass(frozen=True)
class Rollout:
    """One iteration's scored rollout, on the edge rollout loop -> actor loop."""

    index: int  # the rollout iteration: its prompts, seed and SDE window are sync's step i
    scored: ScoredBatch  # B = prompts_per_step * G rows
    metrics: dict[str, float]  # reward/* and scorer metrics of this rollout
    version: int  # actor version whose weight plan the rollout followed for this batch


@dataclass
class Clock:
    """What the two loops share. Written only on the event loop's thread (the actor's update
    and the rollout's sampling run in worker threads, but neither touches this)."""

    updates: int  # updates the actor has finished (skipped ones included)
    version: int  # the actor's policy version after them
    max_staleness: int
    steps: int  # updates the run makes in all
    dropped: int = 0  # records the actor dropped as too stale
    pending: WeightUpdate | None = None  # the latest plan's weights, not yet in the rollout
    rollout_busy: bool = False  # True while the rollout samples (weights must not change)
    synced: dict[str, float] = field(default_factory=dict)  # sync/* the rollout applied itself
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    # run.async_weights=fixed: update -> (the actor's version after it, its plan's weights or
    # None), kept until the rollout iteration that samples with them starts
    fixed: bool = False
    published: dict[int, tuple[int, WeightUpdate | None]] = field(default_factory=dict)
    held: int = 0  # fixed: the version of the update whose weights the rollout holds
    # run.async_sync=step: updates reach a busy rollout at its next step boundary (``offer``)
    midsync: bool = False
    produced: int = 0  # records the rollout loop finished

    def may_start(self, i: int) -> bool:
        """Iteration i trains update i - dropped + 1: start it when that is within the bound
        of the updates done, and the run still needs it."""
        wanted = i - self.dropped  # the updates done when its record is consumed
        return wanted < self.steps and self.updates >= wanted - self.max_staleness

    def apply_pending(self, parts: Engines) -> dict[str, float]:
        """Load the pending update into the rollout (it is between batches); its sync/*."""
        if self.pending is None:
            return {}
        update, self.pending = self.pending, None
        return load_verified(parts.rollout, update)

    def apply_fixed(self, parts: Engines, i: int) -> tuple[int, dict[str, float]]:
        """``run.async_weights=fixed``: iteration i samples with the weights of exactly update
        i - dropped - max_staleness (the one ``may_start`` waited for; the run's first weights
        before that), whatever the actor has done since. Loads them if they changed; returns
        their version and the sync/* of the load (the record carries them). Deterministic: the
        same on every rank of a torchrun launch, whichever loop runs ahead."""
        wanted = i - self.dropped - self.max_staleness
        due = sorted(u for u in self.published if u <= wanted)
        if not due:
            return self.held, {}
        plans = [self.published.pop(u) for u in due]
        self.held = plans[-1][0]
        update = next((w for _, w in reversed(plans) if w is not None), None)  # whole weights
        return self.held, {} if update is None else load_verified(parts.rollout, update)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


async def produce(parts: Engines, clock: Clock, channel: Channel, start: int) -> None:
    """The rollout loop. Consumes rollout iterations start, start+1, ... (their prompts and
    seeds); waits at the gate (``Clock.may_start``: the actor's progress, at most
    ``max_staleness`` updates behind this iteration) and on the rollout and scoring; the
    channel is unbounded, the gate is its back-pressure. Unblocked by the actor's
    ``publish`` and by a drop. Runs until cancelled."""
    i = start
    while True:
        async with clock.changed:
            await clock.changed.wait_for(functools.partial(clock.may_start, i))
        if clock.fixed:  # the record carries the sync/* of its own weights
            version, synced = clock.apply_fixed(parts, i)
        else:
            clock.synced.update(clock.apply_pending(parts))  # the latest plan, before this batch
            version, synced = clock.version, {}
        clock.rollout_busy = True
        try:
            scored, metrics = await rollout_and_score(parts, i)
        finally:
            clock.rollout_busy = False
        if clock.midsync:  # updates applied mid-batch: the bound reads the steps' versions
            clock.synced.update(parts.rollout.take_synced())  # type: ignore[attr-defined]
            # the steps carry their weights' versions, which lag the plan's between syncs
            # (NFT's old policy): without a sync mid-batch, the plan's version as in batch mode
            version = max(version, bound_version(scored.traj, parts.algorithm.needs_logprobs))
        metrics = {**metrics, **synced}
        await channel.put(Rollout(i, scored, metrics, version), version)
        clock.produced += 1
        i += 1


async def publish(parts: Engines, clock: Clock, step: int) -> dict[str, float]:
    """After update ``step`` (from 1): carry out the algorithm's weight plan without waiting
    for the rollout. ``old`` refreshes now (actor state); the rollout's weights change now if
    it is between batches (as in sync), else before its next batch. Returns the sync/*
    metrics of the syncs done since the last row."""
    plan = parts.algorithm.weight_plan(step, parts.cfg.algorithm)
    if plan.refresh_old is not None:
        parts.actor.update_old(plan.refresh_old)
    if clock.fixed:  # the rollout iteration that samples with them loads them
        update = parts.actor.export_weights(plan.rollout_adapter) if plan.sync else None
        clock.published[step] = (parts.actor.version, update)
        clock.updates, clock.version = step, parts.actor.version
        await clock.notify()
        return {}
    if plan.sync:
        update = parts.actor.export_weights(plan.rollout_adapter)  # a copy
        if clock.midsync and clock.rollout_busy:  # applied at its next step boundary
            parts.rollout.offer(update)  # type: ignore[attr-defined]
        else:
            clock.pending = update
    metrics, clock.synced = clock.synced, {}
    if not clock.rollout_busy:
        metrics.update(clock.apply_pending(parts))
    clock.updates, clock.version = step, parts.actor.version
    await clock.notify()
    return metrics


@dataclass
class Staleness:
    """The actor side of the bound: admits or drops records, and keeps their statistics."""

    max_staleness: int
    keep: bool  # run.stale=keep: train on a record past the bound (still counted)
    trained: list[int] = field(default_factory=list)  # staleness of each trained record
    dropped: int = 0

    def admit(self, record: Rollout, actor_version: int) -> bool:
        lag = actor_version - record.version
        if lag > self.max_staleness and not self.keep:
            self.dropped += 1
            return False
        self.trained.append(lag)
        return True

    def metrics(self) -> dict[str, float]:
        return {
            "async/staleness": self.trained[-1],  # the batch just trained
            "async/staleness_max": max(self.trained),  # over the batches trained since start
            "async/staleness_mean": sum(self.trained) / len(self.trained),
            "async/dropped": self.dropped,  # records dropped as past the bound, since start
        }

    def work(self, record: Rollout, actor_version: int, produced: int) -> dict[str, float]:
        """The rollout work kept (``controller/midsync.py``): the trained record's per-step lag,
        the records the rollout finished so far and the share of them trained."""
        return {
            "async/step_staleness_mean": step_staleness(record.scored.traj, actor_version),
            "async/produced": produced,
            "async/kept_share": len(self.trained) / max(produced, 1),
        }


async def take(
    channel: Channel, producer: asyncio.Task, parts: Engines, clock: Clock, bound: Staleness
) -> Rollout:
    """The next record within the bound. Consumes records from the channel; waits on the
    rollout loop's puts; unblocked by each put, or by the rollout loop failing (its error is
    raised here). A dropped record frees the gate for one more iteration (``Clock.dropped``)."""
    while True:
        get = asyncio.ensure_future(channel.get())
        await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():  # the rollout loop ended, which it only does by failing
            get.cancel()
            producer.result()
            raise RuntimeError("the rollout loop stopped")
        record = get.result()
        assert record.scored.traj.policy_version <= record.version  # weights never run ahead
        if bound.admit(record, parts.actor.version):
            return record
        clock.dropped = bound.dropped
        await clock.notify()


def fixed_weights(cfg: Config, world: int) -> bool:
    """Whether rollout iteration i samples with exactly update i - max_staleness's weights
    (``run.async_weights``; ``auto``: under torchrun, where every rank must roll out an
    iteration with the same weights and drop the same records, whatever its timing)."""
    if cfg.run.async_weights == "auto":
        return world > 1
    return cfg.run.async_weights == "fixed"


async def train_async(cfg: Config, parts: Engines, begun: RunStart | None = None) -> Path:
    """The actor loop. Consumes one ``Rollout`` per update (``take``); waits on the rollout
    loop's records, the update (in a worker thread, while the rollout runs) and eval; unblocks
    the rollout loop by publishing each update's weight plan. The caller owns ``parts``
    (``controller/loop.py`` builds and closes them) and ``begun`` (the run directory as
    ``run_start.begin_run`` checked it; begun here when not given)."""
    check_midsync(cfg, parts.rollout, fixed_weights(cfg, parts.ranks.world))
    with started(cfg, parts.ranks.primary, begun) as begun:
        if begun.finished:
            return begun.root
        # in-flight rollouts are not saved: they are redone. Refused here, nothing is written
        start, wall0 = resume(parts, begun)
        run = begun.open(parts.ranks.primary)  # rank 0 writes it
        return await _train_async(cfg, parts, run, start, wall0)


async def _train_async(cfg: Config, parts: Engines, run: RunDir, start: int, wall0: float) -> Path:
    ranks = parts.ranks
    first_plan = parts.algorithm.weight_plan(start + 1, cfg.algorithm)
    load_verified(parts.rollout, parts.actor.export_weights(first_plan.rollout_adapter))
    clock = Clock(start, parts.actor.version, cfg.run.max_staleness, cfg.run.steps)
    clock.fixed = fixed_weights(cfg, ranks.world)
    clock.midsync = cfg.run.async_sync == "step"
    clock.held = parts.actor.version
    bound = Staleness(cfg.run.max_staleness, keep=cfg.run.stale in ("keep", "correct"))
    channel = Channel()  # unbounded: the gate bounds how far the rollout runs ahead
    producer = asyncio.create_task(produce(parts, clock, channel, start))
    t0, samples, eval_m = time.time() - wall0, 0, {}
    try:
        if start == 0:  # the rollout of iteration 0 runs meanwhile
            eval_m = await run_eval(parts, run, 0)
            lora = parts.bound.as_metrics() if parts.bound else {}  # what the adapter is on
            run.log(0, {**eval_m, **parts.probe.metrics(), **lora})
        steps = range(start, cfg.run.steps)
        bar = tqdm(
            steps, initial=start, total=cfg.run.steps, desc="diffrl train (async)",
            disable=not ranks.primary,
        )  # fmt: skip
        flops = PipelinePerf(parts)  # perf/tflop/*, perf/pipeline_*
        t_rate = time.time()
        dead = DeadSteps(cfg.run.max_dead_steps)  # updates running that changed nothing
        with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint it, exit 0
            for step in bar:
                record = await take(channel, producer, parts, clock, bound)
                work = bound.work(record, parts.actor.version, clock.produced)
                batch = parts.algorithm.prepare(record.scored, cfg.algorithm)
                if clock.midsync:  # older steps are weighed against the update's start weights
                    batch = replace(batch, prox_version=parts.actor.version)
                # the loop drives the rollout while the update runs in a worker thread
                metrics = await asyncio.to_thread(parts.actor.train_step, batch)
                metrics.update(await publish(parts, clock, step + 1))
                samples += len(record.scored) * ranks.dp_size  # every rank's slice
                done = step + 1
                metrics.update(record.metrics)
                metrics.update(perf_metrics(samples, t_rate, t0))
                metrics.update(flops.step(record.scored, t_rate))
                metrics.update({"async/policy_version": record.version, **bound.metrics()})
                metrics.update(work)
                metrics = ranks.mean(metrics)  # the whole batch's, under torchrun
                last, eval_m = await close_step(
                    parts, run, stop, bar, done, metrics, t0, eval_m,
                    staleness=metrics["async/staleness"],
                )  # fmt: skip
                if last:
                    break
                dead.observe(done, metrics)  # run.max_dead_steps: stop a no-op run
    finally:  # rollouts past the last update are simply not used
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
    run.save_curves()
    run.close()
    return run.root
