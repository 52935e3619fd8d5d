"""Starting a run in its directory: every check that can refuse first, then every write.

A run that is refused must leave its directory as it found it (issue 41, findings 3, 7, 10,
12). So ``diffrl train`` starts in this order:

1. ``begin_run`` (before the engines are built): lock the directory (``run_lock.py``: a second
   run refuses at once), read the newest checkpoint that verifies and the saved
   ``config.yaml``, say "nothing to do" for a finished run and refuse changed training keys
   (``TRAINING_KEYS``). Reads only.
2. The caller builds the engines (resources) and loads the checkpoint into the actor
   (``step.resume``: a LoRA rank or target change is refused there). Reads only.
3. ``RunStart.open``: the writes. An earlier run over which ``run.resume=false`` starts is moved
   aside to ``<name>.<timestamp>``; ``config.yaml`` is written for a new run and rewritten only
   by a resume that trains further with changed keys, each such change recorded in
   ``config_changes.jsonl``; metrics logged after the checkpoint are dropped, and TensorBoard
   is opened with ``purge_step`` so that the steps a killed run logged past its checkpoint are
   not shown twice.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from diffrl.actor.checkpoint import Checkpoint, load_latest
from diffrl.config import Config, to_yaml
from diffrl.controller import media
from diffrl.controller.run_dir import RunDir, open_run_dir
from diffrl.controller.run_lock import LOCK_NAME, RunLock
from diffrl.errors import DiffrlError

# Keys a resumed run may change without run.allow_changes: how long it runs, what it logs,
# where and how fast its engines run. The steps they produce are the same updates of the same
# objective (up to floating-point rounding); every other key changes the training math or the
# numbers the run records (eval settings included), so a resume with it changed would mix two
# runs in one directory. A prefix ending in "." covers a whole section.
ALLOWED_CHANGES = (
    "run.name",
    "run.out_dir",
    "run.steps",
    "run.eval_every",
    "run.save_every",
    "run.threads",
    "run.max_minutes",
    "run.tensorboard",
    "run.prefetch",
    "run.eval_live",
    "run.device",
    "run.backend",
    "run.max_dead_steps",
    "rollout.max_batch",
    "rollout.compile",
    "rollout.cuda_graphs",
    "rollout.graph_cache",
    "rollout.overlap_decode",
    "actor.micro_batch",
    "actor.compile",
    "actor.activation_checkpointing",
    "actor.max_nonfinite_steps",
    "reward.max_dead_steps",
    "reward.max_batch",
    "ray.",
    "placement.",
    "parallel.",
    "probe.",
)
# how this command starts, not what the run is: never a change
NOT_COMPARED = ("run.resume", "run.allow_changes")
CHANGES_FILE = "config_changes.jsonl"


class ChangedTrainingKeys(DiffrlError):
    """A resume asked for different training keys than the run was trained with."""


def allowed_change(key: str) -> bool:
    return any(key == a or (a.endswith(".") and key.startswith(a)) for a in ALLOWED_CHANGES)


@dataclass
class RunStart:
    """What ``begin_run`` found: the run's directory (locked by rank 0), the checkpoint to
    resume from, whether there is nothing left to do, and the keys changed since the saved
    config (key -> (saved, new))."""

    cfg: Config
    root: Path
    lock: RunLock | None
    ckpt: Checkpoint | None
    finished: bool = False
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return 0 if self.ckpt is None else self.ckpt.step

    def open(self, primary: bool) -> RunDir:
        """The writes, once every check passed: move an earlier run aside (run.resume=false),
        config.yaml and its change record, metrics after the checkpoint dropped, TensorBoard
        opened past the checkpoint."""
        cfg = self.cfg
        if primary and not cfg.run.resume:
            move_aside(self.root)
        if primary and self.ckpt is not None:
            print(f"diffrl: resuming {self.root} from step {self.step}", file=sys.stderr)
        # TensorBoard drops the events at and after purge_step that earlier writers left: those
        # a killed run logged past its checkpoint (the checkpoint's own step was logged whole)
        purge = self.step + 1 if self.ckpt is not None else 0
        run = open_run_dir(self.root, cfg.run.tensorboard, primary, purge_step=purge)
        saved = self.root / "config.yaml"
        if self.ckpt is None or self.changes or not saved.exists():
            run.write_config(to_yaml(cfg))  # `diffrl eval RUN_DIR` reads it
        if self.changes and primary:
            record_changes(self.root, self.step, self.changes)
        run.truncate_after(self.step if self.ckpt is not None else -1)
        return run

    def release(self, refused: bool = False) -> None:
        """Unlock; a run refused before it wrote anything removes the directory it created."""
        if self.lock is not None:
            self.lock.release(remove_if_created=refused)


def begin_run(cfg: Config, primary: bool) -> RunStart:
    """Step 1 above: lock (rank 0), then the checks that need only the directory. Raises
    ``RunDirLocked`` / ``ChangedTrainingKeys`` / ``CheckpointError`` having written nothing
    (but the lock file)."""
    root = Path(cfg.run.out_dir) / cfg.run.name
    lock = RunLock(root).acquire() if primary else None
    begun = RunStart(cfg, root, lock, None)
    try:
        begun.ckpt = load_latest(root / "checkpoints") if cfg.run.resume else None
        if begun.ckpt is None:
            return begun
        if begun.ckpt.step >= cfg.run.steps:
            begun.finished = True
            if primary:
                print(
                    f"diffrl: run {root} is already at step {begun.ckpt.step} (run.steps="
                    f"{cfg.run.steps}): nothing to do, nothing written; raise run.steps to train "
                    "further, or run.resume=false to start over (the run is moved aside)",
                    file=sys.stderr,
                )
            return begun
        begun.changes = changed_keys(root / "config.yaml", cfg)
        refused = [k for k in begun.changes if not allowed_change(k)]
        if refused and not cfg.run.allow_changes:
            listed = ", ".join(
                f"{k} {begun.changes[k][0]!r} -> {begun.changes[k][1]!r}" for k in refused
            )
            raise ChangedTrainingKeys(
                f"run {root} was trained to step {begun.step} with other values of keys that "
                f"change training: {listed}; resume with the saved values, set "
                "run.allow_changes=true to continue with the new ones (recorded in "
                f"{CHANGES_FILE}), or start over with run.resume=false (the run is moved aside)"
            )
        return begun
    except BaseException:
        begun.release(refused=True)
        raise


@contextmanager
def started(cfg: Config, primary: bool, begun: RunStart | None) -> Iterator[RunStart]:
    """``begun`` as given (its maker releases it), else one begun here and released on leaving
    (refused: its directory removed if this made it and nothing was written)."""
    if begun is not None:
        yield begun
        return
    begun = begin_run(cfg, primary)
    try:
        yield begun
    except BaseException:
        begun.release(refused=True)
        raise
    begun.release()


def changed_keys(saved: Path, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (saved value, new value) for each key whose value differs. Keys only one
    side has (a key added or removed by a newer diffrl) are not changes, nor ``NOT_COMPARED``;
    lists compare whole, but for a list of entries (``reward.scorers``) whose fields a newer
    diffrl added to or removed from: each entry compares on the fields both sides hold."""
    try:
        old = yaml.safe_load(saved.read_text())
    except FileNotFoundError:
        print(f"diffrl: {saved} is missing: cannot check the resumed config", file=sys.stderr)
        return {}
    except (OSError, yaml.YAMLError) as e:
        raise DiffrlError(f"{saved} is unreadable ({e}); restore it to resume") from None
    new = yaml.safe_load(to_yaml(cfg))  # the same round trip the saved file took
    a, b = dict(_flat(old if isinstance(old, dict) else {})), dict(_flat(new))
    return {
        k: (a[k], b[k]) for k in b if k in a and not _same(a[k], b[k]) and k not in NOT_COMPARED
    }


def _same(old: Any, new: Any) -> bool:
    """Equal, comparing entries of a list of mappings on their shared fields only."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(_same(old[k], new[k]) for k in old.keys() & new.keys())
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_same(x, y) for x, y in zip(old, new, strict=True))
    return old == new


def _flat(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def record_changes(root: Path, step: int, changes: dict[str, tuple[Any, Any]]) -> None:
    """Append the keys a resume changed to ``config_changes.jsonl`` (config.yaml now holds the
    new values; this says from which step they hold) and say so."""
    row = {
        "step": step,
        "time": time.time(),
        "changes": {k: {"saved": a, "new": b} for k, (a, b) in changes.items()},
    }
    path = root / CHANGES_FILE
    text = path.read_text() if path.exists() else ""
    with media.replacing(path) as tmp:  # a kill leaves the old record or the new, whole
        tmp.write_text(text + json.dumps(row, default=str) + "\n")
    keys = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
    print(f"diffrl: from step {step} on: {keys} (recorded in {path})", file=sys.stderr)


def move_aside(root: Path) -> Path | None:
    """``run.resume=false`` over an earlier run: its files move to ``<name>.<timestamp>`` beside
    it (never deleted); the lock file stays, held by this run. None when there was nothing."""
    if not root.is_dir():
        return None
    entries = [p for p in root.iterdir() if p.name != LOCK_NAME]
    if not entries:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = root.parent / f"{root.name}.{stamp}", 1
    while aside.exists():
        n += 1
        aside = root.parent / f"{root.name}.{stamp}-{n}"
    aside.mkdir()
    for p in entries:
        os.replace(p, aside / p.name)
    print(
        f"diffrl: run.resume=false: moved the earlier run in {root} to {aside} (delete it when "
        "no longer needed)",
        file=sys.stderr,
    )
    return aside
