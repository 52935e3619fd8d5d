"""Every shipped recipe loads, and runs two steps end to end on the tiny random model."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tiny_runs import tiny_run

from diffrl.build import build
from diffrl.config import REPO_ROOT, load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import CONTRACTS_LOG, ConfigError
from diffrl.models.registry import PRESET_FAMILY

RECIPES = sorted(p.name for p in (REPO_ROOT / "recipes").glob("*.yaml"))
# recipes whose tiny run has its own test, with their own reward (CI time: ~15 s each here)
OWN_TEST = {"h3_t2va_nft.yaml", "h3_fl2va_nft.yaml"}  # test_h3_recipes.py
# FlowGRPO variants run their two steps at the smallest size in test_ratio_losses.py
OWN_TEST |= {"shapes_grpo_guard.yaml", "shapes_dppo.yaml"}
# (shapes_opd: tests/algorithms/test_opd.py, with a teacher LoRA it writes)
OWN_TEST |= {"shapes_opd.yaml"}
OWN_TEST |= {"shapes_grpo_pref.yaml"}  # tests/reward/test_group_recipe.py (smallest size)
OWN_TEST |= {"omni_shapes_ppo.yaml"}  # an autoregressive family: test_omni_recipe.py


def test_the_algorithm_recipes_ship() -> None:
    want = {"shapes_nft.yaml", "shapes_grpo.yaml", "shapes_grpo_fast.yaml", "shapes_dpo.yaml"}
    assert want <= set(RECIPES)


def tiny_family_overrides(recipe: str) -> list[str]:
    """A recipe for a user's diffusers directory, or for a real-size preset without weights
    (plan-only), runs on its family's tiny random preset (fp32, so the log-probs agree to 1e-5),
    a weight-free reward and two held-out prompts; a recipe that names its model (the tiny DiT,
    or a preset with shipped weights) runs as it is."""
    cfg = load_config(recipe)
    model = cfg.model
    # a recipe laid out over several ranks (h3_fl2va_8gpu: tp 4, etp 4) runs in one process
    one = [f"parallel.{k}=1" for k in ("tp", "etp", "sp") if getattr(cfg.parallel, k) > 1]
    if model.resolved_family == "tiny_dit" or (model.preset and model.weights):
        return one
    pytest.importorskip("diffusers")
    family = model.resolved_family
    preset = next(p for p, f in PRESET_FAMILY.items() if f == family and p.endswith("-tiny"))
    frames = 0
    if cfg.data.task.startswith("avbench"):  # AVBench's clips need the AVBench preset's geometry
        if family == "minimax_h3":
            preset = "h3-avbench"
        else:  # or >= 10 frames (ltx2-tiny has 9; 11 is its next count)
            frames = 11
    return [
        "run.device=auto",  # a plan-only real-size recipe (e.g. h3_fl2va_8gpu) names cuda
        f"model.preset={preset}",
        "model.resolution=0",
        "model.height=0",  # h3_fl2va_8gpu's 288 x 448
        "model.width=0",
        f"model.frames={frames}",
        "model.dtype=float32",
        "data.eval_prompts=2",
        "reward.scorers=[{name: jpeg_incompressibility}]",
        *one,
    ]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in OWN_TEST])
def test_recipe_runs_two_steps(recipe: str, tiny_checkpoint, tmp_path: Path, caplog) -> None:
    shipped = load_config(recipe)  # compiled where the recipe compiles (the default one does)
    extra = ["rollout.num_steps=4", "run.eval_every=2", *tiny_family_overrides(recipe),
             f"rollout.compile={str(shipped.rollout.compile).lower()}",
             f"actor.compile={str(shipped.actor.compile).lower()}",
             "probe.mode=on"]  # fmt: skip
    cfg = load_config(recipe, tiny_run(tiny_checkpoint, tmp_path, 2, *extra))
    with caplog.at_level(logging.INFO, logger=CONTRACTS_LOG):
        root = asyncio.run(train(cfg))
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # contract 1 ran at start-up and decided: parity against the family's pipeline, or (no
    # pipeline: the tiny DiT, h3-avbench) reconstruction on the task's ground truth
    assert rows[0]["probe/skipped"] == 0.0
    parity = rows[0]["probe/parity_worst"]
    decided = (parity is not None and parity < 1.0) or rows[0]["probe/cosine"] > 0.5
    warned = [r.message for r in caplog.records if r.name == CONTRACTS_LOG and r.levelno >= 30]
    no_pipeline = cfg.model.resolved_family == "tiny_dit" or cfg.model.preset == "h3-avbench"
    if no_pipeline and not cfg.model.weights:  # here a random stand-in with no pipeline (the
        # tiny DiT; h3-avbench for h3_fl2va_8gpu, whose minimax-h3 has one): random weights
        # cannot decide reconstruction, and the run must say the convention is unchecked (the
        # shipped shapes base decides: tests/test_silent_failures.py)
        assert decided or any("unchecked" in m for m in warned), warned
    else:
        assert decided and warned == [], (rows[0], warned)
    assert all("reward/mean" in r and "actor/loss" in r for r in rows[1:])
    if cfg.algorithm.name == "flow_grpo":  # rollout and training agree on the log-probs
        assert all(r["grpo/logp_diff_max"] < 1e-5 for r in rows[1:])


@pytest.mark.parametrize(
    "bad, key",
    [
        ("rollout.sampler=ode", "rollout.sampler"),
        ("rollout.keep_latents=false", "rollout.keep_latents"),
        ("rollout.noise_level=0", "rollout.noise_level"),
    ],
)
def test_grpo_refuses_rollouts_without_log_probs(bad, key, tiny_checkpoint, tmp_path) -> None:
    with pytest.raises(ConfigError, match=key):  # when the config loads, before any work
        load_config("shapes_grpo.yaml", tiny_run(tiny_checkpoint, tmp_path, 1, bad))


def test_a_config_built_in_code_is_checked_by_the_builder(tiny_checkpoint, tmp_path) -> None:
    cfg = load_config("shapes_grpo.yaml", tiny_run(tiny_checkpoint, tmp_path, 1))
    bad = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sampler="ode"))
    with pytest.raises(ConfigError, match="rollout.sampler"):
        build(bad)


@pytest.mark.parametrize("recipe", ["shapes_nft.yaml", "shapes_dpo.yaml"])
def test_sample_trained_algorithms_refuse_a_coarse_ode_tail(recipe, tiny_checkpoint, tmp_path):
    window = ("rollout.sampler=sde", "rollout.sde_window=1", "rollout.sde_window_start=1")
    cfg = load_config(recipe, tiny_run(tiny_checkpoint, tmp_path, 1, *window))
    build(cfg)  # a window alone is fine: the samples are still the full grid's
    tail = (*window, "rollout.ode_tail_steps=2")
    with pytest.raises(ConfigError, match="rollout.ode_tail_steps"):
        load_config(recipe, tiny_run(tiny_checkpoint, tmp_path, 1, *tail))


def test_eval_samples_without_the_rollouts_guidance_or_shared_noise(
    tiny_checkpoint, tmp_path: Path
) -> None:
    overrides = (
        "rollout.cfg_scale=3",
        "rollout.shared_init_noise=true",
        "rollout.ode_dtype=bfloat16",
    )
    cfg = load_config("shapes_nft.yaml", tiny_run(tiny_checkpoint, tmp_path, 1, *overrides))
    parts = build(cfg)
    assert parts.rollout.cfg.cfg_scale == 3.0 and parts.rollout.cfg.shared_init_noise
    assert parts.evaluator.cfg.cfg_scale == 1.0  # rollout.eval_cfg_scale's default
    # every held-out sample has its own initial noise (52 prompts x 4 = 208 draws, not 52)
    assert not parts.evaluator.cfg.shared_init_noise
    assert parts.evaluator.cfg.ode_dtype == "float32"  # and in full precision
    guided = load_config(
        "shapes_nft.yaml", tiny_run(tiny_checkpoint, tmp_path, 1, "rollout.eval_cfg_scale=2")
    )
    assert build(guided).evaluator.cfg.cfg_scale == 2.0


def test_ema_eval_reports_the_ema_policy_and_optionally_the_live_one(
    tiny_checkpoint, tmp_path: Path
) -> None:
    extra = ("rollout.num_steps=4", "actor.ema_decay=0.5", "run.eval_every=1", "run.eval_live=true")
    cfg = load_config("shapes_grpo_fast.yaml", tiny_run(tiny_checkpoint, tmp_path, 2, *extra))
    root = asyncio.run(train(cfg))
    rows = read_metrics(root)
    assert all("eval/overall" in r and "eval_live/overall" in r for r in rows)
    assert rows[0]["eval/overall"] == rows[0]["eval_live/overall"]  # identical at the start
    ckpt = root / "checkpoints" / (root / "checkpoints" / "latest").read_text().strip()
    saved = load_file(str(ckpt / "adapters.safetensors"))
    assert any(".ema." in k for k in saved)  # resume restores the average too
    plain = load_config("shapes_grpo.yaml", tiny_run(tiny_checkpoint, tmp_path / "p", 0))
    assert build(plain).actor.eval_adapter == "default"  # off unless set: no eval_live/*
