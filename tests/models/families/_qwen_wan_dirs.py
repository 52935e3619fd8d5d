"""Helpers for the Qwen-Image and Wan family tests: a tiny pipeline directory per family, and
the actor -> rollout weight sync the engines run, in a few lines.

``synced_pair`` builds what the engines build: the actor's peft LoRA on one copy of the model
(with random B so the delta is not zero), its export as ``ActorEngine.export_weights`` does it
(one ``LoraDelta`` per peft ``LoraLayer``), and the rollout copy re-laid by the family's
``serving_layout`` with the update applied through ``MergedLoraTarget``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

from diffrl.models.families._diffusers import save_pipeline_dir
from diffrl.models.registry import ModelConfig, load_model
from diffrl.sync.layouts import check_targets
from diffrl.sync.weights import BasePrints, LoraDelta, MergedLoraTarget, SyncReport, WeightUpdate

PEFT_PREFIX = "base_model.model."


def tiny_dir(tmp_path_factory, family_module, name: str, pipeline_class: str) -> Path:
    """The family's tiny pipeline directory, its transformer re-drawn at fan-in scale: at the
    plain N(0, 0.02) init a 32-wide block barely moves the output, so LoRA on it would too."""
    torch.manual_seed(0)
    parts = family_module.tiny_components()
    with torch.no_grad():
        for p in parts["transformer"].parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)
    return save_pipeline_dir(tmp_path_factory.mktemp(name) / "pipe", parts, pipeline_class)


def load_dir(family: str, path: Path, dtype: str = "float32", **sizes):
    return load_model(ModelConfig(family=family, path=str(path), dtype=dtype, **sizes))


def export(actor, version: int = 1, adapter: str = "default") -> WeightUpdate:
    """ActorEngine.export_weights, on a bare peft model."""
    layers = {
        n.removeprefix(PEFT_PREFIX): m for n, m in actor.named_modules() if isinstance(m, LoraLayer)
    }
    deltas = {
        name: LoraDelta(
            a=layer.lora_A[adapter].weight.detach().float().cpu().clone(),
            b=layer.lora_B[adapter].weight.detach().float().cpu().clone(),
            scale=float(layer.scaling[adapter]),
        )
        for name, layer in layers.items()
    }
    prints = BasePrints.of({n: layer.get_base_layer().weight for n, layer in layers.items()})
    return WeightUpdate.build(version, adapter, deltas, prints)  # as the actor sends it


def synced_pair(base, targets, rank: int = 4, seed: int = 0, scale: float = 1.0):
    """(actor with a random LoRA, rollout re-laid for serving with the update applied, the
    update, the sync report)."""
    actor = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), lora_dropout=0.0),
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    update = export(actor)
    rollout = copy.deepcopy(base).eval()
    slot_map = rollout.family.serving_layout(rollout)
    shapes = {n: (d.b.shape[0], d.a.shape[1]) for n, d in update.deltas.items()}
    check_targets(rollout, slot_map, update.deltas, shapes)
    report: SyncReport = MergedLoraTarget(rollout, list(update.deltas), slot_map).apply(update)
    return actor, rollout, update, report


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())
