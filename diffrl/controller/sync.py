"""The synchronous (on-policy) controller: generate -> score -> advantage -> update -> sync.

Each step streams the rollout's micro-batches through a channel into the reward pool, so
scoring of micro-batch i overlaps generation of micro-batch i+1; the update waits for the
whole step's scores. Weights move to the rollout only through versioned, verified syncs.

What happens to the weights after each update is the algorithm's weight plan, carried out
here: refresh ``old``, then sync the adapter the rollout samples with. When the plan says
update k cannot change the rollout's weights (DiffusionNFT between refreshes of ``old``), step
k+1's rollout and scoring start while update k runs: the samples are exactly those a strictly
sequential loop would produce (same weights, same seeds).

The engines come from the factory (``build.py``); nothing here knows a task or a
model family by name.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from tqdm import tqdm

from diffrl.actor.checkpoint import load_latest, save_checkpoint
from diffrl.algorithms.advantage import tied_fraction
from diffrl.algorithms.registry import WeightPlan
from diffrl.backends import build_engines
from diffrl.build import Engines
from diffrl.channel import Channel
from diffrl.config import Config, to_yaml
from diffrl.controller.run_dir import RunDir, open_run_dir
from diffrl.controller.signals import StopSignals
from diffrl.hostmem import peak_rss_bytes
from diffrl.reward.pool import reward_summary
from diffrl.types import ScoredBatch


async def rollout_and_score(parts: Engines, step: int, on_scored=None):
    """Consumes the step's prompts; waits on the rollout stream; returns (scored, metrics).
    ``on_scored`` (async) receives each scored micro-batch as it is ready."""
    channel = Channel(capacity=2)
    producer = asyncio.create_task(
        parts.rollout.stream(
            parts.prompts.at(step),
            seed=parts.cfg.run.seed * 1_000_003 + step,
            channel=channel,
            iteration=step,
            # a data-parallel rank's slice: its samples take the one-process rows' seeds
            first_prompt=parts.prompts.first,
        )
    )
    scored, extra = [], {}
    async for traj in channel:  # unblocked by each finished micro-batch, ends on close
        s, m = await parts.rewards.score(traj)
        scored.append(s)
        if on_scored is not None:
            await on_scored(s)
        for k, v in m.items():  # scorer-specific metrics: sample-weighted over micro-batches
            extra.setdefault(k, []).append((v, len(s)))
    await producer
    batch = ScoredBatch.concat(scored)
    parts.rewards.observe_step(batch)  # a scorer dead for max_dead_steps steps stops the run
    parts.prompts.observe(step, batch.traj.prompts.prompt_ids, batch.rewards, batch.valid)
    metrics = {
        k: sum(v * n for v, n in vals) / sum(n for _, n in vals) for k, vals in extra.items()
    }
    metrics["reward/tied_groups"] = tied_fraction(batch.rewards, batch.traj.group, batch.valid)
    return batch, {**metrics, **reward_summary(batch)}  # reward means over all valid samples


async def stream_step(parts: Engines, step: int):
    """``run.stream_train``: one step whose update trains each scored micro-batch while the
    next one rolls out, then takes one optimizer step; the rollout's weights never change
    within the step. Consumes the step's prompts; waits on the rollout, the scorer and the
    previous part's training (one part trains at a time, in a worker thread). Returns
    (scored, reward metrics, update metrics)."""
    cfg = parts.cfg
    parts.actor.begin_stream(len(parts.prompts.at(step)) * cfg.rollout.group_size)
    training: list[asyncio.Future] = []

    async def train_part(scored: ScoredBatch) -> None:
        part = parts.algorithm.prepare(scored, cfg.algorithm)
        if training:
            await training[-1]
        training.append(asyncio.ensure_future(asyncio.to_thread(parts.actor.train_part, part)))

    try:
        scored, r_metrics = await rollout_and_score(parts, step, on_scored=train_part)
    finally:  # a part still training finishes (or fails) before the step ends either way
        await asyncio.gather(*training, return_exceptions=True)
    for t in training:
        t.result()  # a part's error
    return scored, r_metrics, await asyncio.to_thread(parts.actor.end_stream)


async def run_eval(parts: Engines, run: RunDir, step: int) -> dict[str, float]:
    """Held-out eval of the policy the run ships (the EMA one with ``actor.ema_decay``) as
    ``eval/*``, its sample grid and, for video+audio tasks, its sample clips; with
    ``run.eval_live`` and an EMA, also the live weights as ``eval_live/*``."""
    adapter = parts.actor.eval_adapter
    result = await evaluate_adapter(parts, adapter)
    run.save_grid(step, result.images, result.captions, result.ok)
    if result.clips is not None:
        c = result.clips
        try:  # sample clips are for people to look at: a bad one must not stop training
            clips = c["video"], c["audio"], c["fps"], c["sample_rate"]
            run.save_clips(step, *clips, result.captions, result.ok)
        except (OSError, ValueError) as e:
            print(f"diffrl: step {step}: sample clips not written: {e}", file=sys.stderr)
    metrics = dict(result.metrics)
    if parts.cfg.run.eval_live and adapter != "default":
        live = (await evaluate_adapter(parts, "default")).metrics
        metrics.update({k.replace("eval/", "eval_live/", 1): v for k, v in live.items()})
    return metrics


async def evaluate_adapter(parts: Engines, adapter: str):
    """The task's held-out evaluation of one adapter: fixed prompts and noise, ODE sampling."""
    cfg = parts.cfg
    parts.evaluator.load_weights(parts.actor.export_weights(adapter))
    prompts = parts.eval_set.all()
    first, mine = parts.ranks.share(len(prompts))  # under torchrun, this rank's prompts
    traj = None
    if len(mine):
        traj = await parts.evaluator.generate(
            prompts.select(mine),
            cfg.data.eval_seed,
            group_size=cfg.data.eval_samples_per_prompt,
            sampler="ode",
            num_steps=cfg.rollout.eval_num_steps,
            first_prompt=first,
        )
    traj = parts.ranks.join(traj, parts.device)  # every rank's share, as one trajectory
    return await parts.task.evaluate(traj, parts.rewards)


def apply_plan(parts: Engines, plan: WeightPlan) -> dict[str, float]:
    """Carry out the algorithm's weight plan after an update: refresh ``old``, then sync."""
    if plan.refresh_old is not None:
        parts.actor.update_old(plan.refresh_old)
    if not plan.sync:
        return {}
    return parts.rollout.load_weights(parts.actor.export_weights(plan.rollout_adapter)).as_metrics()


def checkpoint(parts: Engines, run: RunDir, step: int, wall: float) -> None:
    """Rank 0 writes it (every rank holds the same adapters and optimizer state)."""
    if not parts.ranks.primary:
        return
    save_checkpoint(
        run.root / "checkpoints",
        step,
        parts.actor.adapter_tensors(),
        parts.actor.state_dict(),
        {"step": step, "wall_s": wall, "prompts": parts.prompts.state_dict(step)},
    )


def resume(parts: Engines, run: RunDir) -> tuple[int, float]:
    """The newest checkpoint that verifies (CheckpointError if there are some but none does)."""
    ckpt = load_latest(run.root / "checkpoints") if parts.cfg.run.resume else None
    if ckpt is None:
        run.truncate_after(-1)  # a fresh run starts a fresh metrics file
        return 0, 0.0
    # the non-finite counter counts consecutive bad updates under the config that made them: a
    # diverged run resumed from its last good checkpoint (say with a lower actor.lr) starts afresh
    parts.actor.load_state(ckpt.adapters, {**ckpt.actor_state, "nonfinite": 0})
    parts.prompts.load_state_dict(ckpt.controller_state.get("prompts") or {}, ckpt.step)
    run.truncate_after(ckpt.step)
    return ckpt.step, ckpt.wall_s


def perf_metrics(samples: int, t_rate: float, t0: float) -> dict[str, float]:
    return {
        "perf/samples_per_s": samples / (time.time() - t_rate),
        "perf/wall_s": time.time() - t0,
        "perf/host_peak_gb": peak_rss_bytes() / 1e9,
    }


async def close_step(
    parts: Engines,
    run: RunDir,
    stop,
    bar,
    done: int,
    metrics: dict,
    t0: float,
    eval_m: dict,
    **postfix,
) -> tuple[bool, dict]:
    """After update ``done`` (both loops): held-out eval when due, the metrics row, the progress
    bar, a checkpoint when due or when stopping. Returns (the loop stops here, the latest eval
    metrics)."""  # fmt: skip
    cfg = parts.cfg
    # every rank of a torchrun launch takes the same decisions (a clock or a signal may differ)
    out_of_time = parts.ranks.any(
        bool(cfg.run.max_minutes) and time.time() - t0 > 60 * cfg.run.max_minutes
    )
    if done % cfg.run.eval_every == 0 or done == cfg.run.steps or out_of_time:
        eval_m = await run_eval(parts, run, done)
        metrics.update(eval_m)
    run.log(done, metrics)
    if parts.ranks.any(stop.requested):
        checkpoint(parts, run, done, time.time() - t0)
        return True, eval_m
    bar.set_postfix(
        reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
        eval_acc=f"{eval_m.get('eval/overall', float('nan')):.3f}",
        **postfix,
    )
    if done % cfg.run.save_every == 0 or done == cfg.run.steps or out_of_time:
        checkpoint(parts, run, done, time.time() - t0)
        run.save_curves()
    return bool(out_of_time), eval_m


async def train(cfg: Config) -> Path:
    if cfg.run.mode == "async":  # imported here: the async loop reuses this module's parts
        from diffrl.controller.async_ import train_async

        return await train_async(cfg)
    parts = build_engines(cfg)
    try:
        return await train_sync(cfg, parts)
    finally:  # scorer clients, remote engines: released however the run ends
        await parts.aclose()


async def train_sync(cfg: Config, parts: Engines) -> Path:
    root = Path(cfg.run.out_dir) / cfg.run.name
    run = open_run_dir(root, cfg.run.tensorboard, parts.ranks.primary)
    run.write_config(to_yaml(cfg))
    start, wall0 = resume(parts, run)
    plan_of = lambda k: parts.algorithm.weight_plan(k, cfg.algorithm)  # noqa: E731
    parts.rollout.load_weights(parts.actor.export_weights(plan_of(start + 1).rollout_adapter))
    t0, samples, eval_m = time.time() - wall0, 0, {}
    if start == 0:
        eval_m = await run_eval(parts, run, 0)
        run.log(0, {**eval_m, "probe/cosine": parts.probe.cosine if parts.probe else float("nan")})
    bar = tqdm(
        range(start, cfg.run.steps), initial=start, total=cfg.run.steps, desc="diffrl train",
        disable=not parts.ranks.primary,
    )  # fmt: skip
    t_rate = time.time()
    prefetch = None  # step k+1's rollout, started early when update k cannot change its weights
    with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint it, exit 0
        for step in bar:
            plan = plan_of(step + 1)  # what update step+1 does to the weights, as data
            if cfg.run.stream_train:  # the update trains while the rollout samples
                scored, r_metrics, metrics = await stream_step(parts, step)
            else:
                scored, r_metrics = await (prefetch or rollout_and_score(parts, step))
                batch = parts.algorithm.prepare(scored, cfg.algorithm)
                prefetch = None
                if cfg.run.prefetch and not plan.sync and step + 1 < cfg.run.steps:
                    prefetch = asyncio.create_task(rollout_and_score(parts, step + 1))
                # the loop drives the prefetch while the update runs in a worker thread
                metrics = await asyncio.to_thread(parts.actor.train_step, batch)
            metrics.update(apply_plan(parts, plan))
            samples += len(scored) * parts.ranks.dp_size  # every rank's slice
            done = step + 1
            metrics.update(r_metrics)
            metrics.update(perf_metrics(samples, t_rate, t0))
            metrics = parts.ranks.mean(metrics)  # the whole batch's, under torchrun
            last, eval_m = await close_step(
                parts, run, stop, bar, done, metrics, t0, eval_m,
                samples_s=f"{metrics['perf/samples_per_s']:.1f}",
            )  # fmt: skip
            if last:
                break
    if prefetch is not None:  # stopped early: the prefetched step is simply not used
        prefetch.cancel()
    run.save_curves()
    run.close()
    return run.root
