"""A run directory has one owner, every refusal comes before any write, and a resume says what
it does (issue 41: findings 2, 3, 10, 12, 14 and the order part of 7).

The pieces (the lock, the key comparison, moving a run aside, TensorBoard's purge) are tested
alone; two tests drive the real ``diffrl train``: one in a subprocess that is SIGKILLed while a
second run is refused its directory and a third resumes it, one through a refused config, a
finished run, refused resumes and a start over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_runs import tiny_run

from diffrl.cli import main
from diffrl.config import load_config, to_yaml
from diffrl.controller.run_dir import RunDir, read_metrics
from diffrl.controller.run_lock import LOCK_NAME, RunDirLocked, RunLock
from diffrl.controller.run_start import allowed_change, changed_keys, move_aside

RECIPE = "recipes/shapes_nft.yaml"
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
FAST = ["rollout.num_steps=2", "run.eval_every=100", "run.save_every=2"]


def tb_steps(root: Path, tag: str = "actor/loss") -> list[int]:
    """The steps TensorBoard shows for ``tag``, purges applied (as its UI reads them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


# --- the lock ---------------------------------------------------------------------------------


def test_a_second_owner_is_refused_at_once_and_told_whose_it_is(tmp_path):
    root = tmp_path / "out" / "run"
    lock = RunLock(root).acquire()
    assert f"pid {os.getpid()} on host" in (root / LOCK_NAME).read_text()
    with pytest.raises(RunDirLocked, match=f"in use by pid {os.getpid()} on host"):
        RunLock(root).acquire()  # flock: a second open file description conflicts
    lock.release()
    RunLock(root).acquire().release()  # released: free again


def test_a_killed_owners_lock_does_not_block(tmp_path):
    take = (
        "import sys, time; from pathlib import Path; from diffrl.controller.run_lock import "
        f"RunLock; RunLock(Path({str(tmp_path)!r})).acquire(); print('held', flush=True); "
        "time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", take], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"pid {proc.pid} "):
            RunLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert f"pid {proc.pid} " in (tmp_path / LOCK_NAME).read_text()  # the dead owner's file
    RunLock(tmp_path).acquire().release()  # is still there, and does not block


def test_a_refused_run_removes_only_the_directories_it_made_and_left_empty(tmp_path):
    made = tmp_path / "new_out" / "run"
    RunLock(made).acquire().release(remove_if_created=True)
    assert not (tmp_path / "new_out").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "x").write_text("not the lock's")
    RunLock(kept).acquire().release(remove_if_created=True)
    assert (kept / "x").exists()
    written = tmp_path / "written"
    lock = RunLock(written).acquire()
    (written / "metrics.jsonl").write_text("")
    lock.release(remove_if_created=True)
    assert (written / "metrics.jsonl").exists()


# --- the pieces of a resume -------------------------------------------------------------------


def test_changed_keys_lists_each_change_and_allows_only_those_that_keep_the_math(tmp_path):
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(load_config(RECIPE)))
    same = load_config(RECIPE)
    assert changed_keys(saved, same) == {}
    over = ["algorithm.beta=0.5", "actor.lr=5e-4", "run.steps=500", "run.backend=ray"]
    over += ["reward.scorers=[{name: shapes, weight: 2.0}]", "parallel.tp=2"]
    changes = changed_keys(saved, load_config(RECIPE, over))
    assert changes["algorithm.beta"] == (1.0, 0.5) and changes["actor.lr"] == (1e-3, 5e-4)
    assert set(changes) == {
        "algorithm.beta",
        "actor.lr",
        "run.steps",
        "run.backend",
        "reward.scorers",
        "parallel.tp",
    }
    refused = {k for k in changes if not allowed_change(k)}
    assert refused == {"algorithm.beta", "actor.lr", "reward.scorers"}
    # a key the saved file lacks (added by a newer diffrl) is not a change
    tree = yaml.safe_load(saved.read_text())
    del tree["algorithm"]["beta"]
    saved.write_text(yaml.safe_dump(tree))
    assert "algorithm.beta" not in changed_keys(saved, load_config(RECIPE, over))
    # nor a field the saved scorer entries lack (reward.scorers[*].modality came later)
    for entry in tree["reward"]["scorers"]:
        del entry["modality"]
    saved.write_text(yaml.safe_dump(tree))
    assert "reward.scorers" not in changed_keys(saved, same)


def test_move_aside_keeps_the_earlier_run_whole_and_the_lock_in_place(tmp_path):
    root = tmp_path / "run"
    lock = RunLock(root).acquire()
    assert move_aside(root) is None  # nothing but the lock: nothing to move
    (root / "checkpoints").mkdir()
    (root / "metrics.jsonl").write_text('{"step": 0}\n')
    aside = move_aside(root)
    assert aside is not None and aside.name.startswith("run.")
    assert sorted(p.name for p in root.iterdir()) == [LOCK_NAME]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "metrics.jsonl"]
    (root / "metrics.jsonl").write_text("")
    second = move_aside(root)  # the same second: a distinct name, nothing overwritten
    assert second is not None and second != aside and aside.exists()
    lock.release()


def test_tensorboard_drops_the_steps_a_killed_run_logged_past_its_checkpoint(tmp_path):
    first = RunDir(tmp_path)
    for step in range(1, 6):  # killed after logging step 5; its last checkpoint was step 3
        first.log(step, {"actor/loss": float(step)})
    first.close()
    again = RunDir(tmp_path, purge_step=4)  # resumed from the step-3 checkpoint
    for step in range(4, 8):
        again.log(step, {"actor/loss": 10.0 + step})
    again.close()
    assert tb_steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7]  # without purge_step: 1..5, 4..7


# --- the real command -------------------------------------------------------------------------


def train(tiny_checkpoint: Path, out: Path, steps: int, *extra: str) -> int:
    return main(["train", RECIPE, *tiny_run(tiny_checkpoint, out, steps, *FAST, *extra)])


def test_one_owner_and_a_hard_kill_resumes_without_repeats(tiny_checkpoint, tmp_path, capsys):
    """Finding 2: a second run is refused while the first lives, the first's lock does not
    outlive a SIGKILL; findings 12 and 14: the resume says where it starts, and neither
    metrics.jsonl nor TensorBoard holds a step twice."""
    args = tiny_run(tiny_checkpoint, tmp_path, 1000, *FAST, "run.tensorboard=true")
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffrl.cli", "train", RECIPE, *args],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = tmp_path / "shapes_nft"
    try:
        deadline = time.time() + 120
        while not [r for r in read_metrics(run) if r["step"] >= 3]:  # past the step-2 checkpoint
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        assert train(tiny_checkpoint, tmp_path, 1000) == 2
        assert f"{run} is in use by pid {proc.pid} on host" in capsys.readouterr().err
    finally:
        proc.kill()  # SIGKILL: no checkpoint, no cleanup
        proc.wait()
    logged = read_metrics(run)[-1]["step"]
    ckpt = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert train(tiny_checkpoint, tmp_path, logged + 1, "run.tensorboard=true") == 0
    assert f"resuming {run} from step {ckpt}" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run)] == list(range(logged + 2))
    assert tb_steps(run) == list(range(1, logged + 2))


def test_refusals_write_nothing_and_a_start_over_keeps_the_earlier_run(
    tiny_checkpoint, tmp_path, capsys
):
    """Finding 7 (order) and 3: refused before any write, config.yaml included; 12: a
    finished run is left alone, changed training keys are refused unless allowed; 10:
    run.resume=false moves the earlier run aside."""
    fresh = tmp_path / "fresh"
    assert train(tiny_checkpoint, fresh, 1, "model.checkpoint=/nonexistent/model.safetensors") == 2
    assert "not found" in capsys.readouterr().err
    assert not fresh.exists()  # no run directory, no step-0 eval
    out = tmp_path / "out"
    run = out / "shapes_nft"
    assert train(tiny_checkpoint, out, 2) == 0

    def contents() -> dict[Path, bytes]:  # but the lock file, which each run rewrites
        return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_NAME}

    files = contents()
    untouched = lambda: contents() == files  # noqa: E731

    assert train(tiny_checkpoint, out, 2, "run.backend=ray") == 0  # finished: nothing to do
    assert "already at step 2 (run.steps=2): nothing to do" in capsys.readouterr().err
    assert untouched()
    assert train(tiny_checkpoint, out, 3, "algorithm.beta=0.5", "actor.lr=5e-4") == 2
    err = capsys.readouterr().err
    assert "actor.lr 0.001 -> 0.0005, algorithm.beta 1.0 -> 0.5" in err and "allow_changes" in err
    assert untouched()
    # allowed, but the checkpoint does not fit the model: refused by the actor, after the
    # engines are built, still before any write (config.yaml used to say rank 16 by now)
    assert train(tiny_checkpoint, out, 3, "actor.lora.rank=16", "run.allow_changes=true") == 2
    assert "saved under other actor.lora settings" in capsys.readouterr().err
    assert untouched()
    assert train(tiny_checkpoint, out, 3, "algorithm.beta=0.5", "run.allow_changes=true") == 0
    (row,) = [json.loads(ln) for ln in (run / "config_changes.jsonl").read_text().splitlines()]
    assert row["step"] == 2 and row["changes"] == {
        "run.steps": {"saved": 2, "new": 3},
        "algorithm.beta": {"saved": 1.0, "new": 0.5},
    }
    assert yaml.safe_load((run / "config.yaml").read_text())["algorithm"]["beta"] == 0.5
    before = read_metrics(run)
    assert train(tiny_checkpoint, out, 1, "run.resume=false") == 0
    err = capsys.readouterr().err
    (aside,) = [p for p in out.iterdir() if p.name.startswith("shapes_nft.")]
    assert f"moved the earlier run in {run} to {aside}" in err
    assert read_metrics(aside) == before and (aside / "checkpoints" / "step_000003").is_dir()
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
