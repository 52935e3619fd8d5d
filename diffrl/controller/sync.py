"""The synchronous (on-policy) controller: generate -> score -> advantage -> update -> sync.

Each step streams the rollout's micro-batches through a channel into the reward pool, so
scoring of micro-batch i overlaps generation of micro-batch i+1; the update waits for the
whole step's scores. Weights move to the rollout only through versioned, verified syncs.

When the algorithm says update k cannot change the rollout's weights (DiffusionNFT between
old-policy refreshes), step k+1's rollout and scoring start while update k runs: the samples
are exactly those a strictly sequential loop would produce (same weights, same seeds).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tqdm import tqdm

from diffrl.actor.checkpoint import load_latest, save_checkpoint
from diffrl.channel import Channel
from diffrl.config import Config, to_yaml
from diffrl.controller.build import Parts, build
from diffrl.controller.evaluate import evaluate, grid_pick
from diffrl.controller.run_dir import RunDir
from diffrl.errors import ContractError
from diffrl.reward.pool import close_pool, reward_summary
from diffrl.types import ScoredBatch


async def rollout_and_score(parts: Parts, step: int):
    """Consumes the step's prompts; waits on the rollout stream; returns (scored, metrics)."""
    channel = Channel(capacity=2)
    producer = asyncio.create_task(
        parts.rollout.stream(
            parts.prompts.at(step),
            seed=parts.cfg.run.seed * 1_000_003 + step,
            channel=channel,
            iteration=step,
        )
    )
    scored, extra = [], {}
    async for traj in channel:  # unblocked by each finished micro-batch, ends on close
        s, m = await parts.rewards.score(traj)
        scored.append(s)
        for k, v in m.items():  # scorer-specific metrics: sample-weighted over micro-batches
            extra.setdefault(k, []).append((v, len(s)))
    await producer
    batch = ScoredBatch.concat(scored)
    metrics = {
        k: sum(v * n for v, n in vals) / sum(n for _, n in vals) for k, vals in extra.items()
    }
    return batch, {**metrics, **reward_summary(batch)}  # reward means over all valid samples


async def run_eval(parts: Parts, run: RunDir, step: int) -> dict[str, float]:
    """Held-out eval of the policy the run ships (the EMA one with ``actor.ema_decay``) as
    ``eval/*``; with ``run.eval_live`` and an EMA, also the live weights as ``eval_live/*``."""
    cfg, adapter = parts.cfg, parts.actor.eval_adapter
    metrics, images, texts, ok = await _evaluate_adapter(parts, adapter)
    idx = grid_pick(texts, cfg.data.eval_samples_per_prompt)
    run.save_grid(step, images[idx], [texts[i] for i in idx], [ok[i] for i in idx])
    if cfg.run.eval_live and adapter != "default":
        live = (await _evaluate_adapter(parts, "default"))[0]
        metrics.update({k.replace("eval/", "eval_live/", 1): v for k, v in live.items()})
    return metrics


async def _evaluate_adapter(parts: Parts, adapter: str):
    parts.evaluator.load_weights(parts.actor.export_weights(adapter))
    cfg = parts.cfg
    return await evaluate(
        parts.evaluator,
        parts.eval_set,
        cfg.data.eval_samples_per_prompt,
        cfg.data.eval_seed,
        cfg.rollout.eval_num_steps,
    )


def can_prefetch(parts: Parts, step: int) -> bool:
    cfg = parts.cfg
    return (
        cfg.run.prefetch
        and step + 1 < cfg.run.steps
        and not parts.algorithm.changes_rollout(step + 1, cfg.algorithm)
    )


def sync_rollout(parts: Parts):
    adapter = parts.algorithm.rollout_adapter(parts.cfg.algorithm)
    return parts.rollout.load_weights(parts.actor.export_weights(adapter))


def checkpoint(parts: Parts, run: RunDir, step: int, wall: float) -> None:
    save_checkpoint(
        run.root / "checkpoints",
        step,
        parts.actor.adapter_tensors(),
        parts.actor.state_dict(),
        {"step": step, "wall_s": wall},
    )


def resume(parts: Parts, run: RunDir) -> tuple[int, float]:
    """The newest checkpoint that verifies (CheckpointError if there are some but none does)."""
    ckpt = load_latest(run.root / "checkpoints") if parts.cfg.run.resume else None
    if ckpt is None:
        run.truncate_after(-1)  # a fresh run starts a fresh metrics file
        return 0, 0.0
    # the non-finite counter counts consecutive bad updates under the config that made them: a
    # diverged run resumed from its last good checkpoint (say with a lower actor.lr) starts afresh
    parts.actor.load_state(ckpt.adapters, {**ckpt.actor_state, "nonfinite": 0})
    run.truncate_after(ckpt.step)
    return ckpt.step, ckpt.wall_s


async def train(cfg: Config) -> Path:
    parts = build(cfg)
    run = RunDir(Path(cfg.run.out_dir) / cfg.run.name, tensorboard=cfg.run.tensorboard)
    run.write_config(to_yaml(cfg))
    start, wall0 = resume(parts, run)
    sync_rollout(parts)
    t0, samples, eval_m = time.time() - wall0, 0, {}
    if start == 0:
        eval_m = await run_eval(parts, run, 0)
        run.log(0, {**eval_m, "probe/cosine": parts.probe.cosine if parts.probe else float("nan")})
    bar = tqdm(range(start, cfg.run.steps), initial=start, total=cfg.run.steps, desc="diffrl train")
    t_rate = time.time()
    prefetch = None  # step k+1's rollout, started early when update k cannot change its weights
    for step in bar:
        scored, r_metrics = await (prefetch or rollout_and_score(parts, step))
        batch = parts.algorithm.prepare(scored, cfg.algorithm)
        prefetch = None
        if can_prefetch(parts, step):
            prefetch = asyncio.create_task(rollout_and_score(parts, step + 1))
        metrics = await asyncio.to_thread(parts.actor.train_step, batch)  # the loop drives the
        if parts.algorithm.after_step(parts.actor, step + 1, cfg.algorithm):  # prefetch meanwhile
            if prefetch is not None:
                raise ContractError(
                    f"{cfg.algorithm.name}: changes_rollout({step + 1}) said the "
                    "rollout weights stay, but after_step changed them"
                )
            metrics.update(sync_rollout(parts).as_metrics())
        samples += len(scored)
        done = step + 1
        metrics.update(r_metrics)
        metrics.update(
            {
                "perf/samples_per_s": samples / (time.time() - t_rate),
                "perf/wall_s": time.time() - t0,
            }
        )
        out_of_time = cfg.run.max_minutes and time.time() - t0 > 60 * cfg.run.max_minutes
        if done % cfg.run.eval_every == 0 or done == cfg.run.steps or out_of_time:
            eval_m = await run_eval(parts, run, done)
            metrics.update(eval_m)
        run.log(done, metrics)
        bar.set_postfix(
            reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
            eval_acc=f"{eval_m.get('eval/overall', float('nan')):.3f}",
            samples_s=f"{metrics['perf/samples_per_s']:.1f}",
        )
        if done % cfg.run.save_every == 0 or done == cfg.run.steps or out_of_time:
            checkpoint(parts, run, done, time.time() - t0)
            run.save_curves()
        if out_of_time:
            break
    if prefetch is not None:  # stopped early: the prefetched step is simply not used
        prefetch.cancel()
    run.save_curves()
    run.close()
    await close_pool(parts.rewards)
    return run.root
