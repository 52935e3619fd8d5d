"""Probe a trained run's policy (CPU, the run's latest checkpoint; eval noise as in training):

- ``gap``: ODE accuracy on the train prompts against the held-out ones, base and trained, per
  category (is the plateau over-fitting?).
- ``branch``: groups of 8 train-prompt samples sharing their initial noise, one SDE step at step
  k, ODE elsewhere: mean accuracy, pass@8, and the share of groups whose verdicts differ (the
  groups that give GRPO a signal), for the base and the trained policy.
- ``where``: held-out ODE accuracy with the trained weights only at the steps whose sigma lies in
  a range and the base weights elsewhere (at which steps does the trained LoRA help?).

Usage: python benchmarks/policy_probe.py {gap,branch,where} RUN_DIR [--steps 0,1,2,3,5]
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np

from diffrl.actor.checkpoint import latest_checkpoint, load_checkpoint
from diffrl.build import build
from diffrl.config import load_config
from diffrl.models.registry import load_model
from diffrl.rollout.samplers import guided_velocity
from diffrl.tasks import PromptSet
from diffrl.tasks.shapes.prompts import parse_prompt
from diffrl.tasks.shapes.verify import score_batch

SIGMA_RANGES = ((0, 2), (0.75, 2), (0.65, 2), (0.45, 2), (0, 0.75), (-1, -1))


def load_trained(parts, run_dir: Path) -> int:
    adapters, state, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    parts.actor.load_state(adapters, state)
    return meta["step"]


async def accuracy(parts, engine, prompts, per: int | None) -> dict[str, float]:
    """ODE accuracy per category with the run's own eval noise and step count."""
    data = parts.cfg.data
    per = per or data.eval_samples_per_prompt
    steps = parts.cfg.rollout.eval_num_steps
    traj = await engine.generate(
        prompts.all(), data.eval_seed, group_size=per, sampler="ode", num_steps=steps
    )
    return (await parts.task.evaluate(traj, parts.rewards)).metrics


def fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in metrics.items())


async def gap(parts, run_dir: Path, args) -> None:
    train = PromptSet(parts.task.prompts("train"), parts.rollout.family.tokenize)
    for tag in ("base", "trained"):
        if tag == "trained":
            print("checkpoint step", load_trained(parts, run_dir))
        parts.evaluator.load_weights(parts.actor.export_weights(parts.actor.eval_adapter))
        for name, prompts in (("held-out", parts.eval_set), ("train", train)):
            m = await accuracy(parts, parts.evaluator, prompts, args.per)
            print(f"{tag} {name}: {fmt(m)}", flush=True)


async def branch(parts, run_dir: Path, args) -> None:
    train = PromptSet(parts.task.prompts("train"), parts.rollout.family.tokenize)
    for tag in ("base", "trained"):
        if tag == "trained":
            load_trained(parts, run_dir)
        weights = parts.actor.export_weights(parts.actor.eval_adapter)
        for k in args.steps:
            # the run's own rollout engine, built with a one-step window at step k
            overrides = [
                "rollout.sampler=sde", "rollout.shared_init_noise=true", "rollout.sde_window=1",
                "rollout.sde_window_mode=fixed", f"rollout.sde_window_start={k}",
                "rollout.tree_noise=false",
                "rollout.antithetic_noise=false", "rollout.ode_tail_steps=0",
            ]  # fmt: skip
            engine = build(load_config(args.run_dir / "config.yaml", args.base + overrides)).rollout
            engine.load_weights(weights)
            traj = await engine.generate(train.all(), 7, group_size=8)
            prompts = [parse_prompt(t) for t in traj.prompts.texts]
            verdicts = score_batch(traj.extra_fields["image"].numpy(), prompts)
            ok = np.array([v.overall for v in verdicts]).reshape(-1, 8)
            mixed = (ok.any(1) & ~ok.all(1)).mean()
            print(
                f"{tag}, branch at step {k}: accuracy {ok.mean():.3f} pass@8 {ok.any(1).mean():.3f}"
                f" mixed groups {mixed:.3f} all wrong {(~ok.any(1)).mean():.3f}",
                flush=True,
            )


async def where(parts, run_dir: Path, args) -> None:
    load_trained(parts, run_dir)
    trained = parts.evaluator
    trained.load_weights(parts.actor.export_weights(parts.actor.eval_adapter))
    base = load_model(parts.cfg.model, parts.device).eval().requires_grad_(False)
    for lo, hi in SIGMA_RANGES:

        def velocity(x, sigma, ids, lo=lo, hi=hi):
            model = trained.model if lo <= float(sigma[0]) < hi else base
            return guided_velocity(model, x, sigma, ids, 1.0, trained.null_ids)

        trained.velocity = velocity  # this probe's engine only
        m = await accuracy(parts, trained, parts.eval_set, args.per)
        print(f"trained weights at sigma in [{lo}, {hi}): {fmt(m)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=("gap", "branch", "where"))
    p.add_argument("run_dir", type=Path)
    p.add_argument("--steps", default="0,1,2,3,5", help="branch: the SDE steps to try")
    p.add_argument("--per", type=int, help="samples per prompt (gap, where; default: the run's)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    args.base = [f"run.threads={args.threads}"]
    parts = build(load_config(args.run_dir / "config.yaml", args.base))
    probe = {"gap": gap, "branch": branch, "where": where}[args.probe]
    asyncio.run(probe(parts, args.run_dir, args))


if __name__ == "__main__":
    main()
