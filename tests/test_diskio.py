"""A full disk or a file-size limit while writing a run's files: one line naming the path and
the bytes needed, and never a truncated file (the old one stays whole)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from PIL import Image

import diffrl.diskio as diskio
from diffrl.cli import main
from diffrl.controller.run_dir import RunDir
from diffrl.diskio import DiskError, write_atomic


@pytest.fixture
def disk_fills(monkeypatch):
    """Every ``write_all`` takes half its bytes, then the disk is full (``errno_`` given)."""

    def arm(errno_: int = errno.ENOSPC) -> None:
        real = diskio.write_all

        def half_then_full(fd: int, data: bytes) -> None:
            real(fd, data[: len(data) // 2])
            raise OSError(errno_, os.strerror(errno_))

        monkeypatch.setattr(diskio, "write_all", half_then_full)

    return arm


def test_write_atomic_keeps_the_old_file_on_enospc(tmp_path, disk_fills) -> None:
    path = tmp_path / "a.bin"
    write_atomic(path, b"old")
    disk_fills()
    with pytest.raises(DiskError) as e:
        write_atomic(path, b"n" * 5000)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"cannot write {path}: it needs 4.9 KiB, no space left" in msg
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_efbig_names_the_file_size_limit(tmp_path, disk_fills) -> None:
    disk_fills(errno.EFBIG)
    with pytest.raises(DiskError, match="a.bin: it needs 100 B, (over the file-size|too large)"):
        write_atomic(tmp_path / "a.bin", b"x" * 100)


def test_a_metrics_row_cut_by_a_full_disk_is_taken_back(tmp_path, disk_fills) -> None:
    run = RunDir(tmp_path, tensorboard=False)
    run.log(0, {"reward/mean": 0.5})
    before = run.metrics_path.read_bytes()
    disk_fills()
    with pytest.raises(DiskError, match="metrics.jsonl: it needs"):
        run.log(1, {"reward/mean": 0.6})
    assert run.metrics_path.read_bytes() == before  # no half row for a reader to meet


def test_curves_grid_and_config_stay_whole_when_the_disk_fills(tmp_path, disk_fills) -> None:
    run = RunDir(tmp_path, tensorboard=False)
    run.log(0, {"reward/mean": 0.1, "eval/overall": 0.2})
    run.log(1, {"reward/mean": 0.3})
    curves = run.save_curves()
    images = np.zeros((2, 8, 8, 3), np.uint8)
    grid = run.save_grid(0, images, ["a red circle", "b"], [True, None])
    run.write_config("run:\n  steps: 2\n")
    saved = {p: p.read_bytes() for p in (curves, grid, tmp_path / "config.yaml")}
    disk_fills()
    with pytest.raises(DiskError, match="curves.png: it needs"):
        run.save_curves()
    with pytest.raises(DiskError, match="step_000000.png: it needs"):
        run.save_grid(0, images + 1, ["c", "d"], [False, False])
    with pytest.raises(DiskError, match="config.yaml: it needs 16 B"):
        run.write_config("run:\n  steps: 3\n")
    for path, data in saved.items():
        assert path.read_bytes() == data
    Image.open(curves).verify()  # a whole PNG
    leftovers = [p.name for p in tmp_path.rglob(".*.tmp")]
    assert leftovers == []


def test_a_streamed_file_says_the_least_it_needed(tmp_path) -> None:
    """Clips are written by their libraries through ``replacing``: the size is known only up
    to the failure."""
    path = tmp_path / "clip.wav"
    path.write_bytes(b"old")
    need = "clip.wav: it needs more than 100 B, no space left"
    with pytest.raises(DiskError, match=need), diskio.replacing(path) as tmp:
        tmp.write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_bytes() == b"old" and not (tmp_path / ".clip.wav.tmp").exists()


def test_the_cli_turns_an_unwrapped_disk_error_into_one_line(capsys, monkeypatch) -> None:
    import diffrl.cli as cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/tb/events.out")

    monkeypatch.setattr(cli, "cmd_train", full)
    assert main(["train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "diffrl: error: cannot write /runs/x/tb/events.out: No space left on device; free some "
        "space (or raise ulimit -f) and run the same command again"
    ]


def test_other_os_errors_still_raise(monkeypatch) -> None:
    import diffrl.cli as cli

    def broken(args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cli, "cmd_train", broken)
    with pytest.raises(OSError):
        main(["train"])


def test_sized() -> None:
    sizes = (812, 5000, 3 * 2**30, 3 * 2**50)
    assert [diskio.sized(n) for n in sizes] == ["812 B", "4.9 KiB", "3.0 GiB", "3072 TiB"]
