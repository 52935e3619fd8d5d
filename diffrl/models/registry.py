"""Model families: how to build one, load its weights from a local path, and which modules
LoRA targets. The built-in base model ships inside the package (no downloads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffrl.errors import ConfigError, check, check_choice
from diffrl.models.convention import CONVENTIONS, VelocityModel
from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS, TinyDiT, TinyDiTConfig

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUILTIN = {"builtin:shapes_dit": ASSETS / "shapes_dit.safetensors"}


@dataclass(frozen=True)
class ModelConfig:
    family: str = "tiny_dit"
    # a local .safetensors path, or "builtin:shapes_dit" (ships with the package)
    checkpoint: str = "builtin:shapes_dit"
    convention: str = ""  # "" = the family's native one; else one of CONVENTIONS
    dtype: str = "float32"  # float32 | bfloat16
    probe: bool = True  # check the time convention on task data at start-up

    def validate(self) -> None:
        check_choice("family", self.family, FAMILIES)
        check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        check(
            self.convention in ("", *CONVENTIONS),
            "convention",
            self.convention,
            f"must be empty or one of {sorted(CONVENTIONS)}",
        )
        check(
            bool(self.checkpoint),
            "checkpoint",
            self.checkpoint,
            f"a local .safetensors path or one of {sorted(BUILTIN)}",
        )


@dataclass(frozen=True)
class Family:
    native_convention: str
    lora_targets: tuple[str, ...]


FAMILIES = {"tiny_dit": Family("sigma", TINY_DIT_LORA_TARGETS)}


def resolve_checkpoint(spec: str) -> Path:
    path = BUILTIN.get(spec, Path(spec))
    if not path.is_file():
        hint = " (run `diffrl pretrain` to create it)" if spec in BUILTIN else ""
        raise ConfigError(f"model checkpoint {spec!r} not found at {path}{hint}")
    return path


def read_metadata(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> VelocityModel:
    """Build the family's network from the checkpoint's recorded architecture and load it."""
    path = resolve_checkpoint(cfg.checkpoint)
    meta = read_metadata(path)
    if "arch" not in meta:
        raise ConfigError(f"{path} has no 'arch' metadata; was it written by diffrl?")
    net = TinyDiT(TinyDiTConfig(**json.loads(meta["arch"])))
    state = load_file(str(path))
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    convention = cfg.convention or FAMILIES[cfg.family].native_convention
    model = VelocityModel(net, convention)
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))


def save_model(model: VelocityModel, path: Path, extra: dict[str, str] | None = None) -> None:
    net = model.net
    meta = {
        "arch": json.dumps(net.cfg.to_dict()),
        "family": "tiny_dit",
        "convention": model.convention.name,
        **(extra or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(state, str(path), metadata=meta)


def lora_targets(family: str) -> tuple[str, ...]:
    return FAMILIES[family].lora_targets
