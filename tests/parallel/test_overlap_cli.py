"""The loops that train while the rollout samples, under ``torchrun --nproc-per-node 2 -m
diffrl.cli train`` (CPU, gloo, 2 data-parallel ranks; ``parallel/launch.py``'s
``check_overlap``), against the one-process run of the same config:

- ``run.mode=async`` (max_staleness 1): under torchrun ``run.async_weights`` resolves to
  ``fixed``, so rollout iteration i samples with exactly update i-1's weights on every rank,
  whatever the timing. Iterations 0 and 1 sample with the initial weights: the same samples as
  one process (rewards to 1e-6), the same losses up to the ranks' summation order (1e-4). The
  run stops at 2 steps and resumes for 4 with ``run.max_minutes`` spent at once, so every rank
  stops after step 3 with a checkpoint (the resumed rollouts start again from the checkpoint's
  weights, as in one process), and the staleness columns are the schedule's; after an update the
  weights agree with one process's to ~1e-5 only, so later samples are not compared.
- ``run.stream_train=true`` (sync): each rank trains its scored micro-batches as they come and
  the ranks take one averaged optimizer step; with one prompt group a micro-batch in both
  layouts, step 1's samples and update are one process's (1e-4); step 2 runs in lockstep
  (its samples, from weights equal to ~1e-5, are not compared).

``algorithm.shared_noise`` keys the loss's draws on each row's prompt group, so a row's loss
does not depend on which rank trains it (without it each rank's generator draws for its own
rows, and the losses are defined only in distribution)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch.distributed as dist
from gloo_ranks import torchrun_train
from tiny_runs import tiny_run

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

RECIPE = "recipes/shapes_nft.yaml"
PARTIAL = "reward.scorers=[{name: shapes, weight: 1.0, required: true, params: {mode: partial}}]"
TIMEOUT_S = 300.0


def _over(checkpoint: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return tiny_run(
        checkpoint, out, steps, "rollout.num_steps=2", "actor.lr=1e-2", "run.eval_every=10",
        "run.save_every=1", "data.eval_prompts=2", "rollout.max_batch=4", "run.threads=1",
        "run.name=r", "algorithm.shared_noise=true", PARTIAL, *extra,
    )  # fmt: skip


def _one(over: list[str]) -> list[dict]:
    return read_metrics(asyncio.run(train(load_config(RECIPE, over))))


def _same_samples(got: dict, want: dict) -> None:
    keys = [k for k in want if k.startswith("reward/")]
    assert keys
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (got["step"], key)


def _same_update(got: dict, want: dict, rel: float) -> None:
    for key in ("actor/loss", "actor/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=rel), (got["step"], key)


def test_async_under_torchrun_is_the_fixed_schedule_of_one_process(tiny_checkpoint, tmp_path):
    mode = ("run.mode=async", "run.max_staleness=1")
    par_dir = tmp_path / "par"
    one = _one(_over(tiny_checkpoint, tmp_path / "one", 2, *mode, "run.async_weights=fixed"))
    done = torchrun_train(2, [RECIPE, *_over(tiny_checkpoint, par_dir, 2, *mode)], TIMEOUT_S)
    assert (done.stdout + done.stderr).count("run directory:") == 1  # rank 0 alone
    before = read_metrics(par_dir / "r")
    # resumed for 4 steps with a wall budget spent at once: every rank stops after step 3
    out_of_time = _over(tiny_checkpoint, par_dir, 4, *mode, "run.max_minutes=1e-4")
    torchrun_train(2, [RECIPE, *out_of_time], TIMEOUT_S)
    rows = read_metrics(par_dir / "r")
    assert rows[:3] == before  # the resumed run continued from rank 0's step-2 checkpoint
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and [r["step"] for r in one] == [0, 1, 2]
    assert {k: v for k, v in rows[0].items() if k != "time"} == {
        k: v for k, v in one[0].items() if k != "time"
    }  # the untrained policy's held-out eval
    for got, want, rel in zip(rows[1:3], one[1:3], (1e-4, 5e-3), strict=True):
        _same_samples(got, want)  # iterations 0 and 1: the initial weights
        # step 2's update is on weights one Adam step old: Adam's normalised first step turns
        # rounding-level gradient differences in near-zero elements into lr-sized ones
        # (docs/parallel.md), so its loss and grad norm agree to rel 5e-3, not 1e-4
        _same_update(got, want, rel)
    # step 3 samples with weights two updates old, equal to ~1e-5: the partial reward of a
    # sample may flip, so its numbers are the run's own (the ranks still agree: the adapter
    # check passed on every step)
    assert rows[3]["actor/grad_norm"] > 0 and "eval/overall" in rows[3]  # the stop's eval
    # iteration i sampled with update i-1's weights; the resumed one with the checkpoint's
    assert [x["async/policy_version"] for x in rows[1:]] == [0, 0, 2]
    assert [x["async/staleness"] for x in rows[1:]] == [0, 1, 0]
    assert all(x["async/dropped"] == 0 for x in rows[1:])
    assert [(x["async/policy_version"], x["async/staleness"]) for x in one[1:]] == [(0, 0), (0, 1)]
    assert (par_dir / "r" / "checkpoints" / "latest").read_text().strip() == "step_000003"


def test_stream_train_under_torchrun_is_the_one_process_update(tiny_checkpoint, tmp_path):
    one = _one(_over(tiny_checkpoint, tmp_path / "one", 2, "run.stream_train=true"))
    par_dir = tmp_path / "par"
    over = _over(tiny_checkpoint, par_dir, 2, "run.stream_train=true")
    torchrun_train(2, [RECIPE, *over], TIMEOUT_S)
    rows = read_metrics(par_dir / "r")
    assert [r["step"] for r in rows] == [r["step"] for r in one] == [0, 1, 2]
    _same_samples(rows[1], one[1])
    _same_update(rows[1], one[1], 1e-4)
    assert rows[1]["actor/grad_norm"] > 0 and rows[2]["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    ("over", "says"),
    [
        (["run.mode=async"], r"'parallel.rollout' = 'sharded' with run.mode=async"),
        (["run.stream_train=true"], r"'parallel.rollout' = 'sharded' with run.stream_train"),
    ],
)
def test_a_sharded_rollout_does_not_overlap_the_update(over, says):
    """A rollout that makes collectives (``parallel.rollout=sharded``) would reach them while
    the actor makes its own: refused with the loops that overlap the two, naming the keys."""
    from types import SimpleNamespace

    from diffrl.errors import ConfigError
    from diffrl.parallel.launch import check_overlap

    cfg = load_config(RECIPE, over)
    check_overlap(cfg)  # tp=1: the rollout is whole whatever parallel.rollout says
    replicated = SimpleNamespace(run=cfg.run, parallel=SimpleNamespace(rollout="replicated", tp=2))
    check_overlap(replicated)  # whole copies under tp: no collective in the rollout
    sharded = SimpleNamespace(run=cfg.run, parallel=SimpleNamespace(rollout="sharded", tp=2))
    with pytest.raises(ConfigError, match=says):
        check_overlap(sharded)
