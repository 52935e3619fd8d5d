"""``diffrl bench``: the three kinds run on a tiny recipe and report consistent figures; the
FLOP model follows the algorithm; bad kinds are refused."""

from __future__ import annotations

import pytest
import torch
from tiny_runs import tiny_run

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller import bench as B
from diffrl.errors import ConfigError
from diffrl.models.registry import load_model


def cfg_for(tiny_checkpoint, tmp_path, *extra):
    over = tiny_run(tiny_checkpoint, tmp_path, 1, "rollout.num_steps=3", *extra)
    return load_config("recipes/shapes_nft.yaml", over)


@pytest.mark.parametrize("kind", B.KINDS)
def test_each_kind_reports_consistent_figures(kind, tiny_checkpoint, tmp_path) -> None:
    cfg = cfg_for(tiny_checkpoint, tmp_path)
    r = B.bench(kind, cfg, repeats=1, baseline=(kind == "rollout"))
    rows = r.rows()
    n = cfg.data.prompts_per_step * cfg.rollout.group_size
    assert r.samples == n and r.seconds > 0 and r.peak_flops > 0
    # the FLOPs are the family's analytic count times the forwards the work ran: 3 sampler
    # steps (no CFG) per rollout sample; NFT's old, forward and backward per trained timestep
    assert cfg.rollout.cfg_scale == 1 and cfg.algorithm.kl_coef == 0
    family_fwd = load_model(cfg.model, torch.device("cpu")).family.flops(1)
    per_sample = {"rollout": 3, "train": 3 * cfg.algorithm.timesteps_per_sample}
    per_sample["epoch"] = per_sample["rollout"] + per_sample["train"]
    assert r.flops == pytest.approx(n * per_sample[kind] * family_fwd)
    assert rows[f"bench/{kind}/samples_per_s"] == pytest.approx(n / r.seconds)
    assert 0 < rows[f"bench/{kind}/mfu"] < 1
    if kind == "rollout":
        assert rows["bench/rollout/step_latency_s"] == pytest.approx(r.seconds / 3)
        assert rows["bench/rollout/speedup"] > 0


def test_flop_model_follows_the_algorithm(tiny_checkpoint, tmp_path) -> None:
    nft = cfg_for(
        tiny_checkpoint, tmp_path, "algorithm.timesteps_per_sample=2", "algorithm.kl_coef=0.1"
    )
    assert B.forwards_per_trained_sample(nft, None) == 2 * 4  # old, fwd, bwd, KL reference
    grpo = load_config("recipes/shapes_grpo.yaml", tiny_run(tiny_checkpoint, tmp_path, 1))

    class Batch:
        sde_mask = torch.tensor([True] * 5 + [False] * 5)

    k = max(1, round(grpo.algorithm.timestep_fraction * 5))
    kl = 1 if grpo.algorithm.kl_coef > 0 else 0
    assert B.forwards_per_trained_sample(grpo, Batch()) == k * (2 + kl)


def test_cli_and_bad_kind(tiny_checkpoint, tmp_path, capsys) -> None:
    over = tiny_run(tiny_checkpoint, tmp_path, 1, "rollout.num_steps=2")
    assert main(["bench", "train", "recipes/shapes_nft.yaml", *over, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "bench/train/samples_per_s" in out and "bench/train/mfu" in out
    with pytest.raises(ConfigError, match="kind"):
        B.bench("sample", cfg_for(tiny_checkpoint, tmp_path))
    with pytest.raises(ConfigError, match="repeats"):
        B.bench("train", cfg_for(tiny_checkpoint, tmp_path), repeats=0)
