"""FlowGRPO's first-step gate: on the first update, before any weight changes, the policy must
reproduce the rollout's log-probs (ratio 1) within a threshold per dtype, else the run stops
naming the measured gap; the gap over the trained steps is logged every step."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from tiny_runs import tiny_run

from diffrl.algorithms.flow_grpo import (
    FIRST_STEP_MAX_GAP,
    FirstStepGap,
    GRPOConfig,
    first_step_gate,
)
from diffrl.build import build
from diffrl.config import load_config
from diffrl.controller.run_dir import read_metrics
from diffrl.controller.sync import train_sync

RECIPE = "shapes_grpo.yaml"


def _diag(gap: float) -> dict[str, float]:
    return {
        "grpo/logp_diff_max": gap,
        "grpo/logp_diff_mean": gap / 2,
        "grpo/ratio_dev_first": math.expm1(gap),
    }


def test_gate_thresholds() -> None:
    cfg = GRPOConfig()
    first_step_gate(_diag(0.0), cfg, torch.float32)
    first_step_gate(_diag(0.9 * FIRST_STEP_MAX_GAP[torch.bfloat16]), cfg, torch.bfloat16)
    over = 2 * FIRST_STEP_MAX_GAP[torch.float32]
    with pytest.raises(FirstStepGap, match=f"differs from the rollout's by {over:.3g}.*float32"):
        first_step_gate(_diag(over), cfg, torch.float32)
    with pytest.raises(FirstStepGap):  # a NaN log-prob fails
        first_step_gate(_diag(float("nan")), cfg, torch.float32)
    with pytest.raises(FirstStepGap, match="threshold 1e-06"):
        first_step_gate(_diag(2e-6), GRPOConfig(first_step_max_gap=1e-6), torch.float32)
    first_step_gate(_diag(1.0), GRPOConfig(first_step_max_gap=-1), torch.float32)  # off


def _run(cfg, parts):
    async def go():
        try:
            return await train_sync(cfg, parts)
        finally:
            await parts.aclose()

    return asyncio.run(go())


def test_perturbed_rollout_log_probs_stop_the_first_step(tiny_checkpoint, tmp_path) -> None:
    """The rollout records log-probs off by 0.01 (as a sampler or weights mismatch would): the
    run stops at step 1, before the actor's first optimizer step, stating the gap."""
    cfg = load_config(RECIPE, tiny_run(tiny_checkpoint, tmp_path, 2))
    parts = build(cfg)
    sample = parts.rollout._sample

    def perturbed(*args, **kw):
        x0, latents, log_probs, versions = sample(*args, **kw)
        return x0, latents, log_probs + 0.01, versions

    parts.rollout._sample = perturbed  # type: ignore[method-assign]
    with pytest.raises(FirstStepGap, match=r"by 0\.01 .*threshold 0\.0001 for float32"):
        _run(cfg, parts)
    assert parts.actor.version == 0  # no optimizer step was taken


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_normal_run_passes_and_logs_the_gap(dtype, tiny_checkpoint, tmp_path) -> None:
    cfg = load_config(RECIPE, tiny_run(tiny_checkpoint, tmp_path, 2, f"model.dtype={dtype}"))
    parts = build(cfg)
    rows = read_metrics(_run(cfg, parts))[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 <= r["check/logp_gap_mean"] <= r["check/logp_gap_max"]
    limit = FIRST_STEP_MAX_GAP[getattr(torch, dtype)]
    assert 0 <= rows[0]["grpo/logp_diff_max"] <= rows[0]["check/logp_gap_max"] < limit
    if dtype == "float32":  # samples of its own weights: fp32 reproduces them exactly here
        assert rows[0]["check/logp_gap_max"] < 1e-6 and rows[0]["grpo/ratio_dev_first"] < 1e-6
