"""The FLUX.1 family on a tiny random pipeline saved as a diffusers directory."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("diffusers")
from diffrl.errors import ConfigError  # noqa: E402
from diffrl.models.families import flux  # noqa: E402
from diffrl.models.family import EncodeCache, FamilyModel  # noqa: E402
from diffrl.models.registry import ModelConfig, load_model, lora_targets  # noqa: E402

from .conftest import BF16_REL_TOL  # noqa: E402

PROMPTS = ["a red circle on the left", "two blue squares"]


@pytest.fixture(scope="module")
def tiny(flux_tiny_dir):
    return load_model(ModelConfig(family="flux", path=str(flux_tiny_dir)))


def test_dir_loads_like_the_preset(tiny):
    built = load_model(ModelConfig(preset="flux1-tiny"))
    shapes_of = lambda m: {n: tuple(p.shape) for n, p in m.state_dict().items()}  # noqa: E731
    assert shapes_of(tiny) == shapes_of(built)
    assert tiny.family.latent_shape() == built.family.latent_shape() == (16, 8, 8)
    assert tiny.family.tokenize(PROMPTS).hashes == built.family.tokenize(PROMPTS).hashes
    assert lora_targets(ModelConfig(preset="flux1-tiny")) == flux.LORA_TARGETS


def test_bad_dirs_name_the_layout(flux_tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="(?s)not a directory.*text_encoder_2/.*vae/"):
        load_model(ModelConfig(family="flux", path=str(tmp_path / "nope")))
    broken = tmp_path / "broken"
    shutil.copytree(flux_tiny_dir, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(ConfigError, match="(?s)lacks vae/.*FluxTransformer2DModel"):
        load_model(ModelConfig(family="flux", path=str(broken)))


def test_pack_round_trip():
    x = torch.randn(2, 16, 8, 6)
    packed = flux.pack(x)
    assert packed.shape == (2, 12, 64)
    assert torch.equal(flux.unpack(packed, 8, 6), x)
    ids = flux.image_ids(4, 3, "cpu", torch.float32)
    assert ids.shape == (12, 3) and ids[5].tolist() == [0.0, 1.0, 2.0]


def test_tokenize_once_no_drift(tiny):
    fam = tiny.family
    a, b = fam.tokenize(PROMPTS), fam.tokenize(PROMPTS)
    assert torch.equal(a.input_ids, b.input_ids) and a.hashes == b.hashes
    assert a.input_ids.shape == (2, sum(fam.lens))
    t5_ids = a.input_ids[0, fam.lens[0] :]
    text = fam.tokenizers[1].decode(t5_ids, skip_special_tokens=False)
    assert fam.tokenize([text]).hashes[0] != a.hashes[0]


def test_encode_cache_once_per_prompt(tiny):
    net = tiny.net
    net.cache = EncodeCache()
    ids = tiny.family.tokenize(PROMPTS * 4).input_ids  # G = 4 repeats of 2 prompts
    prompt, pooled = net.conditions(ids)
    assert net.cache.misses == 2 and net.cache.hits == 6
    assert prompt.shape == (8, tiny.family.lens[1], 32) and pooled.shape == (8, 16)


def test_forward_batched_guidance_and_decode(tiny, family_inputs):
    fam = tiny.family
    x, sigma, ids = family_inputs(tiny)
    null = fam.null_ids().expand_as(ids)
    with torch.no_grad():
        v = tiny(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([ids, null]))
        v0 = tiny(x[:1], sigma[:1], ids[:1])
        tiny.net.guidance = 1.0
        try:
            v_g1 = tiny(x[:1], sigma[:1], ids[:1])
        finally:
            tiny.net.guidance = flux.DEFAULT_GUIDANCE
    assert v.shape == (4, 16, 8, 8) and v.isfinite().all()
    assert torch.allclose(v[:1], v0, atol=1e-5)
    assert not torch.allclose(v0, v_g1)  # the guidance input reaches the transformer
    image = fam.decode(x)["image"]
    assert image.dtype == torch.uint8 and image.shape == (2, 64, 64, 3)
    assert fam.encode_pixels(torch.rand(2, 3, 64, 64) * 2 - 1).shape == (2, 16, 8, 8)
    assert fam.flops(2) > fam.flops(1) > 0


def test_convention_is_sigma(tiny, family_inputs):
    x, sigma, ids = family_inputs(tiny)
    assert tiny.convention.name == "sigma"  # FluxPipeline passes timestep / 1000
    wrong = FamilyModel(tiny.net, tiny.family, "sigma_x1000")
    with torch.no_grad():
        assert not torch.allclose(wrong(x, sigma, ids), tiny(x, sigma, ids), atol=1e-4)


def test_serving_layout_uses_diffusers_fused_path(tiny, family_sync_errors):
    import copy

    rollout = copy.deepcopy(tiny)
    tiny.family.serving_layout(rollout)
    names = dict(rollout.named_modules())
    attn = names["net.transformer.transformer_blocks.0.attn"]
    assert attn.fused_projections and not hasattr(attn, "to_q")
    assert "net.transformer.single_transformer_blocks.0.attn.to_qkv" in names
    assert "net.transformer.single_transformer_blocks.0.proj_mlp.shards.1" in names
    err32, rel16, moved = family_sync_errors(tiny)
    assert moved > 1e-3
    assert err32 < 2e-6 and err32 < moved / 1000
    assert rel16 < BF16_REL_TOL


def test_real_size_config_on_meta():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        dit = FluxTransformer2DModel.from_config(flux.PRESETS["flux1-dev"]["transformer"])
    n = sum(p.numel() for p in dit.parameters()) / 1e9
    assert 11.8 < n < 12.0  # FLUX.1-dev: 11.9 B
