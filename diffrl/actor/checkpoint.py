"""Checkpoints: adapters as safetensors, optimizer / RNG / counters via torch.save of plain
tensors and numbers (loaded back with ``weights_only=True``), plus the controller's JSON state.

Each checkpoint is written to a temporary directory and renamed into place, and ``latest`` is
updated only afterwards, so a kill at any moment leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_checkpoint(
    root: Path, step: int, adapters: dict, actor_state: dict, controller_state: dict, keep: int = 2
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in adapters.items()}, str(tmp / "adapters.safetensors"))
    torch.save(actor_state, tmp / "actor.pt")
    (tmp / "controller.json").write_text(json.dumps(controller_state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    # keep the newest by write time (not by step number: a restarted run may write lower steps)
    others = sorted((p for p in root.glob("step_*") if p != final), key=lambda p: p.stat().st_mtime)
    for old in others[: max(0, len(others) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "controller.json").exists() else None


def load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    adapters = load_file(str(path / "adapters.safetensors"))
    actor_state = torch.load(path / "actor.pt", weights_only=True)
    controller_state = json.loads((path / "controller.json").read_text())
    return adapters, actor_state, controller_state
