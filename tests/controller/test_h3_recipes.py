"""The one-GPU MiniMax-H3 recipes (h3_t2va_nft, h3_fl2va_nft) at tiny size on CPU, through the
real CLI with their own reward: tiny random CLAP and ImageBind weights written by
benchmarks/random_av_rewards.py --tiny (so the device call's first stage runs here too). Both
scorers' rewards are logged and finite; FL2VA's update trains on the data stage's keyframe
latents, unchanged and unreachable by the gradient; a placeholder path stops the run with one
line naming the key. (test_recipes.py leaves these two recipes to this file.)"""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from diffrl.actor.engine import ActorEngine
from diffrl.cli import main
from diffrl.config import REPO_ROOT
from diffrl.controller.run_dir import read_metrics
from diffrl.models.family import noised
from diffrl.types import TrainBatch, hash_cond_rows

pytest.importorskip("diffusers")

# the recipes' own tiny command (their header), one held-out clip of 2 steps
TINY = [
    "model.preset=h3-avbench",
    "model.weights=builtin:avbench_h3",  # the shipped base: its clips follow the keyframes
    "model.dtype=float32",
    "model.height=0",
    "model.width=0",
    "model.frames=0",
    "run.device=cpu",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.num_steps=2",
    "data.eval_prompts=1",
    "data.eval_samples_per_prompt=1",
    "rollout.eval_num_steps=2",
    "probe.mode=off",
    "run.tensorboard=false",
]


@pytest.fixture(scope="module")
def rewards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The script's --tiny path, in this process: its printed override."""
    script = runpy.run_path(str(REPO_ROOT / "benchmarks" / "random_av_rewards.py"))
    out = tmp_path_factory.mktemp("av_rewards")
    override = script["main"]([str(out), "--tiny"])
    assert (out / "clap" / "config.json").is_file() and (out / "imagebind_tiny.pth").is_file()
    state = torch.load(out / "imagebind_tiny.pth", weights_only=True)
    # Meta's names for the AV towers (tests/reward/test_imagebind.py pins the whole layout)
    assert "modality_trunks.vision.blocks.0.attn.in_proj_weight" in state
    assert "modality_heads.audio.2.weight" in state and not any("text" in k for k in state)
    return override


def train(recipe: str, steps: int, out: Path, *extra: str) -> list[dict]:
    argv = [
        "train",
        str(REPO_ROOT / "recipes" / recipe),
        *TINY,
        f"run.steps={steps}",
        f"run.out_dir={out}",
    ]
    assert main([*argv, *extra]) == 0
    rows = read_metrics(out / recipe.removesuffix(".yaml"))
    assert [r["step"] for r in rows] == list(range(steps + 1))
    for r in rows[1:]:  # both scorers scored every clip, and the reward is their weighted sum
        for key in ("clap", "imagebind"):
            assert math.isfinite(r[f"reward/{key}/mean"]) and r[f"reward/{key}/valid_frac"] == 1
        want = 0.5 * r["reward/clap/mean"] + 0.5 * r["reward/imagebind/mean"]
        assert r["reward/mean"] == pytest.approx(want, abs=1e-6)
        assert r["actor/grad_norm"] > 0 and math.isfinite(r["actor/loss"])
    return rows


def test_t2va_recipe_trains_on_clap_and_imagebind(rewards: str, tmp_path: Path) -> None:
    train("h3_t2va_nft.yaml", 1, tmp_path, rewards)


def test_fl2va_recipe_trains_with_frozen_conditions(
    rewards: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two steps (the old policy refreshes at step 2). Every batch the update trains on holds
    the data stage's keyframe latents, bit for bit (re-hashed against the hashes made where
    they were encoded), without a gradient, and the update leaves them as they were; they
    condition the actor's velocity (first and last swapped give another), and no gradient
    reaches them from it, even through a leaf that asks for one."""
    seen: list[TrainBatch] = []
    step = ActorEngine.train_step

    def watched(self: ActorEngine, batch: TrainBatch) -> dict[str, float]:
        assert batch.cond is not None and batch.cond.shape[1] == 2  # first and last frames
        assert not batch.cond.requires_grad
        assert hash_cond_rows(batch.cond) == batch.cond_hash
        cond = batch.cond.clone()
        metrics = step(self, batch)
        torch.testing.assert_close(batch.cond, cond, rtol=0, atol=0)  # the update left them
        if not seen:
            sigma = torch.full((len(batch),), 0.5)
            x = noised(batch.x0, sigma, torch.randn_like(batch.x0))
            with torch.no_grad():  # the keyframes condition the clip ...
                v = self.velocity(x, sigma, batch.input_ids, cond=batch.cond)
                v_other = self.velocity(x, sigma, batch.input_ids, cond=batch.cond.flip(1))
            assert (v - v_other).abs().max() > 1e-4
            # ... and take no gradient back
            leaf = batch.cond.clone().requires_grad_(True)
            self.velocity(x, sigma, batch.input_ids, cond=leaf).pow(2).mean().backward()
            assert leaf.grad is None
            self.opt.zero_grad(set_to_none=True)
        seen.append(batch)
        return metrics

    monkeypatch.setattr(ActorEngine, "train_step", watched)
    train("h3_fl2va_nft.yaml", 2, tmp_path, rewards)
    assert len(seen) == 2


def test_a_placeholder_reward_path_stops_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = str(REPO_ROOT / "recipes" / "h3_t2va_nft.yaml")
    argv = ["train", recipe, *TINY, "run.steps=1", f"run.out_dir={tmp_path}"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("diffrl: error: reward.scorers[0] (clap): ")
    assert "params.path" in err[0] and "SET_REWARD_DIR/clap" in err[0]
