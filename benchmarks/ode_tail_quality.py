"""How far a coarse ODE tail (``rollout.ode_tail_steps``) or bfloat16 ODE steps
(``rollout.ode_dtype``) move the samples the reward sees.

Samples the held-out ShapesBench prompts with the base model along the full Euler grid and
along grids whose steps after an SDE window were re-gridded by ``coarse_tail`` (the window's
own step taken as an Euler step here, so the two paths share the same start and prefix), and
prints the verifier's accuracy, the fraction of verdicts unchanged, and the mean squared
difference of the final samples; the last row is the full grid with every step's forward in
bfloat16 autocast.

Usage: python benchmarks/ode_tail_quality.py [--steps 10] [--window-start 2] [--tails 2 3 4 5]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from diffrl.build import build
from diffrl.config import load_config
from diffrl.rollout.engine import RolloutEngine, sample_seeds
from diffrl.rollout.samplers import coarse_tail, sde_window, sigma_schedule
from diffrl.tasks.shapes.prompts import parse_prompt
from diffrl.tasks.shapes.verify import score_batch
from diffrl.types import images_to_uint8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--window-start", type=int, default=2)
    ap.add_argument("--tails", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--per-prompt", type=int, default=4)
    a = ap.parse_args()
    parts = build(load_config(None, ["run.device=cpu"]))
    engine = parts.evaluator
    batch = parts.eval_set.all().repeat(a.per_prompt)
    seeds = sample_seeds(1234, len(batch))
    prompts = [parse_prompt(t) for t in batch.texts]

    def sample(sigmas: torch.Tensor, engine: RolloutEngine = engine):
        ode = torch.zeros(len(sigmas) - 1, dtype=torch.bool)
        x0 = torch.cat(
            [
                engine._sample(batch.input_ids[k : k + 64], seeds[k : k + 64], sigmas, ode, 1)[0]
                for k in range(0, len(batch), 64)
            ]
        )
        verdicts = score_batch(images_to_uint8(x0).numpy(), prompts)
        return torch.tensor([v.overall for v in verdicts]), x0

    full = sigma_schedule(a.steps)
    ref, x_ref = sample(full)
    window = sde_window(a.steps, 1, "fixed", a.window_start, 1, 0, 0)
    print("| ODE steps after the window | accuracy | verdicts unchanged | MSE to the full grid |")
    print("|---|---|---|---|")
    print(f"| {a.steps - a.window_start - 1} (full grid) | {ref.float().mean():.3f} | 1.000 | 0 |")
    for tail in a.tails:
        sigmas, _ = coarse_tail(full, window, tail)
        ok, x0 = sample(sigmas)
        same = (ok == ref).float().mean()
        mse = ((x0 - x_ref) ** 2).mean()
        print(f"| {tail} | {ok.float().mean():.3f} | {same:.3f} | {mse:.4f} |")
    low = RolloutEngine(
        engine.model,
        dataclasses.replace(engine.cfg, ode_dtype="bfloat16"),
        [],
        engine.device,
    )
    ok, x0 = sample(full, low)
    same, mse = (ok == ref).float().mean(), ((x0 - x_ref) ** 2).mean()
    print(f"| {a.steps} steps, bfloat16 | {ok.float().mean():.3f} | {same:.3f} | {mse:.5f} |")


if __name__ == "__main__":
    main()
