"""The FL2VA recipe (first + last frames and text to video + audio, on the shipped AVBench base)
through the real loop, shrunk to seconds: two DiffusionNFT steps train the adapter, held-out
eval grades the frames, sample clips are written; the per-prompt keyframe latents are encoded
once and ride, frozen, from the prompt batch through the rollout into the TrainBatch; and a
text-only family refuses an FL2VA task."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diffrl.build import Engines, build, prompt_set
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import ConfigError, ContractError
from diffrl.models.family import noised
from diffrl.models.registry import ModelConfig, load_model
from diffrl.reward.edges import PerSample
from diffrl.tasks import TaskConfig, build_task
from diffrl.types import Trajectory, hash_cond_rows

pytest.importorskip("diffusers")

RECIPE = Path(__file__).parents[2] / "recipes" / "av_fl2va_nft.yaml"
PROMPTS, GROUP = 2, 2
TINY = [
    "run.steps=2",
    "run.eval_every=2",
    f"data.prompts_per_step={PROMPTS}",
    f"rollout.group_size={GROUP}",
    "rollout.num_steps=2",
    "rollout.eval_num_steps=2",
    "data.eval_samples_per_prompt=1",
    "data.eval_prompts=2",
    "algorithm.old_every=1",
    "run.tensorboard=false",
]
COND_SHAPE = (PROMPTS, 2, 3, 1, 16, 16)  # (prompts, first/last, C, 1 frame, h, w): pixel latents


def test_two_steps_of_the_fl2va_recipe(tmp_path: Path) -> None:
    root = asyncio.run(train(load_config(RECIPE, [*TINY, f"run.out_dir={tmp_path}"])))
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:  # non-finite values are written as null, so None fails here too
        numbers = {k: v for k, v in row.items() if k.startswith(("actor/", "nft/", "reward/"))}
        assert all(v is not None and math.isfinite(v) for v in numbers.values()), row
        assert row["actor/grad_norm"] > 0  # the adapter received gradient
    for row in (rows[0], rows[2]):  # held-out eval before training and at the end
        for key in ("eval/overall", "eval/frames"):
            assert 0.0 <= row[key] <= 1.0, (key, row)

    # the trained adapter moved away from its init (peft inits B at 0)
    from safetensors.torch import load_file

    ckpt = sorted((root / "checkpoints").glob("step_*"))[-1]
    adapters = load_file(str(ckpt / "adapters.safetensors"))
    b = [t for k, t in adapters.items() if ".lora_B.default." in k]
    assert b and any(t.abs().sum() > 0 for t in b)

    # one clip per held-out prompt at each eval, as GIF, WAV and PNG
    for step in ("step_000000", "step_000002"):
        clips = root / "samples" / "clips" / step
        names = sorted(p.name for p in clips.iterdir() if p.suffix != ".mp4")
        assert names == [f"clip_{k:02d}.{ext}" for k in range(2) for ext in ("gif", "png", "wav")]
        assert all((clips / n).stat().st_size > 0 for n in names)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    out = tmp_path_factory.mktemp("fl2va")
    return build(load_config(RECIPE, [*TINY, f"run.out_dir={out}", "probe.mode=off"]))


def test_conditions_ride_frozen_from_prompts_to_the_update(parts: Engines) -> None:
    prompts = parts.prompts.at(0)
    assert prompts.cond is not None and prompts.cond.shape == COND_SHAPE
    assert torch.isfinite(prompts.cond).all() and not prompts.cond.requires_grad

    traj = asyncio.run(parts.rollout.generate(prompts, seed=0))
    torch.testing.assert_close(
        traj.prompts.cond, prompts.cond.repeat_interleave(GROUP, 0), rtol=0, atol=0
    )
    scored, _ = asyncio.run(parts.rewards.score(traj))
    batch = parts.algorithm.prepare(scored, parts.cfg.algorithm)
    assert len(batch) == len(traj)  # every sample valid, none dropped
    torch.testing.assert_close(batch.cond, traj.prompts.cond, rtol=0, atol=0)

    # the conditions reach the actor's velocity: other keyframes give another velocity
    actor = parts.actor
    sigma = torch.full((len(batch),), 0.5)
    x = noised(
        batch.x0, sigma, torch.randn(batch.x0.shape, generator=torch.Generator().manual_seed(0))
    )
    with torch.no_grad():
        v = actor.velocity(x, sigma, batch.input_ids, cond=batch.cond)
        v_other = actor.velocity(x, sigma, batch.input_ids, cond=torch.zeros_like(batch.cond))
    assert (v - v_other).abs().max() > 1e-4

    # ... and no gradient flows back into them, even from a leaf that asks for one
    leaf = batch.cond.clone().requires_grad_(True)
    actor.velocity(x, sigma, batch.input_ids, cond=leaf).pow(2).mean().backward()
    assert leaf.grad is None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.params)
    actor.opt.zero_grad(set_to_none=True)

    # a gradient step on the actor leaves the batch's conditions as they were
    cond_before = batch.cond.clone()
    lora_before = [p.detach().clone() for p in actor.params]
    metrics = actor.train_step(batch)
    assert metrics["actor/grad_norm"] > 0 and math.isfinite(metrics["actor/loss"])
    assert any(not torch.equal(p, q) for p, q in zip(actor.params, lora_before, strict=True))
    torch.testing.assert_close(batch.cond, cond_before, rtol=0, atol=0)
    assert not batch.cond.requires_grad and batch.cond.grad is None
    torch.testing.assert_close(prompts.cond, cond_before[::GROUP], rtol=0, atol=0)


def test_a_text_only_family_refuses_an_fl2va_task() -> None:
    task = build_task(TaskConfig(task="avbench_fl2va"))
    model = load_model(ModelConfig(preset="sd35-tiny"))
    with pytest.raises(ConfigError, match="takes no conditions beyond the text") as err:
        prompt_set(task, model, task.prompts("train")[:2])
    assert "'avbench_fl2va'" in str(err.value) and "'sd3'" in str(err.value)
    # the T2VA task is text only, and sd3 takes it
    t2va = build_task(TaskConfig(task="avbench"))
    assert prompt_set(t2va, model, t2va.prompts("train")[:2]).cond is None


def test_the_conditions_are_hashed_once_and_a_changed_frame_is_refused(parts: Engines) -> None:
    """Contract 3 for the conditions: hashed in the data stage beside the ids, carried to the
    update; one keyframe changed on the way stops the rollout and the actor, naming the rows."""
    prompts = parts.prompts.at(0)
    assert prompts.cond_hash == hash_cond_rows(prompts.cond)
    frame = prompts.cond.clone()
    frame[1, 1] += 0.5  # the last keyframe of prompt 1
    with pytest.raises(ContractError, match=r"at the rollout engine: cond .* rows \[2, 3\]"):
        asyncio.run(parts.rollout.generate(replace(prompts, cond=frame), seed=0))

    traj = asyncio.run(parts.rollout.generate(prompts, seed=0))
    scored, _ = asyncio.run(parts.rewards.score(traj))
    batch = parts.algorithm.prepare(scored, parts.cfg.algorithm)
    assert batch.cond_hash == traj.prompts.cond_hash == prompts.repeat(GROUP).cond_hash
    frames = batch.cond.clone()
    frames[0, 0, 0, 0, 3, 5] = -frames[0, 0, 0, 0, 3, 5] + 1e-3  # one latent value of row 0
    version = parts.actor.version
    with pytest.raises(ContractError, match=r"token drift at the actor: cond .* rows \[0\]"):
        parts.actor.train_step(replace(batch, cond=frames))
    assert parts.actor.version == version  # nothing trained


def test_a_changed_conditioning_frame_stops_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout's trajectories reach the controller with the first keyframe of row 1
    changed (as a re-encoding in another precision would): the first update refuses."""
    put = PerSample.put  # the rollout -> reward edge, a micro-batch at a time

    async def drifting_put(self, record, version):
        if isinstance(record, Trajectory) and record.prompts.cond is not None:
            frame = record.prompts.cond.clone()
            frame[1, 0] = frame[1, 0].bfloat16().float() + 1e-2
            record = replace(record, prompts=replace(record.prompts, cond=frame))
        await put(self, record, version)

    monkeypatch.setattr(PerSample, "put", drifting_put)
    over = [*TINY, "run.steps=1", f"run.out_dir={tmp_path}", "probe.mode=off"]
    message = r"token drift at the actor: cond \(conditioning frames/latents\) of rows \[1\]"
    with pytest.raises(ContractError, match=message):
        asyncio.run(train(load_config(RECIPE, over)))
