"""The rollout of a video+audio family records its latent's modality split, and at SDE steps
the log-prob per modality (FlowGRPO's algorithm.modality_credit), consistent with the joint
log-prob it has always recorded; an image family's trajectory carries neither."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import Prompt, PromptSet

pytest.importorskip("diffusers")


def generate(model, text: str = "a red ball bounces twice, high beeps", **kw):
    engine = RolloutEngine(
        model, RolloutConfig(group_size=2, num_steps=3, **kw), [], torch.device("cpu")
    )
    prompts = PromptSet([Prompt(text)], model.family.tokenize)
    return asyncio.run(engine.generate(prompts.all(), seed=3))


def test_an_av_rollout_records_its_log_probs_per_modality() -> None:
    from diffrl.models.registry import ModelConfig, load_model

    cfg = ModelConfig(family="minimax_h3", preset="h3-avbench", weights="builtin:avbench_h3")
    model = load_model(cfg)
    sde = dict(sampler="sde", keep_latents=True, sde_window=1, sde_window_start=1)
    traj = generate(model, **sde)
    split = model.family.net.dims
    assert traj.modality_split == tuple(split) and sum(split) == traj.x0.shape[1]
    lp_m = traj.modality_log_probs  # (B, T, 2)
    assert lp_m is not None and lp_m.shape == (2, 3, 2)
    joint = (split[0] * lp_m[..., 0] + split[1] * lp_m[..., 1]) / sum(split)
    torch.testing.assert_close(joint, traj.log_probs, rtol=1e-5, atol=1e-5)
    assert traj.sde_mask.tolist() == [False, True, False]
    assert lp_m[:, 1].ne(0).all() and lp_m[:, [0, 2]].eq(0).all()  # ODE steps: 0, as the joint
    # an ODE rollout has no log-probs to split
    assert generate(model).modality_log_probs is None


def test_an_image_family_records_no_modalities(tiny_model) -> None:
    traj = generate(tiny_model, "a red circle", sampler="sde", keep_latents=True)
    assert traj.modality_split is None and traj.modality_log_probs is None
