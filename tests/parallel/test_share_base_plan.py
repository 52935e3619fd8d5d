"""``rollout.share_base`` in ``diffrl plan``: the rollout's and evaluator's rows drop to their LoRA
factors, and what a one-process run holds after its first update (``diffrl train`` prints it)
is the plan's "held between steps" within the plan-vs-held bar, while the plan of the merged
copies is not (the bar tells the layouts apart). sd35-tiny at LoRA rank 16, so that the copies
are a large share of what the run holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/sd35_nft.yaml"
TINY = [
    "model.preset=sd35-tiny", "model.resolution=32", "model.dtype=float32", "run.device=cpu",
    "data.prompts_per_step=2", "rollout.group_size=2", "rollout.max_batch=4",
    "rollout.num_steps=2", "rollout.eval_num_steps=2", "data.eval_prompts=2",
    "data.eval_samples_per_prompt=1", "probe.mode=off", "actor.micro_batch=2",
    "algorithm.timesteps_per_sample=1", "actor.lora.rank=16", "actor.lora.alpha=16",
    "reward.scorers=[{name: jpeg_incompressibility}]",
]  # fmt: skip
PLAN_TOLERANCE = 0.15  # as tests/parallel/test_h3_8rank_cli.py


def _planned_mib(capsys, *over: str) -> float:
    from diffrl.cli import main

    main(["plan", RECIPE, *TINY, *over])
    out = capsys.readouterr().out
    return float(re.search(r"held between steps: ([\d.]+) MiB per rank", out).group(1))


def test_a_shared_base_run_holds_what_the_plan_says(tmp_path: Path, capsys) -> None:
    run = [f"run.out_dir={tmp_path}", "run.name=r", "run.steps=1", "run.tensorboard=false"]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # a process of its own: what it holds is the run's alone
    done = subprocess.run(
        [sys.executable, "-m", "diffrl.cli", "train", RECIPE, *TINY, *run, "run.threads=1",
         "rollout.share_base=true"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    line = re.search(r"tensors held after the first update, MiB per rank: ([\d.]+) \(", done.stderr)
    held = float(line.group(1))
    shared = _planned_mib(capsys, "rollout.share_base=true")
    merged = _planned_mib(capsys, "rollout.share_base=false")
    assert abs(held / shared - 1) < PLAN_TOLERANCE, (held, shared)
    assert abs(held / merged - 1) > PLAN_TOLERANCE, (held, merged)


def test_what_cannot_share_is_refused_by_the_plan(capsys) -> None:
    from diffrl.config import load_config
    from diffrl.errors import ConfigError
    from diffrl.parallel.plan import PlanOptions, plan

    cfg = load_config(RECIPE, [*TINY, "rollout.share_base=true"])
    with pytest.raises(ConfigError, match="--train full"):
        plan(cfg, PlanOptions(train="full"))
    with pytest.raises(ConfigError, match="cannot be shared"):
        plan(cfg, PlanOptions(world_size=2, dp_shard=2))
