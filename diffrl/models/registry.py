"""Model families by name: which module builds each, which presets exist, and how a run's
``model.*`` config picks one. Family modules are imported lazily, so the diffusers families
cost nothing (and need no diffusers) when a run uses the built-in tiny DiT.

A family module exposes ``load(cfg: ModelConfig, device) -> FamilyModel`` and ``PRESETS``.
A model loads in one of three ways: a local diffusers directory (``model.path``), a preset
built with random weights (``model.preset``: real size for benchmarks, ``*-tiny`` for CPU
tests), or, for the tiny DiT, a diffrl ``.safetensors`` checkpoint (``model.checkpoint``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffrl.errors import ConfigError, check, check_choice
from diffrl.models.convention import CONVENTIONS
from diffrl.models.family import FamilyModel

FAMILY_MODULES = {
    "tiny_dit": "diffrl.models.families.tiny_dit",
    "sd3": "diffrl.models.families.sd3",
    "flux": "diffrl.models.families.flux",
    "qwen_image": "diffrl.models.families.qwen_image",
    "wan": "diffrl.models.families.wan",
    "minimax_h3": "diffrl.models.families.minimax_h3",
    "ltx2": "diffrl.models.families.ltx2",
}

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# model.weights shipped inside the package (written by `diffrl pretrain preset=...`)
BUILTIN_WEIGHTS = {
    "builtin:shapes_sd3": ASSETS / "shapes_sd3.safetensors",
    "builtin:avbench_h3": ASSETS / "avbench_h3.safetensors",  # preset h3-avbench, AVBench base
}
# the command that writes each built-in file
BUILTIN_SOURCE = {
    "builtin:shapes_sd3": "diffrl pretrain preset=sd3-shapes",
    "builtin:avbench_h3": "diffrl pretrain task=avbench",
}

# preset -> family (kept here so a config validates without importing the family's module)
PRESET_FAMILY = {
    "sd35-medium": "sd3",
    "sd35-tiny": "sd3",
    "sd3-shapes": "sd3",
    "flux1-dev": "flux",
    "flux1-tiny": "flux",
    "qwen-image": "qwen_image",
    "qwen-image-tiny": "qwen_image",
    "wan2.1-1.3b": "wan",
    "wan-tiny": "wan",
    "minimax-h3": "minimax_h3",
    "h3-tiny": "minimax_h3",
    "h3-avbench": "minimax_h3",
    "ltx2": "ltx2",
    "ltx2-tiny": "ltx2",
}


@dataclass(frozen=True)
class ModelConfig:
    family: str = "tiny_dit"  # one of FAMILY_MODULES; a preset sets it
    # tiny_dit only: a diffrl .safetensors checkpoint, or "builtin:shapes_dit" (ships inside)
    checkpoint: str = "builtin:shapes_dit"
    path: str = ""  # a local diffusers directory (the pipeline layout: model_index.json, ...)
    preset: str = ""  # random weights: real size (sd35-medium, ...) or tiny (sd35-tiny, ...)
    convention: str = ""  # "" = the family's native one; else one of CONVENTIONS
    dtype: str = "float32"  # float32 | bfloat16
    probe: bool = True  # check the time convention on task data at start-up
    resolution: int = 0  # image side in pixels; 0 = the family's (or preset's) default
    frames: int = 0  # video families: frames per clip; 0 = the family's default
    max_text_len: int = 0  # text tokens per tokenizer; 0 = the family's default
    # diffusers families: a .safetensors of the model's weights (transformer and frozen
    # encoders, as `diffrl pretrain` writes them) loaded over model.path / model.preset, or
    # "builtin:shapes_sd3" (the ShapesBench base on the sd3-shapes preset, shipped inside)
    weights: str = ""

    def validate(self) -> None:
        check_choice("family", self.family, FAMILY_MODULES)
        check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        check(
            self.convention in ("", *CONVENTIONS),
            "convention",
            self.convention,
            f"must be empty or one of {sorted(CONVENTIONS)}",
        )
        if self.preset:
            check_choice("preset", self.preset, PRESET_FAMILY)
            check(
                not self.path,
                "path",
                self.path,
                "give model.path or model.preset, not both",
            )
        for key in ("resolution", "frames", "max_text_len"):
            check(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0")

    @property
    def resolved_family(self) -> str:
        return PRESET_FAMILY.get(self.preset, self.family)


def family_module(name: str):
    if name not in FAMILY_MODULES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(FAMILY_MODULES)}")
    try:
        return importlib.import_module(FAMILY_MODULES[name])
    except ImportError as e:
        raise ConfigError(
            f"model family {name!r} needs a package that is not installed ({e}); "
            "install diffusers and transformers (pip install -e '.[models]')"
        ) from None


def load_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> FamilyModel:
    """The run's model, in diffrl's canonical convention, on ``device`` in ``cfg.dtype``."""
    model = family_module(cfg.resolved_family).load(cfg, torch.device(device))
    if cfg.weights:
        load_weights(model, cfg.weights)
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))


def weights_state(model: FamilyModel) -> dict[str, torch.Tensor]:
    """Every weight of a model, the shared frozen encoders/VAE included (``frozen.<name>.*``),
    as plain fp32 CPU tensors: what ``model.weights`` loads back."""
    state = {f"net.{k}": v for k, v in model.net.state_dict().items()}
    for name, module in frozen_modules(model).items():
        state.update({f"frozen.{name}.{k}": v for k, v in module.state_dict().items()})
    # cloned: tied weights (T5's shared embedding) must not share storage in a safetensors file
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def save_weights(model: FamilyModel, path: Path, meta: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights_state(model), str(path), metadata={"family": model.family.name, **meta})


def load_weights(model: FamilyModel, spec: str) -> None:
    path = BUILTIN_WEIGHTS.get(spec, Path(spec))
    if not path.is_file():
        hint = f" (run `{BUILTIN_SOURCE[spec]}` to create it)" if spec in BUILTIN_SOURCE else ""
        raise ConfigError(f"model.weights {spec!r}: no file at {path}{hint}")
    state = load_file(str(path))
    want = weights_state(model)
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    bad = [k for k in set(want) & set(state) if want[k].shape != state[k].shape]
    if missing or unexpected or bad:
        raise ConfigError(
            f"model.weights {spec!r} does not fit this model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {bad[:3]} (was it written for "
            "another preset?)"
        )
    with torch.no_grad():
        model.net.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("net.")})
        for name, module in frozen_modules(model).items():
            prefix = f"frozen.{name}."
            module.load_state_dict(
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )


def frozen_modules(model: FamilyModel) -> dict[str, torch.nn.Module]:
    """The family's shared frozen modules (text encoders, VAE) by name; {} for the tiny DiT."""
    frozen = getattr(model.net, "frozen", None)
    if frozen is None:
        return {}
    return {k: m for k, m in vars(frozen).items() if isinstance(m, torch.nn.Module)}


def lora_targets(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple(family_module(cfg.resolved_family).LORA_TARGETS)
