"""Checkpoint contents checked after the manifest (issue 41, finding 6).

A manifest proves the bytes are the ones written, not that they make sense: each case here
rewrites a file of the newest checkpoint AND its manifest entry (size and sha256), as a buggy
writer or a hand edit would, so only the contents checks can catch it. Each falls back to the
older intact checkpoint with a warning, exactly as a torn file does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from test_checkpoint import payload

from diffrl.actor import checkpoint as ckpt_mod
from diffrl.actor.checkpoint import MANIFEST, load_checkpoint, load_latest, save_checkpoint
from diffrl.errors import CheckpointError


def rewrite(ckpt: Path, name: str, data: bytes) -> None:
    """Replace ``ckpt/name`` and make the manifest agree with it."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": ckpt_mod._sha256(data)}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def edit_controller(**fields):
    def hurt(ckpt: Path) -> None:
        state = json.loads((ckpt / "controller.json").read_text())
        rewrite(ckpt, "controller.json", json.dumps({**state, **fields}).encode())

    return hurt


def edit_adapters(change):
    def hurt(ckpt: Path) -> None:
        tensors = load_safetensors((ckpt / "adapters.safetensors").read_bytes())
        change(tensors)
        rewrite(ckpt, "adapters.safetensors", save_safetensors(tensors))

    return hurt


def edit_actor(change):
    def hurt(ckpt: Path) -> None:
        state = torch.load(ckpt / "actor.pt", weights_only=True)
        change(state)
        rewrite(ckpt, "actor.pt", ckpt_mod._torch_bytes(state))

    return hurt


A, B = "layer.lora_A.default.weight", "layer.lora_B.default.weight"


def set_nan(t: dict) -> None:
    t[A][1, 2] = float("nan")


def reshape(t: dict) -> None:
    t[A] = torch.zeros(8, 8)  # the rank of another config


def to_half(t: dict) -> None:
    t[A] = t[A].half()


def add_one(t: dict) -> None:
    t["layer.lora_A.other.weight"] = t[A].clone()


def drop(t: dict) -> None:
    del t[B]


def moments_inf(s: dict) -> None:
    s["optimizer"]["state"][0]["exp_avg"][0] = float("inf")


# damage -> (what it does to the newest checkpoint, a fragment of the warning)
CONTENTS = {
    "step -5": (edit_controller(step=-5), "step -5 is not an int >= 0"),
    'step "abc"': (edit_controller(step="abc"), "step 'abc' is not an int >= 0"),
    "step 2.0": (edit_controller(step=2.0), "step 2.0 is not an int"),
    "step true": (edit_controller(step=True), "step True is not an int"),
    "step of another directory": (edit_controller(step=7), "says step 7, its directory 2"),
    "wall_s NaN": (edit_controller(wall_s=float("nan")), "wall_s nan is not a number"),
    "wall_s text": (edit_controller(wall_s="1s"), "wall_s '1s' is not a number"),
    "controller a list": (
        lambda c: rewrite(c, "controller.json", b"[2, 3.0]"),
        "lacks 'step' / 'wall_s'",
    ),
    "NaN adapter": (edit_adapters(set_nan), "adapter tensors are not finite"),
    "wrong-shape adapter": (edit_adapters(reshape), "is (8, 8) torch.float32, the model's is"),
    "wrong-dtype adapter": (edit_adapters(to_half), "torch.float16, the model's is"),
    "extra adapter": (edit_adapters(add_one), "which the model lacks"),
    "missing adapter": (edit_adapters(drop), "adapters lack the model's"),
    "inf optimizer moment": (edit_actor(moments_inf), "optimizer state 0.exp_avg is not finite"),
    "negative version": (edit_actor(lambda s: s.update(version=-1)), "version -1 is not an int"),
    "no RNG state": (edit_actor(lambda s: s.update(gen=[1, 2])), "gen is not an RNG state"),
    "actor state a list": (
        lambda c: rewrite(c, "actor.pt", ckpt_mod._torch_bytes([1, 2])),
        "actor.pt holds a list",
    ),
}


def model_adapters() -> dict:
    """What the model holds: the payload's names, shapes and dtypes."""
    return payload(0)[0]


@pytest.mark.parametrize("damage", CONTENTS)
def test_a_newest_checkpoint_that_makes_no_sense_falls_back_to_the_older(tmp_path, caplog, damage):
    hurt, why = CONTENTS[damage]
    save_checkpoint(tmp_path, 1, *payload(1))
    save_checkpoint(tmp_path, 2, *payload(2))
    hurt(tmp_path / "step_000002")
    with caplog.at_level(logging.WARNING):
        ckpt = load_latest(tmp_path, model_adapters())
    assert ckpt.path == tmp_path / "step_000001" and ckpt.step == 1
    assert "skipping checkpoint step_000002: " in caplog.text and why in caplog.text
    assert "resuming from" in caplog.text and "step_000001" in caplog.text
    # the only checkpoint: a clear refusal naming it, never a start from step 0
    hurt(save_checkpoint(tmp_path / "only", 2, *payload(2)))
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints") as e:
        load_latest(tmp_path / "only", model_adapters())
    assert why in str(e.value)


def test_the_model_check_is_what_refuses_another_shape(tmp_path) -> None:
    """Without the model's adapters, a reshaped one is only checked for sense (``diffrl
    export`` reads checkpoints before any model is built)."""
    path = save_checkpoint(tmp_path, 1, *payload(1))
    edit_adapters(reshape)(path)
    assert load_checkpoint(path)[0][A].shape == (8, 8)
    with pytest.raises(CheckpointError, match="saved under other actor.lora settings"):
        load_checkpoint(path, model_adapters())


@pytest.mark.parametrize("saved_ema, model_ema", [(True, False), (False, True)])
def test_an_ema_adapter_switched_on_or_off_still_fits(tmp_path, saved_ema, model_ema) -> None:
    """``ActorEngine.load_state`` drops a saved EMA the model has no use for and starts a new
    one from the resumed weights: the check allows exactly that."""

    def with_ema(tensors: dict) -> dict:
        return {**tensors, "layer.lora_A.ema.weight": tensors[A].clone()}

    adapters, state, ctrl = payload(1)
    save_checkpoint(tmp_path, 1, with_ema(adapters) if saved_ema else adapters, state, ctrl)
    model = with_ema(model_adapters()) if model_ema else model_adapters()
    assert load_latest(tmp_path, model).step == 1
