"""The Qwen-Image family on a tiny random pipeline directory (CPU)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from diffrl.errors import ConfigError
from diffrl.models.families import qwen_image
from diffrl.models.registry import ModelConfig, family, load_model
from diffrl.sync.weights import SyncError

try:
    from ._qwen_wan_dirs import load_dir, rel_err, synced_pair, tiny_dir
except ImportError:
    from _qwen_wan_dirs import load_dir, rel_err, synced_pair, tiny_dir

SIZES = dict(resolution=32, max_text_len=16)
PROMPTS = ["a red circle", "two blue squares on the left of a green triangle"]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    return tiny_dir(tmp_path_factory, qwen_image, "qwen_image", "QwenImagePipeline")


@pytest.fixture(scope="module")
def model(pipe_dir):
    return load_dir("qwen_image", pipe_dir, **SIZES)


def test_loads_from_dir(model) -> None:
    fam = model.family
    assert family("qwen_image") is qwen_image.FAMILY
    assert fam.name == "qwen_image" and model.convention.name == "sigma"
    assert fam.latent_shape() == (16, 4, 4) and fam.media == {"image"}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in qwen_image.LORA_TARGETS:  # every explicit target names real Linears
        assert any(n.endswith("." + target) for n in linears), target
    assert not any(p.requires_grad for m in model.net.frozen_modules() for p in m.parameters())
    assert list(model.net.frozen.text_encoder.parameters())[0] not in set(model.parameters())


def test_preset_loads_random(model) -> None:
    m = load_model(ModelConfig(preset="qwen-image-tiny"))
    assert m.family.latent_shape() == model.family.latent_shape()
    with pytest.raises(ConfigError, match="model.path .* or model.preset"):
        qwen_image.load(ModelConfig(family="qwen_image"), torch.device("cpu"))


def test_missing_or_malformed_dir(pipe_dir, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"not a directory(.|\n)*text_encoder/"):
        load_dir("qwen_image", tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(pipe_dir, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(ConfigError, match=r"lacks vae/(.|\n)*AutoencoderKLQwenImage"):
        load_dir("qwen_image", broken)
    shutil.copytree(pipe_dir / "vae", broken / "vae")
    (broken / "transformer" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load QwenImageTransformer2DModel"):
        load_dir("qwen_image", broken)


def test_tokenize_once_with_the_template(model, pipe_dir) -> None:
    fam = model.family
    batch = fam.tokenize(PROMPTS)
    assert batch.input_ids.shape == (2, model.net.prefix_len + 16)
    assert torch.equal(batch.attention_mask, batch.input_ids != model.net.pad_id)
    # stable: again, and in a freshly loaded family
    assert fam.tokenize(PROMPTS).hashes == batch.hashes
    assert load_dir("qwen_image", pipe_dir, **SIZES).family.tokenize(PROMPTS).hashes == batch.hashes
    tokens = fam.tokenizer.convert_ids_to_tokens(batch.input_ids[0])
    assert tokens.count("<|im_start|>") == 3 and tokens[:2] == ["<|im_start|>", "system"]
    # contract 3: a second template, or decode-and-re-tokenize, is a different row
    twice = fam.tokenize([qwen_image.present(PROMPTS[0])])
    assert twice.hashes[0] != batch.hashes[0]
    text = fam.tokenizer.decode(batch.input_ids[0], skip_special_tokens=True)
    assert fam.tokenize([text]).hashes[0] != batch.hashes[0]
    null = fam.null_ids()
    assert torch.equal(null, fam.tokenize([qwen_image.NEGATIVE_PROMPT]).input_ids[0])
    assert fam.tokenizer.convert_ids_to_tokens(null).count("<|im_start|>") == 3


def test_encode_matches_the_pipeline(model, pipe_dir) -> None:
    """Our tokenize + encode == QwenImagePipeline.encode_prompt (template, prefix drop, mask)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(pipe_dir), local_files_only=True)
    pipe.prompt_template_encode_start_idx = model.net.prefix_len  # 34 for Qwen2's tokenizer
    ref, ref_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=16)
    txt, mask = model.net.conditions(model.family.tokenize(PROMPTS).input_ids)
    n = ref.shape[1]
    assert mask[:, n:].sum() == 0
    torch.testing.assert_close(mask[:, :n], ref_mask.bool())
    torch.testing.assert_close(txt[:, :n] * mask[:, :n, None], ref * ref_mask[..., None])


def test_cache_encodes_each_prompt_once(model) -> None:
    net, fam = model.net, model.family
    net.cache.store.clear()
    ids = fam.tokenize(["a red circle", "a blue square"]).input_ids.repeat_interleave(4, 0)
    x = torch.randn(8, *fam.latent_shape())
    misses = net.cache.misses
    with torch.no_grad():
        model(x, torch.full((8,), 0.5), ids)
        model(x, torch.full((8,), 0.2), ids)
    assert net.cache.misses - misses == 2


def test_forward_packs_as_the_pipeline(model) -> None:
    from diffusers import QwenImagePipeline

    fam = model.family
    x = torch.randn(3, *fam.latent_shape())
    packed = qwen_image.pack(x)
    assert torch.equal(packed, QwenImagePipeline._pack_latents(x, 3, 16, 4, 4))
    assert torch.equal(qwen_image.unpack(packed, 4, 4), x)
    ids = fam.tokenize(["a red circle", "one", "two green stars"]).input_ids
    with torch.no_grad():
        v = model(x, torch.tensor([0.1, 0.5, 0.9]), ids)
    assert v.shape == x.shape and torch.isfinite(v).all() and v.abs().max() > 0


def test_decode_and_encode_pixels(model) -> None:
    fam = model.family
    media = fam.decode(torch.randn(2, *fam.latent_shape()))
    assert media["image"].shape == (2, 32, 32, 3) and media["image"].dtype == torch.uint8
    z = fam.encode_pixels(torch.rand(2, 3, 32, 32) * 2 - 1)
    assert z.shape == (2, *fam.latent_shape()) and torch.isfinite(z).all()


def _outputs(base, *models, dtype=torch.float32):
    fam = base.family
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *fam.latent_shape(), generator=g).to(dtype)
    sigma, ids = torch.tensor([0.3, 0.8], dtype=dtype), fam.tokenize(PROMPTS).input_ids
    with torch.no_grad():
        return [m(x, sigma, ids) for m in models]


def test_fused_serving_layout_syncs_exactly_fp32(model) -> None:
    actor, rollout, update, report = synced_pair(model, qwen_image.LORA_TARGETS)
    n_blocks = len(model.net.transformer.transformer_blocks)
    assert report.applied == len(update.deltas) == n_blocks * len(qwen_image.LORA_TARGETS)
    attn = rollout.net.transformer.transformer_blocks[0].attn
    assert isinstance(attn.processor, qwen_image.FusedQKVProcessor)
    assert hasattr(attn, "to_qkv") and hasattr(attn, "to_added_qkv") and not hasattr(attn, "to_q")
    served, trained, plain = _outputs(model, rollout, actor, model)
    assert rel_err(plain, trained) > 1e-2  # the update is not a no-op
    torch.testing.assert_close(served, trained, rtol=1e-5, atol=1e-5)


def test_fused_serving_layout_in_bf16(model) -> None:
    """The same synced pair run in bf16: the rollout holds bf16(W + delta), the actor adds its
    LoRA branch in bf16; they agree to 3e-2 relative (bf16 is ~4e-3 per op), while the update
    moves the output by far more."""
    actor, rollout, _, _ = synced_pair(model, qwen_image.LORA_TARGETS)
    bf = [copy.deepcopy(m).to(torch.bfloat16) for m in (rollout, actor, model)]
    served, trained, plain = _outputs(model, *bf, dtype=torch.bfloat16)
    assert rel_err(served, trained) < 3e-2 < rel_err(plain, trained)


def test_bf16_rollout_applies_the_update(pipe_dir) -> None:
    """A bf16 rollout syncs (the checksum tolerance allows for rounding W + delta to bf16)."""
    base = load_dir("qwen_image", pipe_dir, dtype="bfloat16", **SIZES)
    actor, rollout, _, report = synced_pair(base, qwen_image.LORA_TARGETS)
    served, trained = _outputs(base, rollout, actor, dtype=torch.bfloat16)
    assert rel_err(served, trained) < 3e-2


def test_sync_refuses_a_partial_update(model) -> None:
    from diffrl.sync.weights import MergedLoraTarget, WeightUpdate

    _, _, update, _ = synced_pair(model, qwen_image.LORA_TARGETS)
    rollout = copy.deepcopy(model)
    slot_map = rollout.family.serving_layout(rollout)
    target = MergedLoraTarget(rollout, list(update.deltas), slot_map)
    dropped = "net.transformer.transformer_blocks.0.attn.add_k_proj"
    partial = {k: d for k, d in update.deltas.items() if k != dropped}
    with pytest.raises(SyncError, match="missing.*add_k_proj"):
        target.apply(WeightUpdate.build(2, "default", partial))


def test_flops_scale_with_batch_and_presets_are_real_size(model) -> None:
    assert model.family.flops(4) == pytest.approx(4 * model.family.flops(1))
    assert model.family.flops(1) > 0
    from diffusers import QwenImageTransformer2DModel

    spec = qwen_image.PRESETS["qwen-image"]
    with torch.device("meta"):
        t = QwenImageTransformer2DModel.from_config(spec["transformer"])
    assert sum(p.numel() for p in t.parameters()) == pytest.approx(20.4e9, rel=0.01)
    assert json.dumps(spec)  # plain data
