"""`diffrl pretrain task=avbench` end to end at toy size: it trains the h3-avbench transformer,
writes a model.weights file whose metadata holds both modes' held-out scores, and the file
loads back as a run's base."""

from __future__ import annotations

import ast

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("diffusers")
from diffrl.errors import ConfigError  # noqa: E402
from diffrl.models.registry import ModelConfig, load_model  # noqa: E402
from diffrl.pretrain import load_pretrain_config, pretrain  # noqa: E402


def test_pretrain_avbench_writes_a_loadable_scored_base(tmp_path) -> None:
    out = tmp_path / "av.safetensors"
    cfg = load_pretrain_config(
        ["task=avbench", "steps=2", "batch=8", "chunk=4", "bank_per_prompt=1",
         "eval_samples=1", "audio_weight=4", "threads=1", f"out={out}"]
    )  # fmt: skip
    assert pretrain(cfg) == out
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    scores = ast.literal_eval(meta["avbench_eval"])
    assert set(scores) == {"avbench", "avbench_fl2va"}
    assert 0 <= scores["avbench_fl2va"]["eval/frames"] <= 1 and "eval/overall" in scores["avbench"]
    assert meta["preset"] == "h3-avbench" and meta["audio_weight"] == "4.0"
    mcfg = ModelConfig(family="minimax_h3", preset="h3-avbench", weights=str(out))
    trained = load_model(mcfg)
    fresh = load_model(ModelConfig(family="minimax_h3", preset="h3-avbench"))
    moved = [
        not torch.equal(a, b) for a, b in zip(trained.parameters(), fresh.parameters(), strict=True)
    ]
    assert any(moved)  # two steps moved the (EMA) transformer off the seeded init


def test_bad_pretrain_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="audio_weight"):
        load_pretrain_config(["task=avbench", "audio_weight=-1"])
    with pytest.raises(ConfigError, match="task"):
        load_pretrain_config(["task=music"])


def test_pretrain_avbench_starts_from_init_weights(tmp_path) -> None:
    """``init=`` continues from a file: with lr 0 the written base is the init, to the bit (a
    random start would differ), and the metadata names the init."""
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    common = ["task=avbench", "batch=4", "chunk=4", "bank_per_prompt=1", "eval_samples=1",
              "threads=1"]  # fmt: skip
    pretrain(load_pretrain_config([*common, "steps=2", f"out={first}"]))
    pretrain(load_pretrain_config([*common, "steps=1", "lr=0", f"init={first}", f"out={second}"]))
    with safe_open(str(first), "pt") as a, safe_open(str(second), "pt") as b:
        assert b.metadata()["init"] == str(first)
        names = set(a.keys())
        assert names == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in names)
    with pytest.raises(ConfigError, match="no file"):
        pretrain(load_pretrain_config([*common, "steps=1", f"init={tmp_path}/missing.safetensors"]))
