"""`diffrl export` writes the trained adapter in the format diffusers loads: a transformer loaded
from the same directory, with `load_lora_adapter(DIR)`, gives diffrl's merged model's output."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.models.registry import ModelConfig, load_model
from diffrl.sync.weights import BasePrints, LoraDelta, MergedLoraTarget, WeightUpdate

pytest.importorskip("diffusers")


def test_export_loads_into_diffusers_and_matches(tmp_path):
    from safetensors.torch import load_file

    from diffrl.actor.checkpoint import load_latest
    from diffrl.models.families import sd3
    from diffrl.models.families._diffusers import save_pipeline_dir

    torch.manual_seed(0)
    parts = sd3.tiny_components("sd35-tiny")
    with torch.no_grad():  # at init std 0.02 the tiny blocks barely move the output (AdaLN
        for w in parts["transformer"].parameters():  # gates ~0), so a LoRA's effect would hide
            if w.ndim >= 2:
                w.normal_(0.0, 0.15)
    pipe = save_pipeline_dir(tmp_path / "pipe", parts, sd3.PIPELINE)
    cfg = load_config(
        None,
        [
            "model.family=sd3",
            f"model.path={pipe}",
            "data.task=prompts",
            "data.prompts_per_step=2",
            "data.eval_prompts=1",
            "data.eval_samples_per_prompt=1",
            "rollout.group_size=4",
            "rollout.num_steps=2",
            "rollout.eval_num_steps=1",
            "reward.scorers=[{name: jpeg_incompressibility}]",
            "actor.lr=5e-2",
            "actor.lora.rank=4",
            "actor.lora.alpha=8",  # scale 2: the export must carry it
            "algorithm.old_every=1",
            "run.steps=2",
            "run.tensorboard=false",
            f"run.out_dir={tmp_path}",
            "run.name=run",
        ],
    )
    root = asyncio.run(train(cfg))
    out = tmp_path / "lora"
    assert main(["export", str(root), "--out", str(out)]) == 0
    exported = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert exported and all(k.startswith("transformer.") for k in exported)

    # diffrl's side: the checkpoint's adapter merged into the model through weight sync
    ckpt = load_latest(root / "checkpoints")
    key = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.default\.weight$")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in ckpt.adapters.items():
        if m := key.match(k):
            factors.setdefault(m[1], {})[m[2]] = t.float()
    deltas = {n: LoraDelta(f["A"], f["B"], 8 / 4) for n, f in factors.items()}
    assert any(d.b.abs().sum() > 0 for d in deltas.values())  # trained, not the zero init
    merged = load_model(ModelConfig(family="sd3", path=str(pipe)))
    prints = BasePrints.of_model(merged, sorted(deltas))  # the base before anything is merged
    target = MergedLoraTarget(merged, sorted(deltas), base_prints=prints)
    target.apply(WeightUpdate.build(1, "default", deltas))

    # diffusers' side: the same directory, the exported file through load_lora_adapter
    reference = load_model(ModelConfig(family="sd3", path=str(pipe)))
    reference.net.transformer.load_lora_adapter(
        str(out), prefix="transformer", weight_name="pytorch_lora_weights.safetensors"
    )

    fam = merged.family
    g = torch.Generator().manual_seed(1)
    x = torch.randn((2, *fam.latent_shape()), generator=g)
    sigma = torch.tensor([0.3, 0.8])
    ids = fam.tokenize(["a red bicycle", "an owl at night"]).input_ids
    with torch.no_grad():
        base = load_model(ModelConfig(family="sd3", path=str(pipe)))(x, sigma, ids)
        ours, theirs = merged(x, sigma, ids), reference(x, sigma, ids)
    assert (ours - base).abs().max() > 1e-4  # the adapter changes the output
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)
