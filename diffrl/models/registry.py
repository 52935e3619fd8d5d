"""Model families by name: one dict of records, ``FAMILIES``, built from the family modules
(each exports one ``FAMILY``, a ``FamilySpec``), and how a run's ``model.*`` config picks one.
The family modules import diffusers only inside their functions, so the registry costs no
diffusers when a run uses the built-in tiny DiT.

A model loads in one of three ways: a local diffusers directory (``model.path``), a preset
built with random weights (``model.preset``: real size for benchmarks, ``*-tiny`` for CPU
tests), or, for the tiny DiT, a diffrl ``.safetensors`` checkpoint (``model.checkpoint``).
Shipped weights (``builtin:<name>``) are listed by the family that reads them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

from diffrl.errors import ConfigError, check, check_choice
from diffrl.extras import install_hint
from diffrl.models import families as _families_pkg
from diffrl.models.attention import CHOICES as ATTENTION_CHOICES
from diffrl.models.attention import setup_attention
from diffrl.models.convention import CONVENTIONS
from diffrl.models.family import Builtin, FamilyModel, FamilySpec


def _discover() -> dict[str, FamilySpec]:
    """Every public module of ``models/families/`` is one family and exports ``FAMILY``
    (modules named ``_*`` are shared helpers), so adding a family touches its own module only."""
    found: dict[str, FamilySpec] = {}
    for info in sorted(pkgutil.iter_modules(_families_pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_families_pkg.__name__}.{info.name}")
        spec = getattr(module, "FAMILY", None)
        if not isinstance(spec, FamilySpec):
            raise TypeError(
                f"{module.__name__} is a family module but exports no FAMILY record "
                "(a FamilySpec); name shared helpers with a leading underscore"
            )
        if spec.name in found:
            raise TypeError(f"two family modules declare the family name {spec.name!r}")
        found[spec.name] = spec
    return found


FAMILIES: dict[str, FamilySpec] = _discover()
# derived views of the records: preset -> family, builtin:<name> -> shipped file
PRESET_FAMILY: dict[str, str] = {p: f.name for f in FAMILIES.values() for p in f.presets}
BUILTINS: dict[str, Builtin] = {k: b for f in FAMILIES.values() for k, b in f.builtins.items()}


@dataclass(frozen=True)
class ModelConfig:
    family: str = "tiny_dit"  # one of FAMILIES; a preset sets it
    # tiny_dit only: a diffrl .safetensors checkpoint, or "builtin:shapes_dit" (ships inside)
    checkpoint: str = "builtin:shapes_dit"
    path: str = ""  # a local diffusers directory (the pipeline layout: model_index.json, ...)
    preset: str = ""  # random weights: real size (sd35-medium, ...) or tiny (sd35-tiny, ...)
    convention: str = ""  # "" = the family's native one; else one of CONVENTIONS
    dtype: str = "float32"  # float32 | bfloat16
    resolution: int = 0  # image side in pixels; 0 = the family's (or preset's) default
    # non-square frames (families that render them: minimax_h3): both, or neither (0 = square
    # frames of model.resolution)
    height: int = 0
    width: int = 0
    frames: int = 0  # video families: frames per clip; 0 = the family's default
    max_text_len: int = 0  # text tokens per tokenizer; 0 = the family's default
    # diffusers families: a .safetensors of the model's weights (transformer and frozen
    # encoders, as `diffrl pretrain` writes them) loaded over model.path / model.preset, or
    # "builtin:shapes_sd3" (the ShapesBench base on the sd3-shapes preset, shipped inside)
    weights: str = ""
    # attention kernels (models/attention.py): sdpa (PyTorch picks per call) | math | flash |
    # efficient | cudnn (SDPA's own) | flex | flash3 | flash4 | auto (per device); any but sdpa
    # is checked fwd+bwd against SDPA math at load and logged with the kernels that ran
    attention: str = "sdpa"

    def validate(self) -> None:
        check_choice("family", self.family, FAMILIES)
        check_choice("attention", self.attention, ATTENTION_CHOICES)
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
        for key in ("resolution", "height", "width", "frames", "max_text_len"):
            check(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0")
        check(
            (self.height == 0) == (self.width == 0),
            "height",
            self.height,
            f"give model.height and model.width together (width is {self.width}); neither = "
            "square frames of model.resolution",
        )

    @property
    def resolved_family(self) -> str:
        return PRESET_FAMILY.get(self.preset, self.family)


# what a tiny preset brings with it: the model's source and geometry. A recipe's values of these
# keys were written for the recipe's real model, not for a CPU-sized stand-in
PRESET_OWNS = ("path", "weights", "resolution", "height", "width", "frames", "max_text_len")


def preset_takes_over(recipe: DictConfig, cli: DictConfig) -> DictConfig:
    """The precedence of the model's source and geometry (``PRESET_OWNS``), highest first:

    1. a key given on the command line (``model.resolution=64``);
    2. a tiny preset's own value (``*-tiny``, the CPU-test presets), when the command line picks
       one other than the recipe's: the recipe's keys are dropped, so 0 (the preset's default)
       holds. ``diffrl train recipes/sd35_nft.yaml model.preset=sd35-tiny`` samples at the tiny
       model's resolution, not the recipe's 512;
    3. the recipe's value. A real-size preset (``sd35-medium``) stands for the model the recipe
       was written for, so it keeps the recipe's geometry (``diffrl plan`` at the recipe's 512).

    Returns ``recipe`` with those keys removed where rule 2 applies (``cli`` is merged over it
    afterwards)."""
    preset = OmegaConf.select(cli, "model.preset", default=None)
    model = recipe.get("model") if isinstance(recipe, DictConfig) else None
    if not isinstance(preset, str) or not preset.endswith("-tiny"):
        return recipe
    if not isinstance(model, DictConfig) or model.get("preset") == preset:
        return recipe
    for key in PRESET_OWNS:
        if key in model:
            del model[key]
    return recipe


def family(name: str) -> FamilySpec:
    """The record of model family ``name``."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def load_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> FamilyModel:
    """The run's model, in diffrl's canonical convention, on ``device`` in ``cfg.dtype``."""
    spec = family(cfg.resolved_family)
    try:
        model = spec.load(cfg, torch.device(device))
    except ModuleNotFoundError as e:
        hint = install_hint(e)
        if hint is not None:
            raise ConfigError(f"model family {spec.name!r} needs {hint}") from None
        raise
    if cfg.weights:
        load_weights(model, cfg.weights)
    model = model.to(device=device, dtype=getattr(torch, cfg.dtype))
    setup_attention(model, cfg.attention)
    return model


def builtin_path(spec: str) -> Path:
    """Where the shipped file ``builtin:<name>`` lives (it may not be written yet)."""
    if spec not in BUILTINS:
        raise ConfigError(f"{spec!r} is not a shipped file; shipped: {sorted(BUILTINS)}")
    return BUILTINS[spec].path


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
    builtin = BUILTINS.get(spec)
    path = builtin.path if builtin else Path(spec)
    if not path.is_file():
        hint = f" (run `{builtin.command}` to create it)" if builtin else ""
        raise ConfigError(f"model.weights {spec!r}: no file at {path}{hint}")
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors' own error type, or an OSError: any unreadable file
        raise ConfigError(
            f"config key 'model.weights' = {spec!r}: not a .safetensors file of weights "
            f"({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
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
    return family(cfg.resolved_family).lora_targets
