"""End to end: the sync controller on a tiny random model, its run directory, resume, CLI."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics

RECIPE = "recipes/shapes_nft.yaml"


def overrides(checkpoint: Path, out_dir: Path, steps: int) -> list[str]:
    return [
        f"model.checkpoint={checkpoint}",
        f"run.steps={steps}",
        "data.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.num_steps=3",
        "rollout.eval_num_steps=2",
        "run.eval_every=2",
        "run.save_every=1",
        "probe.mode=off",
        f"run.out_dir={out_dir}",
        "run.tensorboard=true",
        # partial credit: a random model rarely meets every constraint, and with the default
        # binary reward its groups would tie (r = 1/2 everywhere: no gradient to check)
        "reward.scorers=[{name: shapes, weight: 1.0, required: true, params: {mode: partial}}]",
        # the delayed copy of `old` (every 2 steps), whose schedule these tests check; the
        # default recipe's EMA refreshes every step
        "algorithm.old_update=copy",
        "algorithm.old_every=2",
        # prompts drawn by earlier steps' rewards: the resumed run must restore that state
        # (and the prefetched step's rewards must not leak into the checkpoint's)
        "data.sampling=spread",
    ]


def run_train(checkpoint: Path, out_dir: Path, steps: int) -> Path:
    return asyncio.run(train(load_config(RECIPE, overrides(checkpoint, out_dir, steps))))


def lora(adapters: dict, kind: str, adapter: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in adapters.items() if f".{kind}.{adapter}." in k}


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """A 3-step run, a snapshot of it, the same run resumed to 5 steps, and an uninterrupted
    5-step reference run."""
    out = tmp_path_factory.mktemp("runs")
    root = run_train(tiny_checkpoint, out / "a", 3)
    snapshot = out / "after_3"
    shutil.copytree(root, snapshot)
    resumed = run_train(tiny_checkpoint, out / "a", 5)
    reference = run_train(tiny_checkpoint, out / "b", 5)
    return {
        "first": snapshot,
        "resumed": resumed,
        "reference": reference,
        "cfg": load_config(RECIPE, overrides(tiny_checkpoint, out / "a", 3)),
    }


def test_run_directory_layout(runs) -> None:
    root = runs["first"]
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/overall" in rows[0] and 0.0 <= rows[0]["eval/overall"] <= 1.0
    for r in rows[1:]:
        assert 0.0 <= r["reward/mean"] <= 1.0  # the shapes scorer's range
        assert r["reward/shapes/valid_frac"] == 1.0
        assert r["actor/grad_norm"] > 0
    assert {r["step"] for r in rows if "eval/overall" in r} == {0, 2, 3}  # every 2 and the end
    assert {r["step"] for r in rows if "sync/version" in r} == {2}  # old copied every 2 steps
    assert load_config(root / "config.yaml") == runs["cfg"]
    assert list((root / "tb").glob("events.out.tfevents.*"))
    for step in (0, 2, 3):
        assert (root / "samples" / f"step_{step:06d}.png").stat().st_size > 0
    assert (root / "curves.png").stat().st_size > 0
    assert (root / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in (root / "checkpoints").glob("step_*")) == [
        "step_000002",
        "step_000003",
    ]  # keep=2


def test_tensorboard_scalars(runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["first"] / "tb"))
    acc.Reload()
    rows = {r["step"]: r for r in read_metrics(runs["first"])}
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2, 3]
    for e in events:
        assert e.value == pytest.approx(rows[e.step]["reward/mean"], rel=1e-6)


def test_lora_trained_and_old_refreshed(runs) -> None:
    ckpt = runs["first"] / "checkpoints" / "step_000003"
    adapters = load_file(str(ckpt / "adapters.safetensors"))
    b_default, b_old = lora(adapters, "lora_B", "default"), lora(adapters, "lora_B", "old")
    assert len(b_default) == len(b_old) == 8
    for k, v in b_default.items():
        assert v.abs().max() > 0, k  # lora_B starts at zero: it was trained
    for k, v in b_old.items():
        assert v.abs().max() > 0, k  # old was refreshed from default at step 2
    # ... but not at step 3, so default has moved past it
    assert any(
        not torch.equal(v, b_old[k.replace(".default.", ".old.")]) for k, v in b_default.items()
    )
    state = torch.load(ckpt / "actor.pt", weights_only=True)
    assert state["version"] == 3
    assert json.loads((ckpt / "controller.json").read_text())["step"] == 3


def test_perf_flops_per_stage(runs) -> None:
    """perf/tflop/* (diffrl.controller.flops): the tiny DiT embeds its own ids (no encoder),
    its decode is a cast and the shapes verifier has no matmul, so the step's FLOPs are the
    rollout's forwards (8 samples x 3 steps, no CFG) and NFT's update (old, forward and backward
    per trained timestep); FLOP/s is logged, and no MFU on a CPU (no matmul ceiling measured)."""
    from diffrl.models.registry import load_model

    cfg = runs["cfg"]
    forward = load_model(cfg.model).family.flops(1) / 1e12
    samples = cfg.data.prompts_per_step * cfg.rollout.group_size
    for r in read_metrics(runs["first"])[1:]:
        assert r["perf/tflop/rollout"] == pytest.approx(samples * 3 * forward)
        train = samples * 3 * cfg.algorithm.timesteps_per_sample * forward
        assert r["perf/tflop/train"] == pytest.approx(train) == r["perf/tflop/train_hw"]
        assert r["perf/tflop/encode"] == r["perf/tflop/decode"] == r["perf/tflop/reward"] == 0
        assert r["perf/pipeline_tflops"] > 0 and "perf/pipeline_mfu" not in r


def test_resume_continues_from_the_checkpoint(runs) -> None:
    root = runs["resumed"]
    rows = read_metrics(root)
    steps = [r["step"] for r in rows]
    assert steps == [0, 1, 2, 3, 4, 5]  # each exactly once; no second step-0 eval
    first = {r["step"]: r for r in read_metrics(runs["first"])}
    for r in rows[:4]:  # the first run's rows are kept as they were
        assert r == first[r["step"]]
    # the clock and the optimizer continued: wall time grows, actor version is 5, not 2
    assert rows[4]["perf/wall_s"] > rows[3]["perf/wall_s"]
    ckpt = root / "checkpoints" / "step_000005"
    assert torch.load(ckpt / "actor.pt", weights_only=True)["version"] == 5
    assert (root / "samples" / "step_000005.png").exists()


def test_resume_matches_an_uninterrupted_run(runs) -> None:
    resumed = {r["step"]: r for r in read_metrics(runs["resumed"])}
    straight = {r["step"]: r for r in read_metrics(runs["reference"])}
    for step in (1, 2, 3, 4, 5):
        for key in ("reward/mean", "actor/loss", "nft/loss_pos", "nft/loss_neg"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-7), (
                step,
                key,
            )
    a = load_file(str(runs["resumed"] / "checkpoints" / "step_000005" / "adapters.safetensors"))
    b = load_file(str(runs["reference"] / "checkpoints" / "step_000005" / "adapters.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_cli_reports_config_errors(capsys) -> None:
    assert main(["train", RECIPE, "algorithm.betta=1"]) == 2
    err = capsys.readouterr().err
    assert "diffrl: error" in err and "algorithm.betta" in err
    assert main(["train", "rollout.sampler=foo"]) == 2  # recipe omitted: the default one
    err = capsys.readouterr().err
    assert "rollout.sampler" in err and "ode" in err
