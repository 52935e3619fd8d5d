"""Every diffusers family's tiny preset, loaded from a tiny local diffusers directory (written
with save_pretrained, read back through the same from_pretrained path a user's directory takes),
runs 2 RL steps of each algorithm through the real loop: parameters change, nothing is NaN, and
for FlowGRPO the rollout's and the actor's log-probs agree."""

from __future__ import annotations

import asyncio
import importlib
import json
import math

import pytest
import torch
from sync_faults import no_op_apply

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.models.families._diffusers import save_pipeline_dir

pytest.importorskip("diffusers")

# family -> (module, tiny preset, pipeline class written into model_index.json, the sample
# size: a directory without one in its transformer config loads at the real model's default,
# 1024 px for Qwen-Image and 81 frames of 480 px for Wan, far too large for a CPU test)
FAMILIES = {
    "sd3": ("diffrl.models.families.sd3", "sd35-tiny", "StableDiffusion3Pipeline", []),
    "flux": ("diffrl.models.families.flux", "flux1-tiny", "FluxPipeline", []),
    "qwen_image": (
        "diffrl.models.families.qwen_image",
        "qwen-image-tiny",
        "QwenImagePipeline",
        ["model.resolution=32"],
    ),
    "wan": (
        "diffrl.models.families.wan",
        "wan-tiny",
        "WanPipeline",
        ["model.resolution=32", "model.frames=9"],
    ),
    # the omni families: one flat (video + audio) latent per sample
    "minimax_h3": ("diffrl.models.families.minimax_h3", "h3-tiny", "MiniMaxH3ModularPipeline", []),
    "ltx2": (
        "diffrl.models.families.ltx2",
        "ltx2-tiny",
        "LTX2Pipeline",
        ["model.resolution=32", "model.frames=9", "model.max_text_len=16"],
    ),
}
ALGORITHMS = {
    "diffusion_nft": ["algorithm.name=diffusion_nft", "algorithm.old_every=1"],
    "flow_grpo": [
        "algorithm.name=flow_grpo",
        "rollout.sampler=sde",
        "rollout.keep_latents=true",
    ],
    "diffusion_dpo": ["algorithm.name=diffusion_dpo"],
}
# FlowGRPO's first-step log-prob, recomputed by the actor before its update, against the one
# the rollout recorded (fused serving layout, merged LoRA) in fp32: sums over the latent's
# 10^2-10^3 entries, so a few 1e-5 per entry at most
LOGP_TOL = 1e-2


def test_every_registered_diffusers_family_is_covered() -> None:
    """A new family module joins the registry by itself; its RL smoke test is a row above."""
    from diffrl.models.registry import FAMILIES as REGISTERED

    diffusion = {n for n, f in REGISTERED.items() if not hasattr(f.family_class, "decode_text")}
    assert sorted(FAMILIES) == sorted(diffusion - {"tiny_dit"})  # AR families: their own tests


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_dir(request, tmp_path_factory):
    module_name, preset, pipeline, _ = FAMILIES[request.param]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        pytest.skip(f"family {request.param} not available: {e}")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param) / "pipe"
    save_pipeline_dir(path, module.tiny_components(preset), pipeline)
    return request.param, path


def two_steps(family: str, path, out, *extra: str):
    """Two RL steps of ``family``'s tiny directory at ``path``; ``extra`` overrides win."""
    return load_config(
        None,
        [
            f"model.family={family}",
            f"model.path={path}",
            *FAMILIES[family][3],
            "data.task=prompts",
            "data.prompts_per_step=2",
            "data.eval_prompts=2",
            "data.eval_samples_per_prompt=1",
            "rollout.group_size=4",
            "rollout.num_steps=3",
            "rollout.eval_num_steps=2",
            "reward.scorers=[{name: jpeg_incompressibility}]",
            "actor.lr=1e-2",
            "run.steps=2",
            "run.tensorboard=false",
            f"run.out_dir={out}",
            *extra,
        ],
    )


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_two_rl_steps(tiny_dir, algorithm, tmp_path):
    family, path = tiny_dir
    cfg = two_steps(
        family, path, tmp_path, "run.eval_every=2", "run.name=run", *ALGORITHMS[algorithm]
    )
    root = asyncio.run(train(cfg))
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:  # non-finite values are written as null, so None fails here too
        numbers = {k: v for k, v in row.items() if k.startswith(("actor/", "reward/"))}
        assert all(v is not None and math.isfinite(v) for v in numbers.values()), row
        assert row["actor/grad_norm"] > 0  # the adapter received gradient
    if algorithm == "flow_grpo":
        assert rows[1]["grpo/logp_diff_max"] < LOGP_TOL
    # the trained adapter moved away from its init (peft inits B at 0)
    from safetensors.torch import load_file

    ckpt = sorted((root / "checkpoints").glob("step_*"))[-1]
    adapters = load_file(str(ckpt / "adapters.safetensors"))
    b = [t for k, t in adapters.items() if ".lora_B.default." in k]
    assert b and any(t.abs().sum() > 0 for t in b)
    assert json.loads((ckpt / "controller.json").read_text())["step"] == 2


@pytest.mark.parametrize("fault", ["rollout_logprobs", "rollout_left_on_base"])
def test_injected_faults_stop_the_first_step(tiny_dir, fault, tmp_path):
    """On every family: rollout log-probs off by 0.01 stop FlowGRPO's first step before its
    update (FirstStepGap), and a rollout whose merge does nothing stops the run at the sync
    after update 1 (the receipt: still on base weights)."""
    from diffrl.algorithms.flow_grpo import FirstStepGap
    from diffrl.build import build
    from diffrl.controller.sync import train_sync
    from diffrl.sync.weights import SyncError

    family, path = tiny_dir
    cfg = two_steps(family, path, tmp_path, *ALGORITHMS["flow_grpo"])
    parts = build(cfg)
    if fault == "rollout_logprobs":
        sample = parts.rollout._sample

        def perturbed(*args, **kw):
            x0, latents, log_probs, versions = sample(*args, **kw)
            return x0, latents, log_probs + 0.01, versions

        parts.rollout._sample = perturbed
        error, match = FirstStepGap, r"differs from the rollout's by 0\.01"
    else:
        parts.rollout.target.apply = no_op_apply
        error, match = SyncError, "after update v1: .* still on its base weights"

    async def run():
        try:
            await train_sync(cfg, parts)
        finally:
            await parts.aclose()

    with pytest.raises(error, match=match):
        asyncio.run(run())
    assert parts.actor.version == (0 if fault == "rollout_logprobs" else 1)
