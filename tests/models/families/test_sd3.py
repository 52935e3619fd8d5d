"""The SD3 / SD3.5 family on tiny random pipelines saved as diffusers directories."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
from diffrl.errors import ConfigError  # noqa: E402
from diffrl.models.families import sd3  # noqa: E402
from diffrl.models.family import EncodeCache, FamilyModel  # noqa: E402
from diffrl.models.registry import ModelConfig, load_model, lora_targets  # noqa: E402

from .conftest import BF16_REL_TOL  # noqa: E402

PROMPTS = ["a red circle on the left", "two blue squares"]


@pytest.fixture(scope="module")
def tiny(sd3_tiny_dir):
    return load_model(ModelConfig(family="sd3", path=str(sd3_tiny_dir)))


@pytest.fixture(scope="module")
def shapes(sd3_shapes_dir):
    return load_model(ModelConfig(family="sd3", path=str(sd3_shapes_dir)))


@pytest.mark.parametrize("preset", ["sd35-tiny", "sd3-shapes"])
def test_dir_loads_like_the_preset(preset, sd3_tiny_dir, sd3_shapes_dir):
    path = {"sd35-tiny": sd3_tiny_dir, "sd3-shapes": sd3_shapes_dir}[preset]
    loaded = load_model(ModelConfig(family="sd3", path=str(path)))
    built = load_model(ModelConfig(preset=preset))
    shapes_of = lambda m: {n: tuple(p.shape) for n, p in m.state_dict().items()}  # noqa: E731
    assert shapes_of(loaded) == shapes_of(built)
    assert loaded.family.latent_shape() == built.family.latent_shape()
    assert loaded.family.lens == built.family.lens
    assert loaded.family.tokenize(PROMPTS).hashes == built.family.tokenize(PROMPTS).hashes
    assert lora_targets(ModelConfig(preset=preset)) == sd3.LORA_TARGETS


def test_latent_shapes(tiny, shapes):
    assert tiny.family.latent_shape() == (16, 8, 8)  # 64 px through an 8x VAE
    assert shapes.family.latent_shape() == (3, 32, 32)  # pixel space


def test_bad_dirs_name_the_layout(sd3_tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="(?s)not a directory.*text_encoder_3/.*vae/"):
        load_model(ModelConfig(family="sd3", path=str(tmp_path / "nope")))
    broken = tmp_path / "broken"
    shutil.copytree(sd3_tiny_dir, broken)
    shutil.rmtree(broken / "tokenizer_3")
    with pytest.raises(ConfigError, match=r"(?s)lacks tokenizer_3/.*model_index.json"):
        load_model(ModelConfig(family="sd3", path=str(broken)))
    (broken / "model_index.json").unlink()
    with pytest.raises(ConfigError, match="model_index.json"):
        load_model(ModelConfig(family="sd3", path=str(broken)))
    novae = tmp_path / "novae"
    shutil.copytree(sd3_tiny_dir, novae)
    shutil.rmtree(novae / "vae")
    with pytest.raises(ConfigError, match="vae/"):
        load_model(ModelConfig(family="sd3", path=str(novae)))


def test_tokenize_once_no_drift(tiny):
    fam = tiny.family
    a, b = fam.tokenize(PROMPTS), fam.tokenize(PROMPTS)
    assert torch.equal(a.input_ids, b.input_ids) and a.hashes == b.hashes
    assert a.input_ids.shape == (2, sum(fam.lens)) and a.attention_mask.dtype == torch.bool
    assert len(set(a.hashes)) == 2
    # decode and re-tokenize (the drift contract 3 forbids): the specials become words
    clip_ids = a.input_ids[0, : fam.lens[0]]
    text = fam.tokenizers[0].decode(clip_ids, skip_special_tokens=False)
    assert fam.tokenize([text]).hashes[0] != a.hashes[0]
    # a prompt templated twice is a different row too
    assert fam.tokenize(["a photo of " + "a photo of " + PROMPTS[0]]).hashes[0] != a.hashes[0]
    assert torch.equal(fam.null_ids(), fam.tokenize([""]).input_ids[0])


def test_encode_cache_once_per_prompt(tiny):
    net = tiny.net
    net.cache = EncodeCache()
    calls = []
    encode = net.encode_uncached
    net.encode_uncached = lambda ids: calls.append(ids.shape[0]) or encode(ids)
    try:
        ids = tiny.family.tokenize(PROMPTS * 4).input_ids  # G = 4 repeats of 2 prompts
        prompt, pooled = net.conditions(ids)
        net.conditions(ids)
    finally:
        del net.encode_uncached
    assert calls == [2] and net.cache.misses == 2 and net.cache.hits == 14
    assert prompt.shape == (8, tiny.family.lens[0] + tiny.family.lens[2], 48)
    assert pooled.shape == (8, 40) and torch.equal(prompt[0], prompt[2])


@pytest.mark.parametrize("which", ["tiny", "shapes"])
def test_forward_batched_and_decode(which, tiny, shapes, family_inputs):
    model = {"tiny": tiny, "shapes": shapes}[which]
    fam = model.family
    x, sigma, ids = family_inputs(model)
    null = fam.null_ids().expand_as(ids)
    with torch.no_grad():  # cond and null rows stacked, as the engines' CFG does
        v = model(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([ids, null]))
        v0 = model(x[:1], sigma[:1], ids[:1])
    assert v.shape == (4, *fam.latent_shape()) and v.isfinite().all()
    assert torch.allclose(v[:1], v0, atol=1e-5)  # batching does not mix rows
    assert not torch.allclose(v[:2], v[2:])  # the prompt matters
    image = fam.decode(x)["image"]
    side = 64 if which == "tiny" else 32
    assert image.dtype == torch.uint8 and image.shape == (2, side, side, 3)
    pixels = torch.rand(2, 3, side, side) * 2 - 1
    assert fam.encode_pixels(pixels).shape == (2, *fam.latent_shape())
    assert fam.flops(2) > fam.flops(1) > 0


def test_wrong_convention_differs(tiny, family_inputs):
    x, sigma, ids = family_inputs(tiny)
    wrong = FamilyModel(tiny.net, tiny.family, "sigma")
    with torch.no_grad():
        assert tiny.convention.name == "sigma_x1000"
        assert not torch.allclose(wrong(x, sigma, ids), tiny(x, sigma, ids), atol=1e-4)


@pytest.mark.parametrize("which", ["tiny", "shapes"])
def test_serving_layout_sync_exact(which, tiny, shapes, family_sync_errors):
    err32, rel16, moved = family_sync_errors({"tiny": tiny, "shapes": shapes}[which])
    assert moved > 1e-3, "the LoRA update should move the output"
    assert err32 < 2e-6 and err32 < moved / 1000  # fp32: exact up to summation order
    assert rel16 < BF16_REL_TOL


def test_layout_leaves_actor_copy_alone(tiny):
    rollout = copy.deepcopy(tiny)
    tiny.family.serving_layout(rollout)
    assert "net.transformer.transformer_blocks.0.attn.to_q.weight" in tiny.state_dict()
    assert rollout.net.frozen is tiny.net.frozen  # encoders shared, not copied


def test_real_size_configs_on_meta():
    """The sd35-medium configs build at their published sizes (on meta: no memory)."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    p = sd3.PRESETS["sd35-medium"]
    with torch.device("meta"):
        dit = SD3Transformer2DModel.from_config(p["transformer"])
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**p["clip_g"]))
        t5 = T5EncoderModel(T5Config(**p["t5"]))
    count = lambda m: sum(q.numel() for q in m.parameters()) / 1e9  # noqa: E731
    assert 2.2 < count(dit) < 2.3  # SD3.5 Medium: 2.24 B + a 0.23 B position buffer
    assert 0.65 < count(clip_g) < 0.72 and 4.6 < count(t5) < 4.9
    assert dit.config.caption_projection_dim == 24 * 64
