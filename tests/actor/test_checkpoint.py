"""Checkpoints: durable atomic writes, a manifest verified on load, resume from the newest
checkpoint that verifies, rotation that never drops the last good one."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from diffrl.actor import checkpoint as ckpt_mod
from diffrl.actor.checkpoint import (
    MANIFEST,
    latest_checkpoint,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from diffrl.errors import CheckpointError, DiffrlError


def payload(step: int):
    g = torch.Generator().manual_seed(step)
    adapters = {
        "layer.lora_A.default.weight": torch.randn(4, 8, generator=g),
        "layer.lora_B.default.weight": torch.randn(8, 4, generator=g).t(),
    }  # non-contig
    actor_state = {
        "version": step,
        "gen": torch.Generator().manual_seed(1).get_state(),
        "nonfinite": 0,
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(3) * step}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
    }
    return adapters, actor_state, {"step": step, "wall_s": 1.5 * step}


def names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_round_trip(tmp_path) -> None:
    adapters, actor_state, ctrl = payload(3)
    path = save_checkpoint(tmp_path, 3, adapters, actor_state, ctrl)
    assert path == tmp_path / "step_000003"
    assert latest_checkpoint(tmp_path) == path
    assert (tmp_path / "latest").read_text() == "step_000003"
    a2, s2, c2 = load_checkpoint(path)
    assert a2.keys() == adapters.keys()
    for k in adapters:
        assert torch.equal(a2[k], adapters[k])
    assert s2["version"] == 3 and torch.equal(s2["gen"], actor_state["gen"])
    assert torch.equal(s2["optimizer"]["state"][0]["exp_avg"], torch.ones(3) * 3)
    assert c2 == {"step": 3, "wall_s": 4.5}
    manifest = json.loads((path / MANIFEST).read_text())
    for name in ("adapters.safetensors", "actor.pt", "controller.json"):
        assert manifest["files"][name]["bytes"] == (path / name).stat().st_size
        assert len(manifest["files"][name]["sha256"]) == 64
    ckpt = load_latest(tmp_path)
    assert (ckpt.path, ckpt.step, ckpt.wall_s) == (path, 3, 4.5)


def test_no_checkpoint(tmp_path) -> None:
    assert load_latest(tmp_path) is None
    assert latest_checkpoint(tmp_path / "does_not_exist") is None
    (tmp_path / "latest").write_text("step_000004")  # a pointer alone is not a checkpoint
    assert load_latest(tmp_path) is None


def test_checkpoint_error_is_a_diffrl_error() -> None:
    assert issubclass(CheckpointError, DiffrlError)  # the CLI reports it without a traceback


# --- what resume does with a damaged run directory ---------------------------------------


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's data: the header still parses
    path.write_bytes(bytes(data))


def unreadable(path) -> None:
    path.unlink()
    path.mkdir()  # reading it raises an OSError, as a bad sector's EIO would


DAMAGE = {
    "unreadable actor.pt": ("actor.pt", unreadable, "cannot be read"),
    "truncated actor.pt": ("actor.pt", truncate, "bytes, the manifest says"),
    "truncated adapters": ("adapters.safetensors", truncate, "bytes, the manifest says"),
    "torn controller.json": ("controller.json", truncate, "bytes, the manifest says"),
    "flipped byte in adapters": ("adapters.safetensors", flip_last_byte, "sha256"),
    "deleted controller.json": ("controller.json", os.unlink, "is missing"),
    "deleted manifest": (MANIFEST, os.unlink, "is missing"),
    "torn manifest": (MANIFEST, truncate, "unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    file, hurt, why = DAMAGE[damage]
    save_checkpoint(tmp_path, 1, *payload(1))
    save_checkpoint(tmp_path, 2, *payload(2))
    hurt(tmp_path / "step_000002" / file)
    with caplog.at_level(logging.WARNING):
        ckpt = load_latest(tmp_path)
    assert ckpt.path == tmp_path / "step_000001" and ckpt.step == 1
    assert torch.equal(
        ckpt.adapters["layer.lora_A.default.weight"], payload(1)[0]["layer.lora_A.default.weight"]
    )
    assert f"step_000002: {file}" in caplog.text and why in caplog.text


@pytest.mark.parametrize("damage", DAMAGE)
def test_no_checkpoint_that_verifies_is_an_error_not_a_fresh_start(tmp_path, damage):
    file, hurt, why = DAMAGE[damage]
    save_checkpoint(tmp_path, 1, *payload(1))
    hurt(tmp_path / "step_000001" / file)
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints") as e:
        load_latest(tmp_path)
    assert f"step_000001: {file}" in str(e.value) and why in str(e.value)
    with pytest.raises(CheckpointError, match=why):
        load_checkpoint(tmp_path / "step_000001")


@pytest.mark.parametrize("pointer", [None, "", "step_000009", "step_000001"])
def test_resume_scans_the_directories_rather_than_trusting_latest(tmp_path, caplog, pointer):
    save_checkpoint(tmp_path, 1, *payload(1))
    save_checkpoint(tmp_path, 2, *payload(2))
    if pointer is None:
        (tmp_path / "latest").unlink()
    else:
        (tmp_path / "latest").write_text(pointer)
    with caplog.at_level(logging.WARNING):
        assert load_latest(tmp_path).step == 2
    assert "latest says" in caplog.text and "resuming from step_000002" in caplog.text


def test_missing_newest_dir_resumes_from_the_one_before(tmp_path, caplog) -> None:
    save_checkpoint(tmp_path, 1, *payload(1))
    save_checkpoint(tmp_path, 2, *payload(2))
    shutil.rmtree(tmp_path / "step_000002")  # `latest` now dangles
    with caplog.at_level(logging.WARNING):
        assert load_latest(tmp_path).step == 1
    assert "'step_000002'" in caplog.text


def test_manifest_checked_bytes_that_do_not_parse_are_named(tmp_path) -> None:
    path = save_checkpoint(tmp_path, 1, *payload(1))
    (path / "actor.pt").write_bytes(b"not a torch file")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["actor.pt"] = {
        "bytes": 16,
        "sha256": ckpt_mod._sha256(b"not a torch file"),
    }
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="step_000001: actor.pt does not load"):
        load_checkpoint(path)


# --- durable writes -------------------------------------------------------------------------


def test_files_and_directories_are_fsynced_before_the_rename(tmp_path, monkeypatch) -> None:
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "fsync", fsync)
    monkeypatch.setattr(ckpt_mod.os, "replace", replace)
    save_checkpoint(tmp_path, 1, *payload(1))
    tmp = str(tmp_path / ".tmp_step_000001")
    into_place = events.index(("replace", tmp, str(tmp_path / "step_000001")))
    synced = {e[1] for e in events[:into_place] if e[0] == "fsync"}
    for name in ("adapters.safetensors", "actor.pt", "controller.json", MANIFEST):
        assert f"{tmp}/{name}" in synced
    assert tmp in synced  # the directory entries of the files
    assert ("fsync", str(tmp_path)) in events[into_place:]  # the rename itself


def test_leftover_tmp_from_a_kill_is_ignored_and_cleaned(tmp_path) -> None:
    save_checkpoint(tmp_path, 1, *payload(1))
    # a kill while writing step 2: a half-written temp dir and a stray pointer temp
    tmp = tmp_path / ".tmp_step_000002"
    tmp.mkdir()
    (tmp / "adapters.safetensors").write_bytes(b"\x00garbage")
    (tmp_path / ".latest.tmp").write_text("step_000002")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    path = save_checkpoint(tmp_path, 2, *payload(2))
    assert latest_checkpoint(tmp_path) == path
    assert load_checkpoint(path)[2]["step"] == 2
    assert not tmp.exists()


def test_resaving_a_step_overwrites_it(tmp_path) -> None:
    save_checkpoint(tmp_path, 2, *payload(2))
    adapters, state, _ = payload(7)
    save_checkpoint(tmp_path, 2, adapters, state, {"step": 2, "wall_s": 99.0})
    a, _, c = load_checkpoint(tmp_path / "step_000002")
    assert c["wall_s"] == 99.0
    assert torch.equal(a["layer.lora_A.default.weight"], adapters["layer.lora_A.default.weight"])
    assert names(tmp_path) == ["step_000002"]


@pytest.mark.parametrize("kill_at_replace", [0, 1, 2])
def test_a_kill_while_resaving_the_only_checkpoint_keeps_one(
    tmp_path, monkeypatch, kill_at_replace
):
    """Re-saving step 2 renames the old copy away, the new one in, then updates `latest`; a
    kill before any of these renames leaves a checkpoint that verifies."""
    save_checkpoint(tmp_path, 2, *payload(2))
    real_replace, calls = os.replace, []

    def replace(src, dst):
        if len(calls) == kill_at_replace:
            raise KeyboardInterrupt("killed")
        calls.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", replace)
    adapters, state, _ = payload(7)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, adapters, state, {"step": 2, "wall_s": 99.0})
    monkeypatch.setattr(ckpt_mod.os, "replace", real_replace)
    ckpt = load_latest(tmp_path)
    assert ckpt.step == 2
    # the old copy until the new one is in place, the new one after
    assert ckpt.wall_s == (3.0 if kill_at_replace < 2 else 99.0)
    save_checkpoint(tmp_path, 3, *payload(3))  # the next save cleans up what the kill left
    assert names(tmp_path) == ["step_000002", "step_000003"]


# --- non-finite weights and rotation --------------------------------------------------------


def test_nonfinite_adapters_are_never_written(tmp_path, caplog) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path, step, *payload(step), keep=2)
    for step, bad in ((3, float("nan")), (4, float("inf"))):  # a diverged run, twice
        adapters, state, ctrl = payload(step)
        adapters["layer.lora_B.default.weight"][0, 0] = bad
        with caplog.at_level(logging.WARNING):
            assert save_checkpoint(tmp_path, step, adapters, state, ctrl, keep=2) is None
    assert "not finite" in caplog.text and "layer.lora_B.default.weight" in caplog.text
    assert names(tmp_path) == ["step_000001", "step_000002"]  # rotation never ran
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert load_latest(tmp_path).step == 2


def test_no_checkpoint_right_after_a_nonfinite_update(tmp_path, caplog) -> None:
    save_checkpoint(tmp_path, 1, *payload(1), keep=1)
    adapters, state, ctrl = payload(2)  # finite weights, but the last update was skipped
    with caplog.at_level(logging.WARNING):
        assert save_checkpoint(tmp_path, 2, adapters, {**state, "nonfinite": 2}, ctrl) is None
    assert "last 2 updates were NaN/inf" in caplog.text
    assert names(tmp_path) == ["step_000001"]


def test_keep_prunes_oldest(tmp_path) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, *payload(step), keep=2)
    assert names(tmp_path) == ["step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000004"
    save_checkpoint(tmp_path, 5, *payload(5), keep=3)
    assert names(tmp_path) == ["step_000003", "step_000004", "step_000005"]


def test_a_broken_checkpoint_does_not_count_towards_keep(tmp_path) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path, step, *payload(step), keep=2)
    truncate(tmp_path / "step_000002" / "actor.pt")
    save_checkpoint(tmp_path, 3, *payload(3), keep=2)
    assert names(tmp_path) == ["step_000001", "step_000003"]  # the good step 1 stays


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path) -> None:
    for step in (4, 5):  # left by an earlier run in this directory
        save_checkpoint(tmp_path, step, *payload(step), keep=2)
    path = save_checkpoint(tmp_path, 1, *payload(1), keep=2)  # a fresh run's first save
    assert path.exists()
    assert latest_checkpoint(tmp_path) == path  # newest written, not highest step
    assert names(tmp_path) == ["step_000001", "step_000005"]
