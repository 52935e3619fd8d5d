"""Faults on the real ``diffrl train`` path (issue 18, "runs that never lose work").

A damaged run directory resumes from the newest checkpoint that verifies, or stops with a
clear error; it never starts over from step 0, rewriting metrics.jsonl and rotating away the
intact checkpoints. A diverged run keeps its last good checkpoint and resumes from it with a
changed config. SIGTERM / SIGINT write a checkpoint and exit cleanly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from tiny_runs import tiny_run

import diffrl.controller.step as shared
import diffrl.controller.sync as sync
from diffrl.actor.checkpoint import MANIFEST, Checkpoint, load_latest
from diffrl.actor.engine import ActorEngine
from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.run_dir import read_metrics
from diffrl.controller.signals import StopSignals
from diffrl.errors import CheckpointError, ConfigError
from diffrl.reward.scorer import ScoreResult, register_scorer

RECIPE = "recipes/shapes_nft.yaml"
REPO = Path(__file__).resolve().parents[2]
FAST = ["run.save_every=1", "rollout.num_steps=2", "run.eval_every=100"]


def train(tiny_checkpoint: Path, out: Path, steps: int, *extra: str) -> int:
    """``diffrl train`` in this process; its exit status."""
    return main(["train", RECIPE, *tiny_run(tiny_checkpoint, out, steps, *FAST, *extra)])


def trained_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "actor/loss" in r]


def dirs(ckpts: Path) -> list[str]:
    return sorted(p.name for p in ckpts.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def two_steps(tiny_checkpoint, tmp_path_factory) -> Path:
    """out_dir of a 2-step run with checkpoints step_000001 and step_000002."""
    out = tmp_path_factory.mktemp("two_steps")
    assert train(tiny_checkpoint, out, 2) == 0
    assert dirs(out / "shapes_nft" / "checkpoints") == ["step_000001", "step_000002"]
    return out


@pytest.fixture
def out(two_steps, tmp_path) -> Path:
    shutil.copytree(two_steps, tmp_path / "out")
    return tmp_path / "out"


# --- a damaged run directory --------------------------------------------------------------


def halve(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


# damage -> (what it does to checkpoints/, the step resume continues from, a warning fragment)
DAMAGE = {
    "latest missing": (lambda c: (c / "latest").unlink(), 2, "(missing or empty)"),
    "latest empty": (lambda c: (c / "latest").write_text(""), 2, "(missing or empty)"),
    "newest dir missing": (lambda c: shutil.rmtree(c / "step_000002"), 1, "'step_000002'"),
    "controller.json missing": (
        lambda c: (c / "step_000002" / "controller.json").unlink(),
        1,
        "controller.json is missing",
    ),
    "actor.pt truncated": (lambda c: halve(c / "step_000002" / "actor.pt"), 1, "truncated"),
    "adapters truncated": (
        lambda c: halve(c / "step_000002" / "adapters.safetensors"),
        1,
        "truncated",
    ),
    "controller.json torn": (
        lambda c: halve(c / "step_000002" / "controller.json"),
        1,
        "truncated",
    ),
    "adapters byte flipped": (
        lambda c: flip_last_byte(c / "step_000002" / "adapters.safetensors"),
        1,
        "sha256",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_resumes_from_the_newest_checkpoint_that_verifies(
    tiny_checkpoint, out, caplog, damage
):
    hurt, resumed_from, warning = DAMAGE[damage]
    run = out / "shapes_nft"
    before = read_metrics(run)
    hurt(run / "checkpoints")
    with caplog.at_level(logging.WARNING):
        assert train(tiny_checkpoint, out, 3) == 0
    assert warning in caplog.text
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # no second step-0 eval, no step twice
    assert rows[: resumed_from + 1] == before[: resumed_from + 1]  # kept, not rewritten
    assert trained_steps(run) == [1, 2, 3]
    assert load_latest(run / "checkpoints").step == 3


@pytest.mark.parametrize("damage", ["actor.pt truncated", "adapters byte flipped"])
def test_no_checkpoint_that_verifies_stops_with_an_error_and_touches_nothing(
    tiny_checkpoint, out, capsys, damage
):
    ckpts = out / "shapes_nft" / "checkpoints"
    for step in ("step_000001", "step_000002"):
        file = "actor.pt" if "actor" in damage else "adapters.safetensors"
        (halve if "truncated" in damage else flip_last_byte)(ckpts / step / file)
    metrics = (out / "shapes_nft" / "metrics.jsonl").read_bytes()
    assert train(tiny_checkpoint, out, 3) == 2
    err = capsys.readouterr().err
    assert "diffrl: error: none of the 2 checkpoints" in err
    assert "step_000001: " in err and "step_000002: " in err
    assert (out / "shapes_nft" / "metrics.jsonl").read_bytes() == metrics
    assert dirs(ckpts) == ["step_000001", "step_000002"]  # nothing rotated away


def test_a_torn_last_metrics_line_is_dropped_on_resume(tiny_checkpoint, out, caplog):
    run = out / "shapes_nft"
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "time": 1.0, "actor/lo')  # killed mid-write of step 3
    with caplog.at_level(logging.WARNING):
        assert train(tiny_checkpoint, out, 3) == 0
    assert "not JSON" in caplog.text
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]


def rewrite(ckpt: Path, name: str, data: bytes) -> None:
    """Replace ``ckpt/name`` and make its manifest agree: only a contents check can catch it."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_nonsense_in_a_checkpoint_falls_back_and_a_run_that_trains_nothing_exits_2(
    tiny_checkpoint, out, caplog, capsys
):
    """Issue 41, findings 6 and 4, on the real ``diffrl train``. A newest checkpoint whose
    manifest matches but whose step is -5 (which emptied metrics.jsonl before a traceback), then
    one whose adapter has another shape (which stopped the run): each falls back to the older
    intact one. The tiny random model's rewards all tie, so no update moves the weights: the run
    stops with exit status 2 after run.max_dead_steps (5) of them, instead of exiting 0."""
    run = out / "shapes_nft"
    ckpts, before = run / "checkpoints", read_metrics(run)
    state = json.loads((ckpts / "step_000002" / "controller.json").read_text())
    rewrite(ckpts / "step_000002", "controller.json", json.dumps({**state, "step": -5}).encode())
    with caplog.at_level(logging.WARNING):
        assert train(tiny_checkpoint, out, 9) == 2
    err = capsys.readouterr().err
    assert "skipping checkpoint step_000002: controller.json step -5 is not an int" in caplog.text
    assert "diffrl: error: steps 2..6 trained nothing (run.max_dead_steps=5)" in err
    assert "gradient norm was exactly 0" in err and "Traceback" not in err
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert rows[:2] == before[:2]  # kept: nothing was emptied or rewritten before the fallback
    assert dirs(ckpts) == ["step_000005", "step_000006"]  # written up to the stop

    adapters = load_safetensors((ckpts / "step_000006" / "adapters.safetensors").read_bytes())
    name = next(n for n in adapters if "lora_A.default" in n)
    adapters[name] = torch.zeros(adapters[name].shape[0] + 1, adapters[name].shape[1])
    rewrite(ckpts / "step_000006", "adapters.safetensors", save_safetensors(adapters))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert train(tiny_checkpoint, out, 7) == 0  # steps 6, 7: two dead updates, under 5
    assert f"skipping checkpoint step_000006: adapter {name}" in caplog.text
    assert "resuming from" in caplog.text and "step_000005" in caplog.text
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3, 4, 5, 6, 7]


# --- rewards and weights that are not finite ------------------------------------------------


@register_scorer("overflowing")
class Overflowing:
    """Scores near float32's max: their mean overflows to inf."""

    needs = frozenset({"image"})

    def __init__(self) -> None:
        self.name = "overflowing"

    async def score(self, traj):
        return ScoreResult(torch.full((len(traj),), 3e38), torch.ones(len(traj), dtype=bool))


def test_metrics_stay_strict_json_when_a_reward_overflows(tiny_checkpoint, tmp_path):
    assert train(tiny_checkpoint, tmp_path, 1, "reward.scorers=[{name: overflowing}]") == 0

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    lines = (tmp_path / "shapes_nft" / "metrics.jsonl").read_text().splitlines()
    row = [json.loads(ln, parse_constant=refuse) for ln in lines][-1]
    value = row["reward/mean"]
    assert value is None or math.isfinite(value)  # null where the mean overflowed


@register_scorer("float64_huge")
class Float64Huge:
    """Scores of 1e300 as float64: finite as given, inf once summed into the float32 reward."""

    needs = frozenset({"image"})

    def __init__(self) -> None:
        self.name = "float64_huge"

    async def score(self, traj):
        scores = torch.full((len(traj),), 1e300, dtype=torch.float64)
        return ScoreResult(scores, torch.ones(len(traj), dtype=bool))


def test_a_score_that_overflows_float32_stops_as_the_scorers_fault(
    tiny_checkpoint, tmp_path, capsys
):
    """Issue 41, finding 5: checked before the cast, it made the loss NaN and the run stopped
    with "lower actor.lr"; the real ``diffrl train`` now names the scorer and the value."""
    assert train(tiny_checkpoint, tmp_path, 1, "reward.scorers=[{name: float64_huge}]") == 2
    err = capsys.readouterr().err
    assert "diffrl: error: required scorer 'float64_huge' returned 8 missing/NaN" in err
    assert "1e+300 x weight 1 is not finite in float32" in err
    assert "actor.lr" not in err and "Traceback" not in err
    assert not (tmp_path / "shapes_nft" / "checkpoints").exists()  # nothing trained on it


def test_a_diverged_run_keeps_its_last_good_checkpoint_and_resumes_with_a_new_config(
    tiny_checkpoint, out, caplog, monkeypatch
):
    real_train_step = ActorEngine.train_step

    def diverging(self, batch):  # from the 3rd update on, the weights are NaN
        metrics = real_train_step(self, batch)
        if self.version >= 3:
            with torch.no_grad():
                next(p for n, p in self.model.named_parameters() if "lora_B.default" in n).fill_(
                    float("nan")
                )
        return metrics

    monkeypatch.setattr(ActorEngine, "train_step", diverging)
    run = out / "shapes_nft"
    # the tiny random model's rewards all tie (gradient norm 0) before the weights go NaN:
    # run.max_dead_steps would stop the run first; this test is about the NaN guard
    with caplog.at_level(logging.WARNING):
        assert train(tiny_checkpoint, out, 10, "run.max_dead_steps=0") == 2  # NonFiniteLoss
    assert "not finite" in caplog.text and "checkpoint NOT written" in caplog.text
    assert dirs(run / "checkpoints") == ["step_000001", "step_000002"]  # keep=2 kept both
    monkeypatch.setattr(ActorEngine, "train_step", real_train_step)
    # a changed training key: the resume must say so (issue 41, finding 12)
    assert train(tiny_checkpoint, out, 4, "actor.lr=5e-4", "run.allow_changes=true") == 0
    rows = read_metrics(run)
    assert trained_steps(run) == [1, 2, 3, 4]
    assert all(math.isfinite(r["actor/loss"]) for r in rows if r["step"] > 2)
    assert rows[-1]["actor/lr"] == 5e-4


def test_resume_starts_the_nonfinite_count_afresh(tmp_path):
    """The count of consecutive non-finite updates belongs to the config that made them; a
    resumed run (typically with a lower actor.lr) gets its full allowance again. (Checkpoints
    are not written while the count is above 0, so this guards state written otherwise.)"""
    saved = Checkpoint(tmp_path, {}, {"version": 4, "nonfinite": 2}, {"step": 4, "wall_s": 9.0})
    loaded = {}
    parts = SimpleNamespace(
        actor=SimpleNamespace(load_state=lambda a, s: loaded.update(s), adapter_tensors=dict),
        prompts=SimpleNamespace(load_state_dict=lambda state, step: None),
    )
    assert shared.resume(parts, SimpleNamespace(ckpt=saved, root=tmp_path)) == (4, 9.0)
    assert loaded == {"version": 4, "nonfinite": 0}


def test_a_checkpoint_the_actor_cannot_load_is_a_checkpoint_error_that_touches_nothing(
    tmp_path, monkeypatch
):
    """What the contents checks cannot see (an optimizer state of another layout) still ends in
    one clear error, not a traceback, before metrics.jsonl is cut back."""
    saved = Checkpoint(tmp_path, {}, {"version": 4}, {"step": 4, "wall_s": 9.0})

    def refuse(adapters, state):
        raise ValueError("loaded state dict contains a parameter group that doesn't match")

    parts = SimpleNamespace(actor=SimpleNamespace(load_state=refuse, adapter_tensors=dict))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 5}\n')
    with pytest.raises(CheckpointError, match="does not fit this run: loaded state dict"):
        shared.resume(parts, SimpleNamespace(ckpt=saved, root=tmp_path))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 5}\n'


@pytest.mark.parametrize(
    "override",
    ["actor.lr=inf", "actor.lr=.inf", "actor.lr=nan", "actor.grad_clip=inf", "actor.grad_clip=0"],
)
def test_lr_and_grad_clip_must_be_finite(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"'{key}'.*finite and > 0"):
        load_config(RECIPE, [override])


# --- SIGTERM / SIGINT -------------------------------------------------------------------------


def test_stop_signals_turn_a_signal_into_a_flag_and_restore_the_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGTERM)  # handled: this process lives on
        assert stop.requested and stop.received == "SIGTERM"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_install_and_restore_without_a_with_block():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals().install()
    try:
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigint_interrupts_at_once():
    # the second signal falls back to the handler StopSignals found; pin it to Python's own
    # (an earlier test in the same process, e.g. an in-process server, may have changed it)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.received == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


# Needs the loop hook (issue 18): `with StopSignals() as stop:` around the step loop and, after
# `run.log(done, metrics)`, `if stop.requested: checkpoint(...); break`. Runs by itself once
# diffrl/controller/sync.py imports StopSignals.
needs_stop_hook = pytest.mark.skipif(
    not hasattr(sync, "StopSignals"), reason="the training loop does not check StopSignals yet"
)


@needs_stop_hook
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_checkpoints_the_step_and_exits_cleanly(tiny_checkpoint, tmp_path, sig):
    args = tiny_run(tiny_checkpoint, tmp_path, 1000, "rollout.num_steps=2", "run.eval_every=1000")
    args += ["run.save_every=1000"]  # no checkpoint but the one the signal asks for
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffrl.cli", "train", RECIPE, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = tmp_path / "shapes_nft"
    try:
        deadline = time.time() + 120
        while not [r for r in read_metrics(run) if r["step"] >= 2]:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert sig.name in err
    last = read_metrics(run)[-1]["step"]
    assert load_latest(run / "checkpoints").step == last  # the step it was in, kept
    assert train(tiny_checkpoint, tmp_path, last + 1) == 0
    assert trained_steps(run) == list(range(1, last + 2))
