"""Saving a checkpoint onto a full disk or past the file-size limit: one line naming the
checkpoint and its size, no ``.tmp_step_*`` left to keep the disk full, and every earlier
checkpoint (a re-saved step's old copy included) still loads."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from diffrl.actor import checkpoint as ckpt_mod
from diffrl.actor.checkpoint import load_latest, save_checkpoint
from diffrl.diskio import DiskError

WORKTREE = Path(__file__).resolve().parents[2]


def actor_state(step: int) -> dict:
    """What ``ActorEngine.state_dict`` writes, as the contents checks on load want it."""
    gen = torch.Generator().manual_seed(step).get_state()
    return {"version": step, "nonfinite": 0, "gen": gen, "optimizer": {"state": {}}}


def payload(step: int, n: int = 64) -> tuple[dict, dict, dict]:
    adapters = {"layer.lora_A.default.weight": torch.full((n,), float(step))}
    return adapters, actor_state(step), {"step": step, "wall_s": float(step)}


def test_a_full_disk_mid_save_removes_the_temp_dir(tmp_path, monkeypatch) -> None:
    save_checkpoint(tmp_path, 1, *payload(1))
    real = ckpt_mod._write

    def full(path: Path, data: bytes) -> None:
        if path.name == "controller.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write", full)
    with pytest.raises(DiskError) as e:
        save_checkpoint(tmp_path, 2, *payload(2))
    assert str(e.value).startswith(f"cannot write {tmp_path / 'step_000002'}: it needs ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert load_latest(tmp_path).step == 1


def test_a_failed_resave_puts_the_old_copy_back(tmp_path, monkeypatch) -> None:
    save_checkpoint(tmp_path, 3, *payload(3))
    real_replace = os.replace

    def full_at_rename(src, dst) -> None:  # EFBIG cannot come here; a stand-in for any failure
        if Path(src).name == ".tmp_step_000003":
            raise OSError(errno.EFBIG, "File too large", str(src))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", full_at_rename)
    with pytest.raises(DiskError, match="step_000003: it needs"):
        save_checkpoint(tmp_path, 3, *payload(30))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003"]
    ckpt = load_latest(tmp_path)
    assert ckpt.step == 3 and ckpt.adapters["layer.lora_A.default.weight"][0] == 3.0


CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path

    import torch
    from diffrl.actor.checkpoint import save_checkpoint
    from diffrl.diskio import DiskError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, not a kill
    root = Path(sys.argv[1])
    gen = torch.Generator().manual_seed(0).get_state()
    actor = lambda s: {"version": s, "nonfinite": 0, "gen": gen, "optimizer": {"state": {}}}
    state = lambda s: (actor(s), {"step": s, "wall_s": 0.0})
    save_checkpoint(root, 1, {"a": torch.zeros(64)}, *state(1))  # well under the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))
    try:
        save_checkpoint(root, 2, {"a": torch.zeros(16384)}, *state(2))  # 64 KiB of adapters
    except DiskError as e:
        print(e)
        sys.exit(2)
    """
)


def test_a_real_file_size_limit(tmp_path) -> None:
    """RLIMIT_FSIZE in a child process (SIGXFSZ ignored, as Python does by default)."""
    env = {**os.environ, "PYTHONPATH": str(WORKTREE)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2, out.stderr
    line = out.stdout.strip()
    # 64 KiB of adapters and the actor state's RNG (about 5 KiB)
    assert line.startswith(f"cannot write {tmp_path / 'step_000002'}: it needs 7")
    assert "over the file-size limit (16.0 KiB, ulimit -f)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert load_latest(tmp_path).step == 1
