"""Checkpoints that a kill, a torn write or a flipped bit cannot turn into lost work.

A checkpoint is a directory ``step_XXXXXX`` holding ``adapters.safetensors``, ``actor.pt``
(optimizer / RNG / counters: plain tensors and numbers, loaded back with ``weights_only=True``),
``controller.json`` and ``manifest.json``: the size and sha256 of each of the three, written last.

Writing: the files are written and fsynced in ``.tmp_step_XXXXXX``, the directory is fsynced and
renamed into place, then the parent is fsynced; a kill at any moment leaves every earlier
checkpoint whole. Re-saving a step renames the old copy to ``.old_step_XXXXXX`` before the new
one goes in, and deletes it only afterwards: until then it still counts as a checkpoint. Weights
that are not finite are never written (the previous checkpoint stays the newest).

Reading: every file is checked against the manifest before it is parsed, and what it holds is
checked after: a manifest proves the bytes are the ones written, not that the writer was sound or
that they fit this model. The step is a non-negative int that matches the directory's name, the
wall clock a finite number, every tensor finite, and (given the model's adapters, ``expect``)
each adapter tensor of the model's name, shape and dtype. Resuming takes the newest checkpoint
that verifies, scanning the directories rather than trusting ``latest`` (kept
as a pointer for people and scripts), and logs each newer one it skipped and why. "Newest" is
the most recently written (the manifest's ``saved_at``), not the highest step: a run started
over with ``run.resume=false`` writes low steps after an earlier run's high ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor

from diffrl.diskio import disk_errors
from diffrl.errors import CheckpointError

log = logging.getLogger(__name__)
FILES = ("adapters.safetensors", "actor.pt", "controller.json")
MANIFEST = "manifest.json"
_NAME = re.compile(r"(?:\.old_)?step_(\d+)")  # step_000012, or one being re-saved


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    adapters: dict[str, Tensor]
    actor_state: dict
    controller_state: dict  # {"step": int, "wall_s": float}

    @property
    def step(self) -> int:
        return int(self.controller_state["step"])

    @property
    def wall_s(self) -> float:
        return float(self.controller_state["wall_s"])


def save_checkpoint(
    root: Path, step: int, adapters: dict, actor_state: dict, controller_state: dict, keep: int = 2
) -> Path | None:
    """Write checkpoint ``step`` under ``root`` and keep the ``keep`` newest. Nothing is written
    (a warning, and None) when the adapters are not finite, or when the actor's last update was
    NaN/inf (``actor_state["nonfinite"]`` > 0): weights that stopped training are suspect, and
    saving them would rotate the last good checkpoint away."""
    bad = nonfinite_tensors(adapters)
    why = f"{len(bad)} adapter tensors are not finite (e.g. {bad[0]})" if bad else ""
    if not bad and actor_state.get("nonfinite"):
        why = f"the last {actor_state['nonfinite']} updates were NaN/inf and skipped"
    if why:
        log.warning(
            "step %d: %s: checkpoint NOT written; the previous one stays the newest", step, why
        )
        return None
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final, tmp, old = root / name, root / f".tmp_{name}", root / f".old_{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    blobs = {
        "adapters.safetensors": save_safetensors({k: v.contiguous() for k, v in adapters.items()}),
        "actor.pt": _torch_bytes(actor_state),
        "controller.json": json.dumps(controller_state, indent=1, allow_nan=False).encode(),
    }
    manifest = {
        "step": step,
        "saved_at": time.time(),
        "files": {n: {"bytes": len(b), "sha256": _sha256(b)} for n, b in blobs.items()},
    }
    blobs[MANIFEST] = json.dumps(manifest, indent=1).encode()  # written last: the files are whole
    need = sum(len(b) for b in blobs.values())
    moved = False
    try:
        with disk_errors(final, need):  # a full disk: one line naming the step and its size
            tmp.mkdir()
            for n, b in blobs.items():
                _write(tmp / n, b)
            _fsync_dir(tmp)
            if final.exists():  # re-saving a step: the old copy stays one until the new is in
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                moved = True
            os.replace(tmp, final)
    except BaseException:
        # a failed save leaves no partial directory to keep the disk full, and a re-saved
        # step's old copy back in place
        shutil.rmtree(tmp, ignore_errors=True)
        if moved and not final.exists():
            os.replace(old, final)
        raise
    _fsync_dir(root)
    try:
        with disk_errors(root / "latest", len(name)):
            _write(root / ".latest.tmp", name.encode())
            os.replace(root / ".latest.tmp", root / "latest")
    finally:
        (root / ".latest.tmp").unlink(missing_ok=True)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    _prune(root, final, keep)
    return final


def load_checkpoint(
    path: Path, expect: Mapping[str, Tensor] | None = None
) -> tuple[dict, dict, dict]:
    """(adapters, actor_state, controller_state) of one checkpoint, verified against its
    manifest and then checked for sense (``check_contents``; ``expect``: the model's own adapter
    tensors, whose names, shapes and dtypes the saved ones must have); ``CheckpointError``
    names the first thing wrong."""
    blobs = _verified_files(path)
    parsers = {
        "adapters.safetensors": load_safetensors,
        "actor.pt": lambda b: torch.load(io.BytesIO(b), weights_only=True),
        "controller.json": json.loads,
    }
    out = {}
    for name, parse in parsers.items():
        try:  # bytes that match the manifest yet do not parse: an incompatible writer
            out[name] = parse(blobs[name])
        except Exception as e:
            raise CheckpointError(f"{path.name}: {name} does not load: {e}") from e
    adapters, actor_state, state = (
        out["adapters.safetensors"],
        out["actor.pt"],
        out["controller.json"],
    )
    check_contents(path, adapters, actor_state, state, expect)
    return adapters, actor_state, state


def load_latest(root: Path, expect: Mapping[str, Tensor] | None = None) -> Checkpoint | None:
    """The newest checkpoint under ``root`` that verifies (its files against the manifest, its
    contents by ``check_contents``, against ``expect`` when given), logging each newer one
    skipped and why; None when ``root`` holds no checkpoint directory at all. Raises
    ``CheckpointError`` when there are checkpoint directories but none verifies: starting over
    from step 0 would overwrite the run's metrics and, by rotation, its checkpoints."""
    dirs = _newest_first(_checkpoint_dirs(root))
    if not dirs:
        return None
    problems = []
    for path in dirs:
        try:
            ckpt = Checkpoint(path, *load_checkpoint(path, expect))
        except CheckpointError as e:
            log.warning("skipping checkpoint %s", e)
            problems.append(str(e))
            continue
        if problems:
            log.warning("resuming from %s, the newest checkpoint that verifies", path)
        else:
            _check_pointer(root, path)
        return ckpt
    raise CheckpointError(
        f"none of the {len(dirs)} checkpoints under {root} verifies ({'; '.join(problems)}); "
        "repair or restore one, or move the directory away to start the run over"
    )


def latest_checkpoint(root: Path) -> Path | None:
    """Path of the checkpoint ``load_latest`` would resume from."""
    ckpt = load_latest(root)
    return None if ckpt is None else ckpt.path


def nonfinite_tensors(tensors: dict[str, Tensor]) -> list[str]:
    return [k for k, v in tensors.items() if v.is_floating_point() and not v.isfinite().all()]


def check_contents(
    path: Path,
    adapters: dict,
    actor_state: object,
    state: object,
    expect: Mapping[str, Tensor] | None = None,
) -> None:
    """What a checkpoint whose bytes match its manifest must also hold before a run trusts it
    (``CheckpointError`` names the first thing wrong; resume then falls back to the older one,
    as for a torn file): a controller state whose step is a non-negative int equal to the
    directory's (``step_000005`` holds step 5: a step of -5 would truncate metrics.jsonl to
    nothing) and whose wall clock is a finite number >= 0; an actor state of plain counters, an
    RNG state and an optimizer state whose tensors are finite; finite adapters; and, given the
    model's own adapter tensors ``expect``, the same names, shapes and dtypes."""
    name = path.name
    if not isinstance(state, dict) or not {"step", "wall_s"} <= state.keys():
        raise CheckpointError(f"{name}: controller.json lacks 'step' / 'wall_s': {state!r}")
    step, wall = state["step"], state["wall_s"]
    dir_step = _NAME.fullmatch(name)
    if type(step) is not int or step < 0:  # bool is an int subclass, and no step
        raise CheckpointError(f"{name}: controller.json step {step!r} is not an int >= 0")
    if dir_step is not None and int(dir_step.group(1)) != step:
        raise CheckpointError(
            f"{name}: controller.json says step {step}, its directory {int(dir_step.group(1))}"
        )
    if isinstance(wall, bool) or not isinstance(wall, int | float) or not 0 <= wall < math.inf:
        raise CheckpointError(f"{name}: controller.json wall_s {wall!r} is not a number >= 0")
    _check_actor_state(name, actor_state)
    bad = nonfinite_tensors(adapters)
    if bad:
        raise CheckpointError(f"{name}: {len(bad)} adapter tensors are not finite (e.g. {bad[0]})")
    if expect is not None:
        check_adapters_fit(name, adapters, expect)


def _check_actor_state(name: str, actor_state: object) -> None:
    """actor.pt as ``ActorEngine.state_dict`` writes it: counters >= 0, a byte RNG state, and
    an optimizer state whose tensors are all finite (NaN moments would poison every update)."""
    if not isinstance(actor_state, dict):
        raise CheckpointError(f"{name}: actor.pt holds a {type(actor_state).__name__}, not a dict")
    for key in ("version", "nonfinite"):
        value = actor_state.get(key, 0 if key == "nonfinite" else None)  # resume resets it
        if type(value) is not int or value < 0:
            raise CheckpointError(f"{name}: actor.pt {key} {value!r} is not an int >= 0")
    gen = actor_state.get("gen")
    if not isinstance(gen, Tensor) or gen.dtype != torch.uint8:
        raise CheckpointError(f"{name}: actor.pt gen is not an RNG state (a uint8 tensor)")
    optimizer = actor_state.get("optimizer")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        raise CheckpointError(f"{name}: actor.pt optimizer is not an optimizer state dict")
    for index, moments in optimizer["state"].items():
        if not isinstance(moments, dict):
            raise CheckpointError(f"{name}: actor.pt optimizer state {index!r} is not a dict")
        for key, t in moments.items():
            if isinstance(t, Tensor) and t.is_floating_point() and not t.isfinite().all():
                raise CheckpointError(
                    f"{name}: actor.pt optimizer state {index}.{key} is not finite"
                )


def check_adapters_fit(name: str, adapters: dict, expect: Mapping[str, Tensor]) -> None:
    """The saved adapter tensors are the model's: every name, shape and dtype, as
    ``ActorEngine.load_state`` will copy them. The one difference it allows is the ``ema``
    adapter, whole or absent (``actor.ema_decay`` switched off, or on, since the save)."""
    saved_ema = any(".ema." in n for n in adapters)
    model_ema = any(".ema." in n for n in expect)
    lacking = sorted(
        n
        for n in expect
        if n not in adapters and not (model_ema and not saved_ema and ".ema." in n)
    )
    extra = sorted(
        n
        for n in adapters
        if n not in expect and not (saved_ema and not model_ema and ".ema." in n)
    )
    hint = "(saved under other actor.lora settings, or for another model?)"
    if lacking:
        raise CheckpointError(f"{name}: adapters lack the model's {lacking[:3]} {hint}")
    if extra:
        raise CheckpointError(f"{name}: adapters hold {extra[:3]}, which the model lacks {hint}")
    for n, t in adapters.items():
        want = expect.get(n)
        if want is None:
            continue
        if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            raise CheckpointError(
                f"{name}: adapter {n} is {tuple(t.shape)} {t.dtype}, the model's is "
                f"{tuple(want.shape)} {want.dtype} {hint}"
            )


# --- the pieces ----------------------------------------------------------------------------------


def _verified_files(path: Path) -> dict[str, bytes]:
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
        files = {
            n: (int(manifest["files"][n]["bytes"]), manifest["files"][n]["sha256"]) for n in FILES
        }
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: {MANIFEST} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path.name}: {MANIFEST} is unreadable ({e!r})") from None
    blobs = {}
    for name, (size, digest) in files.items():
        try:
            data = (path / name).read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{path.name}: {name} is missing") from None
        except OSError as e:  # e.g. EIO from a bad sector
            raise CheckpointError(f"{path.name}: {name} cannot be read ({e})") from None
        if len(data) != size:
            raise CheckpointError(
                f"{path.name}: {name} has {len(data)} bytes, the manifest says {size} (truncated?)"
            )
        if _sha256(data) != digest:
            raise CheckpointError(f"{path.name}: {name} does not match its sha256 (corrupted)")
        blobs[name] = data
    return blobs


def _checkpoint_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and _NAME.fullmatch(p.name)]


def _newest_first(dirs: list[Path]) -> list[Path]:
    def written(p: Path) -> tuple[float, int, bool]:
        try:
            saved_at = float(json.loads((p / MANIFEST).read_bytes())["saved_at"])
        except (OSError, ValueError, KeyError, TypeError):
            saved_at = p.stat().st_mtime  # no readable manifest: it will be skipped anyway
        name = _NAME.fullmatch(p.name)
        assert name is not None, "_checkpoint_dirs lists only names _NAME matches"
        return saved_at, int(name.group(1)), not p.name.startswith(".")

    return sorted(dirs, key=written, reverse=True)


def _prune(root: Path, final: Path, keep: int) -> None:
    """Keep ``final`` and the ``keep - 1`` newest other checkpoints whose files are all there
    at their recorded sizes (a cheap check: hashes are verified on load); delete the rest and
    any temp directory a killed save left."""
    for old in root.glob(".old_step_*"):  # a kill between a re-save's renames stranded it
        if not (root / old.name.removeprefix(".old_")).exists():
            os.replace(old, root / old.name.removeprefix(".old_"))
    others = [p for p in _newest_first(_checkpoint_dirs(root)) if p != final]
    kept = [p for p in others if _sizes_match(p)][: max(0, keep - 1)]
    for p in others:
        if p not in kept:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp_step_*"):
        shutil.rmtree(p, ignore_errors=True)


def _sizes_match(path: Path) -> bool:
    try:
        files = json.loads((path / MANIFEST).read_bytes())["files"]
        return all((path / n).stat().st_size == files[n]["bytes"] for n in FILES)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _check_pointer(root: Path, chosen: Path) -> None:
    try:
        pointer = (root / "latest").read_text().strip()
    except OSError:
        pointer = ""
    if pointer != chosen.name:
        log.warning(
            "%s/latest says %r; resuming from %s (the newest checkpoint that verifies)",
            root,
            pointer or "(missing or empty)",
            chosen.name,
        )


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename (or a new file) in ``path`` durable: fsync the directory itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
