"""Tiny diffusers pipeline directories, written once per session with ``save_pipeline_dir`` so
the families load them through the same ``from_pretrained`` path users' directories take, and
the LoRA-sync check every family's serving layout must pass (contract 2)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

from diffrl.models.families import flux, sd3  # noqa: E402
from diffrl.models.families._diffusers import init_weights, save_pipeline_dir  # noqa: E402
from diffrl.sync import layouts  # noqa: E402
from diffrl.sync.weights import BasePrints, LoraDelta, MergedLoraTarget, WeightUpdate  # noqa: E402

BF16_REL_TOL = 2e-2  # bf16 rounds the merged W + delta; LoRA's separate x @ A @ B does not


def _saved(tmp_path_factory, module, preset: str):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        parts = module.tiny_components(preset)
    return save_pipeline_dir(tmp_path_factory.mktemp(preset), parts, module.PIPELINE)


@pytest.fixture(scope="session")
def sd3_tiny_dir(tmp_path_factory):
    return _saved(tmp_path_factory, sd3, "sd35-tiny")


@pytest.fixture(scope="session")
def sd3_shapes_dir(tmp_path_factory):
    return _saved(tmp_path_factory, sd3, "sd3-shapes")


@pytest.fixture(scope="session")
def flux_tiny_dir(tmp_path_factory):
    return _saved(tmp_path_factory, flux, "flux1-tiny")


def sample_inputs(model, texts=("a red circle on the left", "two blue squares")):
    g = torch.Generator().manual_seed(1)
    x = torch.randn((len(texts), *model.family.latent_shape()), generator=g)
    sigma = torch.linspace(0.2, 0.9, len(texts))
    return x, sigma, model.family.tokenize(list(texts)).input_ids


def sync_errors(base, seed: int = 0) -> tuple[float, float, float]:
    """Train-side LoRA (random nonzero B) on a copy of ``base``; the rollout copy laid out by
    the family's ``serving_layout`` and synced through ``MergedLoraTarget``. Returns the fp32
    and bf16 relative errors (norm of the difference over the norm of the actor's output) and
    how much the update moved the output (relative, the same way)."""
    base = copy.deepcopy(base)
    init_weights(base.net.transformer, std=0.1)  # gates big enough for LoRA to show
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(base.family.lora_targets))
    actor = get_peft_model(copy.deepcopy(base), lora)
    g = torch.Generator().manual_seed(seed)
    layers = {
        n.removeprefix("base_model.model."): m
        for n, m in actor.named_modules()
        if isinstance(m, LoraLayer)
    }
    with torch.no_grad():
        for layer in layers.values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.02)
    deltas = {  # as ActorEngine.export_weights
        name: LoraDelta(
            a=layer.lora_A["default"].weight.detach().float().clone(),
            b=layer.lora_B["default"].weight.detach().float().clone(),
            scale=float(layer.scaling["default"]),
        )
        for name, layer in layers.items()
    }
    rollout = copy.deepcopy(base)
    slot_map = base.family.serving_layout(rollout)
    layouts.check_targets(rollout, slot_map, layers)
    prints = BasePrints.of({n: layer.get_base_layer().weight for n, layer in layers.items()})
    MergedLoraTarget(rollout, list(layers), slot_map).apply(
        WeightUpdate.build(1, "default", deltas, prints)  # as the actor sends it
    )
    x, sigma, ids = sample_inputs(base)
    with torch.no_grad():
        want, got, before = actor(x, sigma, ids), rollout(x, sigma, ids), base(x, sigma, ids)
        err32 = float((got - want).norm() / want.norm())
        moved = float((want - before).norm() / before.norm())
        actor.to(torch.bfloat16), rollout.to(torch.bfloat16)
        want16 = actor(x.bfloat16(), sigma, ids).float()
        got16 = rollout(x.bfloat16(), sigma, ids).float()
    return err32, float((got16 - want16).norm() / want16.norm()), moved


@pytest.fixture(scope="session")
def family_sync_errors():
    """``sync_errors`` as a fixture, for the families' test files."""
    return sync_errors


@pytest.fixture(scope="session")
def family_inputs():
    """``sample_inputs`` as a fixture: (x, sigma, input_ids) for a model."""
    return sample_inputs
