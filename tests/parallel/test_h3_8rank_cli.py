"""The 8-GPU recipe's layout from the command line on 8 gloo ranks: ``torchrun --nproc-per-node 8
-m diffrl.cli train recipes/h3_fl2va_8gpu.yaml`` (its parallel.tp=4 and parallel.etp=4, so
dp_shard 2) with the tiny preset whose heads and widths divide by 4 (h3-avbench-tp4) on the
CPU, the overrides the recipe's comment gives. One run directory, the one-process run's
samples, losses and grad norms for 2 steps, a resume in one process; and each rank's live tensors
after its first update (what ``diffrl train`` prints) within 15% of ``diffrl plan``'s
per-rank resident estimate for the same recipe and overrides."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from gloo_ranks import torchrun_train

pytest.importorskip("diffusers")

RECIPE = "recipes/h3_fl2va_8gpu.yaml"
TINY = [
    "model.preset=h3-avbench-tp4", "model.dtype=float32", "model.resolution=0", "model.frames=0",
    "model.height=0", "model.width=0",
    "run.device=cpu", "data.prompts_per_step=2", "rollout.group_size=2", "rollout.max_batch=4",
    "rollout.num_steps=2", "data.eval_prompts=2", "data.eval_samples_per_prompt=1",
    "probe.mode=off",
]  # fmt: skip
ONE_PROCESS = ["parallel.tp=1", "parallel.etp=1"]
PLAN_TOLERANCE = 0.15  # the bar: diffrl plan's per-rank estimate against the measured


def _overrides(out: Path, steps: int) -> list[str]:
    return [*TINY, f"run.steps={steps}", f"run.out_dir={out}", "run.name=r",
            "run.tensorboard=false", "run.threads=1", "run.save_every=1"]  # fmt: skip


def _planned_mib(capsys, world: int, over: list[str], *flags: str) -> float:
    """``diffrl plan``'s "held between steps" for the recipe with these overrides."""
    from diffrl.cli import main

    main(["plan", RECIPE, *over, "--world-size", str(world), *flags])
    out = capsys.readouterr().out
    return float(re.search(r"held between steps: ([\d.]+) MiB per rank", out).group(1))


def _measured_mib(console: str) -> list[float]:
    line = re.search(r"tensors held after the first update, MiB per rank: ([\d., ]+) \(", console)
    return [float(x) for x in line.group(1).split(",")]


def test_the_8gpu_recipe_runs_at_8_ranks_and_matches_the_plan(tmp_path: Path, capsys) -> None:
    from diffrl.config import load_config
    from diffrl.controller.loop import train
    from diffrl.controller.run_dir import read_metrics

    over = [*_overrides(tmp_path / "one", 3), *ONE_PROCESS]
    # a process of its own: what it holds is the run's alone (in pytest's process the other
    # tests' cached models would count too)
    done = torchrun_train(1, [RECIPE, *over], 600)
    one = read_metrics(tmp_path / "one" / "r")
    held_one = _measured_mib(done.stdout + done.stderr)
    assert len(held_one) == 1
    planned_one = _planned_mib(capsys, 1, over)
    assert abs(held_one[0] / planned_one - 1) < PLAN_TOLERANCE, (held_one, planned_one)

    out = tmp_path / "par"
    done = torchrun_train(8, [RECIPE, *_overrides(out, 2)], 600)
    console = done.stdout + done.stderr
    assert "tensor parallel: minimax_h3's TP plan over tp=4" in console
    assert "ETP: text encoder(s) text_encoder sharded over 4 ranks" in console
    assert console.count("run directory:") == 1  # rank 0 alone
    rows = read_metrics(out / "r")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for step in (1, 2):
        for key in [k for k in one[step] if k.startswith("reward/")]:  # the same samples
            assert rows[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), key
        for key in ("actor/loss", "actor/grad_norm"):  # sums reordered by the shards
            assert rows[step][key] == pytest.approx(one[step][key], rel=1e-4), (step, key)
    held = _measured_mib(console)
    planned = _planned_mib(capsys, 8, _overrides(out, 2))
    assert len(held) == 8
    for mib in held:  # every rank: the plan's per-rank figure
        assert abs(mib / planned - 1) < PLAN_TOLERANCE, (held, planned)
    # the bar tells layouts apart: counted whole, the rollout's and evaluator's copies
    # (TP-sharded on each rank here, parallel.rollout=sharded) put the plan far outside it
    wrong = _planned_mib(capsys, 8, _overrides(out, 2), "--rollout", "replicated")
    assert abs(held[0] / wrong - 1) > PLAN_TOLERANCE, (held, wrong)

    # the step-2 checkpoint (the one-process format) resumes in one process (a third layout;
    # cheaper than 8 more ranks) into the one-process run's step 3
    asyncio.run(train(load_config(RECIPE, [*_overrides(out, 3), *ONE_PROCESS])))
    rows = read_metrics(out / "r")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in ("actor/loss", "actor/grad_norm"):
        assert rows[3][key] == pytest.approx(one[3][key], rel=1e-3), key
