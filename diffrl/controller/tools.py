"""What a user does with a finished (or running) run directory: evaluate its newest checkpoint
on the task's held-out split (``diffrl eval RUN_DIR``), and export its adapter in the format
diffusers loads (``diffrl export RUN_DIR --out DIR``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from safetensors.torch import save_file

from diffrl.actor.checkpoint import Checkpoint, load_latest
from diffrl.config import Config, load_config
from diffrl.errors import DiffrlError

if TYPE_CHECKING:
    from diffrl.build import Engines

# peft's parameter names in the actor: base_model.model.net.<module>.lora_{A,B}.<adapter>.weight
LORA_KEY = re.compile(
    r"^base_model\.model\.net\.(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>\w+)\.weight$"
)
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what load_lora_weights looks for


def open_run(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[Config, Checkpoint]:
    """The run's resolved config (``config.yaml``, plus overrides) and its newest checkpoint
    that verifies; a clear error when either is missing."""
    root = Path(run_dir)
    if not (root / "config.yaml").is_file():
        raise DiffrlError(
            f"{root} is not a diffrl run directory (no config.yaml); "
            "pass the directory `diffrl train` printed, e.g. runs/shapes_nft"
        )
    overrides = [*(overrides or []), *_fit_threads(root / "config.yaml", overrides or [])]
    cfg = load_config(root / "config.yaml", overrides)
    ckpt = load_latest(root / "checkpoints")
    if ckpt is None:
        raise DiffrlError(f"{root} has no checkpoint yet (checkpoints/ is empty)")
    return cfg, ckpt


def _fit_threads(saved: Path, overrides: list[str]) -> list[str]:
    """``run.threads`` capped at this machine's cores, unless the overrides set it: a run
    trained on a larger machine is still evaluated and exported here (config validation
    refuses more threads than cores, for a run about to start)."""
    if any(o.startswith("run.threads=") for o in overrides):
        return []
    try:
        threads = int(yaml.safe_load(saved.read_text())["run"]["threads"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return []  # load_config reports what is wrong with the file
    cores = os.cpu_count() or 1
    return [f"run.threads={cores}"] if threads > cores else []


def load_run(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[Engines, Checkpoint]:
    """The run's engines built from its config (probe off: the run already passed it), with
    the actor holding its newest checkpoint's adapters and state; returns (parts, checkpoint)."""
    from diffrl.backends import build_engines

    cfg, ckpt = open_run(run_dir, [*(overrides or []), "probe.mode=off"])
    parts = build_engines(cfg)
    parts.actor.load_state(ckpt.adapters, ckpt.actor_state)
    return parts, ckpt


async def evaluate_run(run_dir: str | Path, overrides: list[str] | None = None) -> dict[str, float]:
    """Held-out metrics of the run's newest checkpoint (the adapter the run evaluates: the EMA
    one when the run keeps an EMA), with the run's own eval settings."""
    from diffrl.controller.step import evaluate_adapter

    parts, ckpt = load_run(run_dir, overrides)
    try:
        result = await evaluate_adapter(parts, parts.actor.eval_adapter)
    finally:
        await parts.aclose()  # scorer clients, remote engines
    return {"step": float(ckpt.step), **result.metrics}


def diffusers_lora(adapters: dict[str, torch.Tensor], adapter: str, scale: float) -> dict:
    """Actor adapter tensors -> diffusers' peft-format LoRA state dict for the transformer:
    ``transformer.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r), with the
    LoRA scale alpha/r folded into B, so the file means the same delta whatever alpha a loader
    assumes (diffusers takes alpha = r when the file does not say)."""
    out = {}
    for key, t in adapters.items():
        m = LORA_KEY.match(key)
        if m is None or m["adapter"] != adapter:
            continue
        module = m["module"]
        value = t.float() * (scale if m["ab"] == "B" else 1.0)
        out[f"{module}.lora_{m['ab']}.weight"] = value.contiguous()
    if not out:
        raise DiffrlError(f"the checkpoint holds no tensors of adapter {adapter!r}")
    return out


def export_run(run_dir: str | Path, out: str | Path, adapter: str = "") -> Path:
    """Write the run's adapter as ``DIR/pytorch_lora_weights.safetensors`` (diffusers'
    ``pipe.load_lora_weights(DIR)`` and ``transformer.load_lora_adapter(DIR)`` read it)."""
    cfg, ckpt = open_run(run_dir)
    adapter = adapter or ("ema" if cfg.actor.ema_decay > 0 else "default")
    state = diffusers_lora(ckpt.adapters, adapter, cfg.actor.lora.alpha / cfg.actor.lora.rank)
    # diffusers families: net.transformer.<...> -> "transformer.<...>", the prefix diffusers
    # filters on; the tiny DiT is no diffusers class, so its keys keep diffrl's own names
    prefix = "net." if cfg.model.resolved_family == "tiny_dit" else ""
    state = {prefix + k: v for k, v in state.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "diffrl_family": cfg.model.resolved_family,
        "diffrl_step": str(ckpt.step),
        "diffrl_adapter": adapter,
        "rank": str(cfg.actor.lora.rank),
        "note": json.dumps("LoRA scale folded into lora_B; load with alpha = rank"),
    }
    path = out / DIFFUSERS_WEIGHT_NAME
    tmp = out / f".{DIFFUSERS_WEIGHT_NAME}.tmp"
    try:
        save_file(state, str(tmp), metadata=meta)
        # safetensors creates its files 0600; an exported LoRA is for sharing, so it gets the
        # mode any new file gets here (0644 under the usual umask 022)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)  # whole or not at all: a reader never sees half a file
    finally:
        tmp.unlink(missing_ok=True)
    return path
