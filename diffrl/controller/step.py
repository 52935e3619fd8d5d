"""The parts of a training step both loop modes share (``controller/sync.py``,
``controller/async_.py``): one iteration's rollout streamed into scoring, the held-out eval,
checkpoints and resume, and closing a step (eval when due, the metrics row, a checkpoint).
Neither mode imports the other; ``controller/loop.py`` picks one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable

import torch
import torch.distributed as dist

from diffrl.actor.checkpoint import check_adapters_fit, load_latest, save_checkpoint
from diffrl.algorithms.advantage import tied_fraction
from diffrl.build import Engines
from diffrl.controller.run_dir import RunDir
from diffrl.controller.run_start import RunStart
from diffrl.errors import CheckpointError
from diffrl.hostmem import peak_rss_bytes
from diffrl.reward.edges import run_local
from diffrl.reward.pool import reward_summary
from diffrl.sync.receipt import load_verified
from diffrl.types import ScoredBatch

# receives each scored micro-batch of a step as it is ready (run.stream_train trains it)
OnScored = Callable[[ScoredBatch], Awaitable[None]]


async def rollout_and_score(
    parts: Engines, step: int, on_scored: OnScored | None = None
) -> tuple[ScoredBatch, dict[str, float]]:
    """Consumes the step's prompts; waits on the rollout -> reward -> actor edges
    (``reward/edges.py``: each sample scored once ready, each micro-batch handed once its
    groups are scored); returns (scored, metrics). ``on_scored`` (async) receives each scored
    micro-batch as it is ready, in rollout order. Under Ray with TransferQueue the reward
    engine carries both edges itself (``edges``), past the controller."""
    prompts, seed = parts.prompts.at(step), parts.cfg.run.seed * 1_000_003 + step
    # a data-parallel rank's slice: its samples take the one-process rows' seeds
    kw = {"iteration": step, "first_prompt": parts.prompts.first}
    cap = getattr(getattr(parts.cfg, "reward", None), "max_batch", 0)
    edges = getattr(parts.rewards, "edges", None)
    if edges is not None:
        got = await edges(parts.rollout, prompts, seed, kw, on_scored, cap)
    else:
        stream = lambda ch: parts.rollout.stream(prompts, seed=seed, channel=ch, **kw)  # noqa: E731
        got = await run_local(stream, parts.rewards, on_scored, cap)
    batch = ScoredBatch.concat(got.parts)
    parts.rewards.observe_step(batch)  # a scorer dead for max_dead_steps steps stops the run
    parts.prompts.observe(step, batch.traj.prompts.prompt_ids, batch.rewards, batch.valid)
    metrics = got.metrics()  # scorer-specific metrics: sample-weighted over pool calls
    metrics["reward/tied_groups"] = tied_fraction(batch.rewards, batch.traj.group, batch.valid)
    # what a rollout that is several engines reports of itself (Ray replicas: rollout/replaced)
    metrics.update(getattr(parts.rollout, "step_metrics", dict)())
    return batch, {**metrics, **reward_summary(batch)}  # reward means over all valid samples


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
    load_verified(parts.evaluator, parts.actor.export_weights(adapter), "evaluator")
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


def checkpoint(parts: Engines, run: RunDir, step: int, wall: float) -> None:
    """Rank 0 writes it. Every rank holds the same adapters and optimizer state, whole or (under
    tp) as shards that every rank gathers together (a collective), so all of them take it."""
    adapters, state = parts.actor.adapter_tensors(), parts.actor.state_dict()
    if not parts.ranks.primary:
        return
    save_checkpoint(
        run.root / "checkpoints",
        step,
        adapters,
        state,
        {"step": step, "wall_s": wall, "prompts": parts.prompts.state_dict(step)},
    )


def resume(parts: Engines, begun: RunStart) -> tuple[int, float]:
    """Load the checkpoint ``run_start.begin_run`` found (``begun.ckpt``) into the engines:
    (its step, its wall seconds), (0, 0.0) without one. Its adapters must be this model's
    (names, shapes, dtypes): a newest one that does not fit falls back to the older one that
    does, as a torn file does (``begun.ckpt`` becomes that one). Writes nothing: a checkpoint
    that cannot be loaded is refused before the run directory is touched."""
    if begun.ckpt is None:
        return 0, 0.0
    expect = parts.actor.adapter_tensors()  # every rank: a collective under tp
    try:
        check_adapters_fit(begun.ckpt.path.name, begun.ckpt.adapters, expect)
    except CheckpointError:  # load_latest warns as it skips it
        begun.ckpt = load_latest(begun.root / "checkpoints", expect)
    ckpt = begun.ckpt
    assert ckpt is not None, "load_latest found the checkpoint begin_run found"
    # the non-finite counter counts consecutive bad updates under the config that made them: a
    # diverged run resumed from its last good checkpoint (say with a lower actor.lr) starts afresh
    try:
        parts.actor.load_state(ckpt.adapters, {**ckpt.actor_state, "nonfinite": 0})
        parts.prompts.load_state_dict(ckpt.controller_state.get("prompts") or {}, ckpt.step)
    except torch.OutOfMemoryError:  # the machine's fault, not the checkpoint's
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # e.g. another optimizer's
        raise CheckpointError(f"{ckpt.path} does not fit this run: {e}") from e
    return ckpt.step, ckpt.wall_s


def tensor_memory(parts: Engines) -> dict[str, float]:
    """The bytes of live tensors on the run's device (``plan.held_tensors``), read once, after
    the first update a process takes (what ``diffrl plan``'s resident rows describe: weights,
    adapters, optimizer state, the copies, the encoders). Rank 0 prints every rank's; the
    metrics are the largest and the smallest rank's, in GiB (the same on every rank, so the
    ranks' mean keeps them). Collective under torchrun. Nothing on the Ray backend, whose
    engines hold their tensors in other processes."""
    from diffrl.parallel.plan import held_tensors

    if parts.cfg.run.backend != "local":
        return {}
    held = held_tensors(parts.device.type)
    every: list = [sum(held.values())]
    if parts.ranks.world > 1:
        every = [None] * parts.ranks.world
        dist.all_gather_object(every, sum(held.values()))
    if parts.ranks.primary:
        mib = ", ".join(f"{b / 2**20:.2f}" for b in every)
        split = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in held.items())
        print(f"diffrl: tensors held after the first update, MiB per rank: {mib} "
              f"(rank 0: {split})", file=sys.stderr)  # fmt: skip
    return {"perf/tensor_gib_max": max(every) / 2**30, "perf/tensor_gib_min": min(every) / 2**30}


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
    # eval/overall is an accuracy on the verifier tasks and a reward mean on a prompts dataset:
    # the task names it (a task of the user's own without the attribute reads as an accuracy)
    headline = getattr(parts.task, "headline", "eval_acc")
    bar.set_postfix(
        {
            "reward": f"{metrics.get('reward/mean', float('nan')):.3f}",
            headline: f"{eval_m.get('eval/overall', float('nan')):.3f}",
            **postfix,
        }
    )
    if done % cfg.run.save_every == 0 or done == cfg.run.steps or out_of_time:
        checkpoint(parts, run, done, time.time() - t0)
        run.save_curves()
    if out_of_time and done < cfg.run.steps and parts.ranks.primary:
        stopped_early(bar, done, cfg.run.steps, cfg.run.max_minutes)
    return bool(out_of_time), eval_m


def stopped_early(bar, done: int, steps: int, max_minutes: float) -> None:
    """The wall budget ended the run before its last step: the bar shows where it stopped
    without an ETA for steps that will not run, and a line says why and how to go on."""
    bar.bar_format = "{desc}: {n_fmt}/{total_fmt} [{elapsed}, stopped early{postfix}]"
    bar.n = done  # the loop's iterator counts a step only when the next one is drawn
    bar.refresh()
    bar.close()
    print(
        f"diffrl: stopped after step {done} of {steps}: run.max_minutes={max_minutes:g} is "
        "spent (checkpointed); to take the remaining steps, run the same command with a "
        "larger run.max_minutes (0 = no limit)",
        file=sys.stderr,
    )
