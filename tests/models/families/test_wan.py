"""The Wan family on a tiny random pipeline directory (CPU): 9 frames at 32x32."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from diffrl.errors import ConfigError
from diffrl.models.families import wan
from diffrl.models.registry import ModelConfig, family, load_model
from diffrl.sync.layouts import SwappedShards

try:
    from ._qwen_wan_dirs import load_dir, rel_err, synced_pair, tiny_dir
except ImportError:
    from _qwen_wan_dirs import load_dir, rel_err, synced_pair, tiny_dir

SIZES = dict(resolution=32, frames=9, max_text_len=16)
PROMPTS = ["a red circle above a dog", "two blue squares on the left of a green triangle"]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    return tiny_dir(tmp_path_factory, wan, "wan", "WanPipeline")


@pytest.fixture(scope="module")
def model(pipe_dir):
    return load_dir("wan", pipe_dir, **SIZES)


def test_loads_from_dir(model) -> None:
    fam = model.family
    assert family("wan") is wan.FAMILY
    assert fam.name == "wan" and model.convention.name == "sigma_x1000"
    assert fam.latent_shape() == (16, 3, 4, 4)  # (C, (9 - 1) / 4 + 1, 32 / 8, 32 / 8)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in wan.LORA_TARGETS:
        assert any(n.endswith("." + target) for n in linears), target


def test_preset_and_bad_sizes() -> None:
    m = load_model(ModelConfig(preset="wan-tiny"))
    assert m.family.latent_shape() == (16, 3, 4, 4)
    with pytest.raises(
        ConfigError, match="'model.frames' = 8: this wan model takes 1 \\+ a multiple of 4"
    ):
        load_model(ModelConfig(preset="wan-tiny", frames=8))


def test_missing_malformed_or_two_expert_dir(pipe_dir, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"not a directory(.|\n)*UMT5EncoderModel"):
        load_dir("wan", tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(pipe_dir, broken)
    (broken / "model_index.json").unlink()
    with pytest.raises(ConfigError, match=r"lacks model_index.json(.|\n)*AutoencoderKLWan"):
        load_dir("wan", broken)
    shutil.copy(pipe_dir / "model_index.json", broken / "model_index.json")
    (broken / "text_encoder" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load UMT5EncoderModel"):
        load_dir("wan", broken, **SIZES)
    two = tmp_path / "two"
    shutil.copytree(pipe_dir, two)
    index = json.loads((two / "model_index.json").read_text())
    index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
    (two / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="two-expert"):
        load_dir("wan", two, **SIZES)


def test_tokenize_once(model, pipe_dir) -> None:
    fam = model.family
    batch = fam.tokenize(PROMPTS)
    assert batch.input_ids.shape == (2, 16)
    assert torch.equal(batch.attention_mask, batch.input_ids != fam.tokenizer.pad_token_id)
    assert fam.tokenize(PROMPTS).hashes == batch.hashes
    assert load_dir("wan", pipe_dir, **SIZES).family.tokenize(PROMPTS).hashes == batch.hashes
    # the pipeline's prompt_clean is the presentation: messy whitespace is the same prompt
    assert fam.tokenize(["  a red\n circle   above a  dog "]).hashes[0] == batch.hashes[0]
    tokens = fam.tokenizer.convert_ids_to_tokens(batch.input_ids[0])
    assert (
        tokens[:6] == ["a", "red", "circle", "above", "a", "dog"]
        and tokens[6] == "</s>"
        and tokens[-1] == "<pad>"
    )
    # contract 3: decoding the ids and tokenizing that text again is another row
    text = fam.tokenizer.decode(batch.input_ids[0])
    assert fam.tokenize([text]).hashes[0] != batch.hashes[0]
    assert fam.tokenizer.convert_ids_to_tokens(fam.null_ids())[:2] == ["</s>", "<pad>"]


def test_encode_matches_the_pipeline(model, pipe_dir) -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(pipe_dir), local_files_only=True)
    ref, _ = pipe.encode_prompt(
        PROMPTS, do_classifier_free_guidance=False, max_sequence_length=16, device="cpu"
    )
    (txt,) = model.net.conditions(model.family.tokenize(PROMPTS).input_ids)
    torch.testing.assert_close(txt, ref)


def test_cache_encodes_each_prompt_once(model) -> None:
    net, fam = model.net, model.family
    net.cache.store.clear()
    ids = fam.tokenize(PROMPTS).input_ids.repeat_interleave(3, 0)
    x = torch.randn(6, *fam.latent_shape())
    misses = net.cache.misses
    with torch.no_grad():
        model(x, torch.full((6,), 0.5), ids)
        v = model(x, torch.full((6,), 0.2), ids)
    assert net.cache.misses - misses == 2
    assert v.shape == x.shape and torch.isfinite(v).all() and v.abs().max() > 0


def test_decode_video_fps_and_middle_frame(model) -> None:
    fam = model.family
    media = fam.decode(torch.randn(2, *fam.latent_shape()))
    video = media["video"]
    assert video.shape == (2, 9, 32, 32, 3) and video.dtype == torch.uint8
    assert media["fps"].dtype == torch.float32 and media["fps"].tolist() == [16.0, 16.0]
    assert torch.equal(media["image"], video[:, 4]) and set(media) == fam.media
    clip = fam.encode_pixels(torch.rand(2, 3, 9, 32, 32) * 2 - 1)
    still = fam.encode_pixels(torch.rand(2, 3, 32, 32) * 2 - 1)
    assert clip.shape == still.shape == (2, *fam.latent_shape())


def _outputs(base, *models, dtype=torch.float32):
    fam = base.family
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *fam.latent_shape(), generator=g).to(dtype)
    sigma, ids = torch.tensor([0.3, 0.8]), fam.tokenize(PROMPTS).input_ids
    with torch.no_grad():
        return [m(x, sigma, ids) for m in models]


def test_serving_layout_syncs_exactly_fp32(model) -> None:
    actor, rollout, update, report = synced_pair(model, wan.LORA_TARGETS)
    assert report.applied == len(update.deltas) == 2 * len(wan.LORA_TARGETS)
    block = rollout.net.transformer.blocks[0]
    assert block.attn1.fused_projections and not hasattr(block.attn1, "to_q")
    assert not block.attn2.fused_projections  # cross-attention stays unfused
    assert isinstance(block.ffn.net[0].proj, SwappedShards)
    served, trained, plain = _outputs(model, rollout, actor, model)
    assert rel_err(plain, trained) > 1e-2  # the update is not a no-op
    torch.testing.assert_close(served, trained, rtol=1e-5, atol=1e-5)


def test_serving_layout_in_bf16(model) -> None:
    """bf16(W + delta) in the re-laid rollout against the actor's bf16 LoRA branch: 3e-2
    relative (bf16 is ~4e-3 per op), far below what the update itself moves."""
    actor, rollout, _, _ = synced_pair(model, wan.LORA_TARGETS)
    bf = [copy.deepcopy(m).to(torch.bfloat16) for m in (rollout, actor, model)]
    served, trained, plain = _outputs(model, *bf, dtype=torch.bfloat16)
    assert rel_err(served, trained) < 3e-2 < rel_err(plain, trained)


def test_flops_and_real_size_preset(model) -> None:
    assert model.family.flops(3) == pytest.approx(3 * model.family.flops(1))
    assert model.family.flops(1) > 0
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        t = WanTransformer3DModel.from_config(wan.PRESETS["wan2.1-1.3b"]["transformer"])
    assert sum(p.numel() for p in t.parameters()) == pytest.approx(1.42e9, rel=0.01)


def test_decodes_from_two_threads_at_once() -> None:
    """The held-out eval decodes beside the next step's prefetched rollout: Wan's causal VAE
    keeps a per-instance feature cache, so its calls must not interleave (the family locks
    them; with ``vae_lock`` replaced by a no-op this raised a size mismatch from the decoder's
    cache in every run tried, as a two-step train run of wan-tiny did)."""
    import threading

    model = load_model(ModelConfig(preset="wan-tiny", resolution=32, frames=9))
    fam = model.family
    errors: list[BaseException] = []

    def decode(n: int) -> None:
        try:
            for _ in range(6):
                fam.decode(torch.randn(n, *fam.latent_shape()))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=decode, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
