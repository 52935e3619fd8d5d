"""Bad config values and a full disk through the real ``diffrl train`` command path
(``diffrl.cli.main``, in process): each is one line on stderr with exit status 2, never a
traceback, and a refused value leaves nothing written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from tiny_runs import tiny_run

import diffrl.actor.checkpoint as checkpoint_mod
from diffrl.cli import main

# (override, words the one line must hold); each is refused before anything is written
BAD_VALUES = [
    ("data.prompts_per_step=1000000000", "data.prompts_per_step"),
    ("data.prompts_per_step=1e9", "data.prompts_per_step"),
    ("rollout.group_size=100000000", "rollout.group_size"),
    ("rollout.group_size=1e8", "rollout.group_size"),
    ("run.out_dir=/proc", "kernel's proc filesystem"),
    ("run.out_dir=/proc/runs", "kernel's proc filesystem"),
    ("model.checkpoint=/etc/passwd", "not a .safetensors checkpoint"),
    ("actor.lora.rank=1000000", "actor.lora.rank"),
    ("actor.lora.rank=1e6", "actor.lora.rank"),
    ("run.seed=-1", "run.seed"),
    ("run.seed=100000000000000000000", "run.seed"),
    ("run.seed=1e20", "run.seed"),
    ("run.threads=100000", "run.threads"),
    ("actor.autocast=on", "actor.autocast"),
]


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit status 2 and one line on stderr; return that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("diffrl: error: ")
    return lines[0]


@pytest.mark.parametrize(("override", "named"), BAD_VALUES)
def test_a_bad_value_is_one_line_before_any_write(
    capsys, tiny_checkpoint, tmp_path, override, named
) -> None:
    out = tmp_path / "runs"
    line = refused(capsys, ["train", *tiny_run(tiny_checkpoint, out, 1), override])
    assert named in line
    assert not out.exists()  # no run directory, config.yaml or eval before the refusal


def test_a_python_object_tag_in_a_recipe_is_one_line(capsys, tmp_path) -> None:
    marker = tmp_path / "ran"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f'run:\n  name: !!python/object/apply:os.system ["touch {marker}"]\n')
    line = refused(capsys, ["train", str(recipe), f"run.out_dir={tmp_path / 'runs'}"])
    assert "python/object/apply" in line
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_a_full_disk_at_the_checkpoint_is_one_line_and_leaves_no_temp_dir(
    capsys, tiny_checkpoint, tmp_path, monkeypatch
) -> None:
    """The documented ``actor.autocast=off`` runs; the disk fills during step 1's checkpoint:
    exit 2 with one line naming the checkpoint and its size, no ``.tmp_step_*`` left, and the
    metrics rows whole."""
    real_write = checkpoint_mod._write

    def full_after_half(path: Path, data: bytes) -> None:
        if path.name == "actor.pt":  # the second of the checkpoint's files
            real_write(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(checkpoint_mod, "_write", full_after_half)
    rc = main(["train", *tiny_run(tiny_checkpoint, tmp_path, 1, "actor.autocast=off")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("diffrl: error:")]
    assert len(errors) == 1, err
    ckpts = tmp_path / "shapes_nft" / "checkpoints"
    assert f"cannot write {ckpts / 'step_000001'}: it needs" in errors[0]
    assert "no space left" in errors[0]
    assert list(ckpts.glob(".tmp_step_*")) == [] and not (ckpts / "step_000001").exists()
    rows = [json.loads(ln) for ln in (tmp_path / "shapes_nft" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1]
