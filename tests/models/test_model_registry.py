"""Saving / loading model checkpoints and the tiny DiT's interface."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from diffrl.errors import ConfigError
from diffrl.models.families.tiny_dit import read_metadata, resolve_checkpoint, save_model
from diffrl.models.registry import ModelConfig, load_model, lora_targets
from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS


def inputs(tok, n=2):
    g = torch.Generator().manual_seed(0)
    ids = tok.encode(["a red circle", "two blue squares on the left"][:n])
    return torch.randn(n, 3, 32, 32, generator=g), torch.tensor([0.3, 0.8])[:n], ids


def test_save_load_round_trip(tiny_model, tiny_checkpoint, tok) -> None:
    meta = read_metadata(tiny_checkpoint)
    assert meta["family"] == "tiny_dit" and meta["convention"] == "sigma"
    model = load_model(ModelConfig(checkpoint=str(tiny_checkpoint)))
    assert model.net.cfg == tiny_model.net.cfg and model.net.cfg.hidden == 32
    x, sigma, ids = inputs(tok)
    with torch.no_grad():
        torch.testing.assert_close(model(x, sigma, ids), tiny_model(x, sigma, ids))
        assert tiny_model(x, sigma, ids).abs().max() > 1e-3


def test_load_with_dtype_and_convention(tiny_checkpoint) -> None:
    model = load_model(
        ModelConfig(checkpoint=str(tiny_checkpoint), dtype="bfloat16", convention="sigma_x1000")
    )
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.convention.name == "sigma_x1000"


def test_save_writes_extra_metadata(tiny_model, tmp_path) -> None:
    path = tmp_path / "sub" / "m.safetensors"
    save_model(tiny_model, path, {"note": "hello"})
    assert read_metadata(path)["note"] == "hello"


def test_bad_checkpoints(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        resolve_checkpoint(str(tmp_path / "missing.safetensors"))
    bare = tmp_path / "bare.safetensors"
    save_file({"w": torch.zeros(2)}, str(bare))
    with pytest.raises(ConfigError, match="no 'arch' metadata"):
        load_model(ModelConfig(checkpoint=str(bare)))


def test_wrong_keys_are_reported(tiny_model, tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    save_model(tiny_model, path)
    from safetensors.torch import load_file

    state = load_file(str(path))
    state.pop("patch_out.weight")
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(path), metadata=read_metadata(path))
    with pytest.raises(ConfigError, match="patch_out.weight"):
        load_model(ModelConfig(checkpoint=str(path)))


def test_builtin_resolves_and_lora_targets() -> None:
    assert resolve_checkpoint("builtin:shapes_dit").is_file()
    assert resolve_checkpoint("builtin:shapes_dit_v2").is_file()
    assert lora_targets(ModelConfig(family="tiny_dit")) == TINY_DIT_LORA_TARGETS
    assert "all-linear" not in TINY_DIT_LORA_TARGETS


def test_tiny_dit_shapes_and_text_limit(tiny_model, tok) -> None:
    x, sigma, ids = inputs(tok)
    with torch.no_grad():
        out = tiny_model(x, sigma, ids)
        assert out.shape == x.shape
        # a scalar sigma is broadcast over the batch
        torch.testing.assert_close(tiny_model(x, torch.tensor(0.3), ids)[0], out[0])
        # the prompt matters (text tokens are attended to) and padding is masked out
        other = tok.encode(["a green triangle", "a green triangle"])
        assert (tiny_model(x, sigma, other) - out).abs().max() > 1e-5
        torch.testing.assert_close(tiny_model(x, sigma, ids[:, :6]), out, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_text_len"):
        tiny_model(x, sigma, torch.ones(2, 13, dtype=torch.long))


def test_patchify_round_trip(tiny_model) -> None:
    x = torch.randn(2, 3, 32, 32)
    net = tiny_model.net
    patches = net.patchify(x)
    assert patches.shape == (2, 64, 48)
    torch.testing.assert_close(net.unpatchify(patches), x)
    # patch 0 is the top-left 4x4 block, channel-major
    torch.testing.assert_close(patches[0, 0], x[0, :, :4, :4].reshape(-1))
