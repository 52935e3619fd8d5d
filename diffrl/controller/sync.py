"""The synchronous (on-policy) controller: generate -> score -> advantage -> update -> sync.

Each step streams the rollout's samples into the reward pool and the scored micro-batches
back (``reward/edges.py``), so scoring of micro-batch i overlaps generation of micro-batch
i+1. The update is one path, fed in one of two ways (``StepUpdate``): after the whole step is
scored (the actor's ``train_step``), or, with ``run.stream_train``, each scored micro-batch as
it comes while the next one rolls out, then one optimizer step. Weights move to the rollout
only through versioned, verified syncs.

What happens to the weights after each update is the algorithm's weight plan, carried out
here: refresh ``old``, then sync the adapter the rollout samples with. When the plan says
update k cannot change the rollout's weights (DiffusionNFT between refreshes of ``old``), step
k+1's rollout and scoring start while update k runs: the samples are exactly those a strictly
sequential loop would produce (same weights, same seeds).

The engines come from the factory (``build.py``) through ``controller/loop.py``;
nothing here knows a task, a model family or an algorithm by name.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tqdm import tqdm

from diffrl.algorithms.registry import WeightPlan
from diffrl.build import Engines
from diffrl.config import Config
from diffrl.controller.dead_steps import DeadSteps
from diffrl.controller.flops import PipelinePerf
from diffrl.controller.run_dir import RunDir
from diffrl.controller.run_start import RunStart, started
from diffrl.controller.signals import StopSignals
from diffrl.controller.step import (
    OnScored,
    close_step,
    perf_metrics,
    resume,
    rollout_and_score,
    run_eval,
    tensor_memory,
)
from diffrl.sync.receipt import load_verified
from diffrl.types import ScoredBatch


class StepUpdate:
    """One step's update, trained after the whole step is scored: the prepared batch goes to
    the actor's ``train_step`` (in a worker thread, so the event loop drives a prefetched
    rollout meanwhile)."""

    on_scored: OnScored | None = None  # the step's scored micro-batches are not fed one by one

    def __init__(self, parts: Engines, step: int) -> None:
        self.parts = parts

    async def __aenter__(self) -> StepUpdate:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def finish(self, scored: ScoredBatch) -> dict[str, float]:
        batch = self.parts.algorithm.prepare(scored, self.parts.cfg.algorithm)
        return await asyncio.to_thread(self.parts.actor.train_step, batch)


class StreamedUpdate(StepUpdate):
    """``run.stream_train``: each scored micro-batch is prepared and trained (one part at a
    time, in a worker thread) while the next one rolls out; ``finish`` takes the step's one
    optimizer step. The rollout's weights never change within the step. Waits on the previous
    part's training before starting the next; leaving the ``async with`` waits for the part
    still training, however the rollout ended."""

    def __init__(self, parts: Engines, step: int) -> None:
        super().__init__(parts, step)
        self.training: list[asyncio.Future] = []
        parts.actor.begin_stream(len(parts.prompts.at(step)) * parts.cfg.rollout.group_size)
        self.on_scored = self.train_part

    async def train_part(self, scored: ScoredBatch) -> None:
        part = self.parts.algorithm.prepare(scored, self.parts.cfg.algorithm)
        if self.training:
            await self.training[-1]
        job = asyncio.to_thread(self.parts.actor.train_part, part)
        self.training.append(asyncio.ensure_future(job))

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*self.training, return_exceptions=True)

    async def finish(self, scored: ScoredBatch) -> dict[str, float]:
        for t in self.training:
            t.result()  # a part's error
        return await asyncio.to_thread(self.parts.actor.end_stream)


def apply_plan(parts: Engines, plan: WeightPlan) -> dict[str, float]:
    """Carry out the algorithm's weight plan after an update: refresh ``old``, then sync."""
    if plan.refresh_old is not None:
        parts.actor.update_old(plan.refresh_old)
    if not plan.sync:
        return {}
    return load_verified(parts.rollout, parts.actor.export_weights(plan.rollout_adapter))


def prefetch_next(parts: Engines, step: int, plan: WeightPlan) -> asyncio.Task | None:
    """Step+1's rollout and scoring, started now when this step's update cannot change the
    weights it samples with (``plan`` syncs nothing) and waits for the whole step (not
    streamed): the same samples, earlier. Not with a TP-sharded rollout, whose sampling is a
    collective over the tp group: run beside the actor's own collectives (another thread),
    the ranks could meet them in different orders."""
    run = parts.cfg.run
    if getattr(parts.rollout, "collective", False):
        return None
    if run.prefetch and not run.stream_train and not plan.sync and step + 1 < run.steps:
        return asyncio.create_task(rollout_and_score(parts, step + 1))
    return None


async def train_sync(cfg: Config, parts: Engines, begun: RunStart | None = None) -> Path:
    """``begun``: the run's directory as ``run_start.begin_run`` checked it (begun here when
    not given)."""
    with started(cfg, parts.ranks.primary, begun) as begun:
        if begun.finished:
            return begun.root
        start, wall0 = resume(parts, begun)  # refused here, nothing has been written
        return await _train_sync(cfg, parts, begun.open(parts.ranks.primary), start, wall0)


async def _train_sync(cfg: Config, parts: Engines, run: RunDir, start: int, wall0: float) -> Path:
    plan_of = lambda k: parts.algorithm.weight_plan(k, cfg.algorithm)  # noqa: E731
    load_verified(parts.rollout, parts.actor.export_weights(plan_of(start + 1).rollout_adapter))
    t0, samples, eval_m = time.time() - wall0, 0, {}
    if start == 0:
        eval_m = await run_eval(parts, run, 0)
        lora = parts.bound.as_metrics() if parts.bound else {}  # what the adapter is on
        run.log(0, {**eval_m, **parts.probe.metrics(), **lora})
    bar = tqdm(
        range(start, cfg.run.steps), initial=start, total=cfg.run.steps, desc="diffrl train",
        disable=not parts.ranks.primary,
    )  # fmt: skip
    new_update = StreamedUpdate if cfg.run.stream_train else StepUpdate
    flops = PipelinePerf(parts)  # perf/tflop/*, perf/pipeline_*
    t_rate = time.time()
    prefetch = None  # step k+1's rollout, started early when update k cannot change its weights
    dead = DeadSteps(cfg.run.max_dead_steps)  # updates running that changed nothing
    with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint it, exit 0
        for step in bar:
            plan = plan_of(step + 1)  # what update step+1 does to the weights, as data
            async with new_update(parts, step) as update:  # fed as scored, or after
                scored, r_metrics = await (
                    prefetch or rollout_and_score(parts, step, update.on_scored)
                )
            prefetch = prefetch_next(parts, step, plan)  # runs while the update trains
            metrics = await update.finish(scored)
            metrics.update(apply_plan(parts, plan))
            if step == start:  # what the run holds between steps, against diffrl plan
                metrics.update(tensor_memory(parts))
            samples += len(scored) * parts.ranks.dp_size  # every rank's slice
            done = step + 1
            metrics.update(r_metrics)
            metrics.update(perf_metrics(samples, t_rate, t0))
            metrics.update(flops.step(scored, t_rate))
            metrics = parts.ranks.mean(metrics)  # the whole batch's, under torchrun
            last, eval_m = await close_step(
                parts, run, stop, bar, done, metrics, t0, eval_m,
                samples_s=f"{metrics['perf/samples_per_s']:.1f}",
            )  # fmt: skip
            if last:
                break
            dead.observe(done, metrics)  # run.max_dead_steps: stop a no-op run
    if prefetch is not None:  # stopped early: the prefetched step is simply not used
        prefetch.cancel()
    run.save_curves()
    run.close()
    return run.root
