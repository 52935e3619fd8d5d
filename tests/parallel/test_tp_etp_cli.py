"""``diffrl train`` from the command line with the DiT and the text encoder parallel at once, set
independently: ``torchrun --nproc-per-node 4 ... recipes/av_t2va_nft.yaml parallel.tp=2
parallel.etp=4`` (dp_shard 2 x tp 2 on the main mesh, one ETP group of 4 for Qwen3-VL) on 4
gloo ranks, with the AVBench MiniMax-H3 base whose encoder's 4 key-value heads split by 4
(h3-avbench-tp4, random weights). One run directory, both layouts said at start-up, the
one-process run's samples and first step; the checkpoint resumed at the same layout into the
one-process run's second step, then at another (2 ranks, Ulysses sp=2 with etp 2, no tp) into
its third."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gloo_ranks import assert_same_first_step, torchrun_train

pytest.importorskip("diffusers")

RECIPE = "recipes/av_t2va_nft.yaml"


def _overrides(out: Path, steps: int) -> list[str]:
    return [
        f"run.steps={steps}", "data.prompts_per_step=2", "rollout.group_size=2",
        "data.eval_prompts=2", "data.eval_samples_per_prompt=1", "probe.mode=off",
        f"run.out_dir={out}", "run.name=r", "run.tensorboard=false", "rollout.compile=false",
        "actor.compile=false", "run.threads=1", "run.eval_every=2", "run.save_every=1",
        # random weights: the trained ones (builtin:avbench_h3) have 2 KV heads
        "model.preset=h3-avbench-tp4", 'model.weights=""',
    ]  # fmt: skip


def _torchrun(world: int, over: list[str]) -> str:
    done = torchrun_train(world, [RECIPE, *over], 600)
    return done.stdout + done.stderr


def test_tp_and_etp_together_from_the_command_line(tmp_path: Path) -> None:
    from diffrl.config import load_config
    from diffrl.controller.loop import train
    from diffrl.controller.run_dir import read_metrics

    one = read_metrics(asyncio.run(train(load_config(RECIPE, _overrides(tmp_path / "one", 3)))))
    out = tmp_path / "par"
    layout = ["parallel.tp=2", "parallel.etp=4"]
    console = _torchrun(4, [*_overrides(out, 1), *layout])
    assert "tensor parallel: minimax_h3's TP plan over tp=2" in console
    assert "ETP: text encoder(s) text_encoder sharded over 4 ranks" in console
    assert console.count("run directory:") == 1  # rank 0 alone
    rows = read_metrics(out / "r")
    assert [r["step"] for r in rows] == [0, 1]
    assert_same_first_step(rows, one)
    # the step-1 checkpoint (the one-process format) resumes at the same layout, then the
    # step-2 one at another: sequence parallel instead of tensor parallel
    _torchrun(4, [*_overrides(out, 2), *layout])
    console = _torchrun(2, [*_overrides(out, 3), "parallel.sp=2", "parallel.etp=2"])
    assert "sequence parallel: Ulysses over sp=2" in console
    rows = read_metrics(out / "r")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for step in (2, 3):
        for key in ("actor/loss", "actor/grad_norm"):
            assert rows[step][key] == pytest.approx(one[step][key], rel=1e-3), (step, key)


FLUX = "recipes/flux_nft.yaml"


def _flux(out: Path) -> list[str]:
    """flux1-tiny: 2 DiT heads (tp=2), a T5 of 4 heads (etp=4); group-keyed training noise, so
    the draws do not depend on which rank holds a sample."""
    return [
        "model.preset=flux1-tiny", "model.resolution=64", "model.dtype=float32",
        "reward.scorers=[{name: jpeg_incompressibility}]", "run.steps=2",
        "data.prompts_per_step=2", "rollout.group_size=2", "rollout.num_steps=2",
        "rollout.eval_num_steps=2", "data.eval_prompts=2", "data.eval_samples_per_prompt=1",
        "probe.mode=off", f"run.out_dir={out}", "run.name=r", "run.tensorboard=false",
        "rollout.compile=false", "actor.compile=false", "run.threads=1", "run.eval_every=1",
        "run.save_every=100", "algorithm.timesteps_per_sample=1", "algorithm.shared_noise=true",
    ]  # fmt: skip


def test_tp2_with_etp4_on_4_ranks_is_the_one_process_run(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 4 ... recipes/flux_nft.yaml model.preset=flux1-tiny
    parallel.tp=2 parallel.etp=4``: the DiT over dp_shard 2 x tp 2 with its rollout sharded
    over the tp pairs, FLUX's T5 over all 4 ranks; the samples, rewards and evals of the
    one-process run, its losses and grad norms to fp32 rounding (rel 1e-5: the sharded
    matmuls and the 2-way gradient all-reduce reorder sums)."""
    from diffrl.config import load_config
    from diffrl.controller.loop import train
    from diffrl.controller.run_dir import read_metrics

    one = read_metrics(asyncio.run(train(load_config(FLUX, _flux(tmp_path / "one")))))
    out = tmp_path / "par"
    done = torchrun_train(4, [FLUX, *_flux(out), "parallel.tp=2", "parallel.etp=4"], 300)
    console = done.stdout + done.stderr
    assert "tensor parallel: flux's TP plan over tp=2" in console
    assert "ETP: text encoder(s) t5 sharded over 4 ranks" in console
    assert "DiT copies sharded with the same plan" in console
    rows = read_metrics(out / "r")
    assert [r["step"] for r in rows] == [r["step"] for r in one] == [0, 1, 2]
    for step in (1, 2):
        for key in [k for k in one[step] if k.startswith(("reward/", "eval/"))]:
            assert rows[step][key] == pytest.approx(one[step][key], rel=1e-6, abs=1e-7), key
        for key in ("actor/loss", "actor/grad_norm", "nft/loss_pos", "nft/loss_neg"):
            assert rows[step][key] == pytest.approx(one[step][key], rel=1e-5), (step, key)
        assert rows[step]["sync/applied"] == one[step]["sync/applied"] > 0
