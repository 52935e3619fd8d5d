"""The LTX-2 family (text -> video + audio) on a tiny random pipeline directory (CPU): 9 frames
at 32x32 with 0.33 s of 16 kHz audio, one flat latent per sample, and 2 RL steps of the loop."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from diffrl.errors import ConfigError
from diffrl.models.families import ltx2
from diffrl.models.registry import ModelConfig, family, load_model
from diffrl.sync.layouts import RowView, SwappedShards

try:
    from ._qwen_wan_dirs import load_dir, rel_err, synced_pair, tiny_dir
except ImportError:
    from _qwen_wan_dirs import load_dir, rel_err, synced_pair, tiny_dir

SIZES = dict(resolution=32, frames=9, max_text_len=16)
PROMPTS = ["a red circle above a dog", "two blue squares on the left of a green triangle"]
D_VIDEO, D_AUDIO = 8 * 5 * 4 * 4, 4 * 9 * 4  # (C, (9-1)/2+1, 32/8, 32/8); (C_a, L_a, 16/4)


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    return tiny_dir(tmp_path_factory, ltx2, "ltx2", ltx2.PIPELINE)


@pytest.fixture(scope="module")
def model(pipe_dir):
    return load_dir("ltx2", pipe_dir, **SIZES)


def test_loads_from_dir(model) -> None:
    fam = model.family
    assert family("ltx2") is ltx2.FAMILY
    assert fam.name == "ltx2" and model.convention.name == "sigma_x1000"
    assert fam.latent_shape() == (D_VIDEO + D_AUDIO,)
    assert fam.geometry.video == (8, 5, 4, 4) and fam.geometry.audio == (4, 9, 4)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in ltx2.LORA_TARGETS:
        hits = [n for n in linears if n.endswith("." + target)]
        assert len(hits) == 2, target  # once per block: "attn1.*" never matches "audio_attn1.*"


def test_preset_and_bad_sizes() -> None:
    m = load_model(ModelConfig(preset="ltx2-tiny"))
    assert m.family.latent_shape() == (D_VIDEO + D_AUDIO,)
    with pytest.raises(ConfigError, match="frames 8 must be 1 \\+ a multiple of 2"):
        load_model(ModelConfig(preset="ltx2-tiny", frames=8))


def test_missing_or_malformed_dir(pipe_dir, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"not a directory(.|\n)*audio_vae/(.|\n)*LTX2Vocoder"):
        load_dir("ltx2", tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(pipe_dir, broken)
    shutil.rmtree(broken / "connectors")
    with pytest.raises(ConfigError, match=r"lacks connectors/(.|\n)*LTX2TextConnectors"):
        load_dir("ltx2", broken, **SIZES)
    shutil.copytree(pipe_dir / "connectors", broken / "connectors")
    (broken / "text_encoder" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load Gemma3ForConditionalGeneration"):
        load_dir("ltx2", broken, **SIZES)
    other = tmp_path / "other"
    shutil.copytree(pipe_dir, other)
    index = json.loads((other / "model_index.json").read_text())
    index["vocoder"] = ["diffusers", "LTX2VocoderWithBWE"]
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="LTX2VocoderWithBWE"):
        load_dir("ltx2", other, **SIZES)


def test_tokenize_once(model, pipe_dir) -> None:
    fam = model.family
    batch = fam.tokenize(PROMPTS)
    assert batch.input_ids.shape == (2, 16)
    assert torch.equal(batch.attention_mask, batch.input_ids != fam.tokenizer.pad_token_id)
    assert fam.tokenize(PROMPTS).hashes == batch.hashes
    assert load_dir("ltx2", pipe_dir, **SIZES).family.tokenize(PROMPTS).hashes == batch.hashes
    # the pipeline's strip is the presentation; Gemma's <bos> opens, padding is on the left
    assert fam.tokenize(["  a red circle above a dog \n"]).hashes[0] == batch.hashes[0]
    tokens = fam.tokenizer.convert_ids_to_tokens(batch.input_ids[0])
    assert tokens[-7:] == ["<bos>", "a", "red", "circle", "above", "a", "dog"]
    assert tokens[0] == "<pad>"
    # contract 3: decoding the ids and tokenizing that text again is another row (a 2nd <bos>)
    text = fam.tokenizer.decode(batch.input_ids[0])
    assert fam.tokenize([text]).hashes[0] != batch.hashes[0]
    assert fam.tokenizer.convert_ids_to_tokens(fam.null_ids())[-2:] == ["<pad>", "<bos>"]


def test_encode_matches_the_pipeline(model) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    f = model.net.frozen  # the pipeline built on the very components the family loaded
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=f.vae,
        audio_vae=f.audio_vae,
        text_encoder=f.text_encoder,
        tokenizer=model.family.tokenizer,
        connectors=f.connectors,
        transformer=model.net.transformer,
        vocoder=f.vocoder,
    )
    embeds, mask, _, _ = pipe.encode_prompt(
        PROMPTS, do_classifier_free_guidance=False, max_sequence_length=16, device="cpu"
    )
    ref = pipe.connectors(embeds, mask, padding_side="left")
    got = model.net.conditions(model.family.tokenize(PROMPTS).input_ids)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r)


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
    assert v.shape == x.shape and torch.isfinite(v).all()
    # both modalities come back: the video part and the audio part each move
    assert v[:, :D_VIDEO].abs().max() > 0 and v[:, D_VIDEO:].abs().max() > 0


def test_forward_is_the_transformer_on_packed_tokens(model) -> None:
    """The flat x is the pipeline's two latents: packing them by hand and calling the
    transformer as the pipeline does gives the same velocity, with timestep = 1000 sigma."""
    from diffusers import LTX2Pipeline

    fam, net = model.family, model.net
    x = torch.randn(2, *fam.latent_shape(), generator=torch.Generator().manual_seed(0))
    sigma, ids = torch.tensor([0.3, 0.8]), fam.tokenize(PROMPTS).input_ids
    video = x[:, :D_VIDEO].reshape(2, 8, 5, 4, 4)
    audio = x[:, D_VIDEO:].reshape(2, 4, 9, 4)
    vtxt, atxt, mask = net.conditions(ids)
    with torch.no_grad():
        out_v, out_a = net.transformer(
            hidden_states=LTX2Pipeline._pack_latents(video),
            audio_hidden_states=LTX2Pipeline._pack_audio_latents(audio),
            encoder_hidden_states=vtxt,
            audio_encoder_hidden_states=atxt,
            timestep=1000 * sigma,
            sigma=1000 * sigma,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=5,
            height=4,
            width=4,
            fps=24.0,
            audio_num_frames=9,
            use_cross_timestep=True,
            return_dict=False,
        )
        v = model(x, sigma, ids)
    torch.testing.assert_close(
        v[:, :D_VIDEO], out_v.reshape(2, 5, 4, 4, 8).permute(0, 4, 1, 2, 3).flatten(1)
    )
    torch.testing.assert_close(v[:, D_VIDEO:], out_a.reshape(2, 9, 4, 4).transpose(1, 2).flatten(1))


def test_wrong_convention_differs(pipe_dir) -> None:
    right = load_dir("ltx2", pipe_dir, **SIZES)
    wrong = load_model(ModelConfig(family="ltx2", path=str(pipe_dir), convention="sigma", **SIZES))
    fam = right.family
    x = torch.randn(2, *fam.latent_shape(), generator=torch.Generator().manual_seed(2))
    sigma, ids = torch.tensor([0.3, 0.8]), fam.tokenize(PROMPTS).input_ids
    with torch.no_grad():
        assert rel_err(wrong(x, sigma, ids), right(x, sigma, ids)) > 1e-3


def test_decode_video_audio_and_middle_frame(model) -> None:
    fam = model.family
    media = fam.decode(torch.randn(2, *fam.latent_shape()))
    video, audio = media["video"], media["audio"]
    assert video.shape == (2, 9, 32, 32, 3) and video.dtype == torch.uint8
    assert media["fps"].dtype == torch.float32 and media["fps"].tolist() == [24.0, 24.0]
    assert torch.equal(media["image"], video[:, 4]) and set(media) == fam.media
    # 9 latent frames -> 33 mel frames (causal x4) -> 33 * 160 samples at 16 kHz: < 1 s
    assert audio.shape == (2, 33 * 160) and audio.dtype == torch.float32
    assert audio.abs().max() <= 1 and torch.isfinite(audio).all()
    assert media["sample_rate"].tolist() == [16000.0, 16000.0]
    clip = fam.encode_pixels(torch.rand(2, 3, 9, 32, 32) * 2 - 1)
    still = fam.encode_pixels(torch.rand(2, 3, 32, 32) * 2 - 1)
    assert clip.shape == still.shape == (2, *fam.latent_shape())
    assert still[:, D_VIDEO:].abs().max() == 0  # pixels carry no sound


def _outputs(base, *models, dtype=torch.float32):
    fam = base.family
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *fam.latent_shape(), generator=g).to(dtype)
    sigma, ids = torch.tensor([0.3, 0.8]), fam.tokenize(PROMPTS).input_ids
    with torch.no_grad():
        return [m(x, sigma, ids) for m in models]


def test_serving_layout_syncs_exactly_fp32(model) -> None:
    actor, rollout, update, report = synced_pair(model, ltx2.LORA_TARGETS)
    assert report.applied == len(update.deltas) == 2 * len(ltx2.LORA_TARGETS)
    block = rollout.net.transformer.transformer_blocks[0]
    for attn in (block.attn1, block.audio_attn1):
        assert isinstance(attn.to_qkv, torch.nn.Linear) and isinstance(attn.to_q, RowView)
    assert not hasattr(block.attn2, "to_qkv")  # cross-attentions stay unfused
    assert not hasattr(block.audio_to_video_attn, "to_qkv")
    assert isinstance(block.ff.net[0].proj, SwappedShards)
    assert isinstance(block.audio_ff.net[0].proj, SwappedShards)
    served, trained, plain = _outputs(model, rollout, actor, model)
    assert rel_err(plain, trained) > 1e-2  # the update is not a no-op
    torch.testing.assert_close(served, trained, rtol=1e-5, atol=1e-5)


def test_serving_layout_in_bf16(model) -> None:
    """bf16(W + delta) in the re-laid rollout against the actor's bf16 LoRA branch: 3e-2
    relative (bf16 is ~4e-3 per op), far below what the update itself moves."""
    actor, rollout, _, _ = synced_pair(model, ltx2.LORA_TARGETS)
    bf = [copy.deepcopy(m).to(torch.bfloat16) for m in (rollout, actor, model)]
    served, trained, plain = _outputs(model, *bf, dtype=torch.bfloat16)
    assert rel_err(served, trained) < 3e-2 < rel_err(plain, trained)


def test_flops_and_real_size_preset(model) -> None:
    assert model.family.flops(3) == pytest.approx(3 * model.family.flops(1))
    assert model.family.flops(1) > 0
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        t = LTX2VideoTransformer3DModel.from_config(ltx2.PRESETS["ltx2"]["transformer"])
    assert sum(p.numel() for p in t.parameters()) == pytest.approx(18.88e9, rel=0.01)


def test_parity_probe_sees_the_audio_normalisation(monkeypatch) -> None:
    """The pipeline normalises the audio latents it is handed (the video ones it takes packed, as
    they are): with the VAEs' latent statistics away from 0 and 1, the reference still feeds the
    transformer diffrl's own latents, and handing it the audio undenormalised is caught."""
    from diffusers import LTX2Pipeline

    from diffrl.errors import ContractError
    from diffrl.models.probe import pipeline_parity
    from diffrl.rollout.samplers import euler_step, sigma_schedule

    model = load_model(ModelConfig(preset="ltx2-tiny"))
    g = torch.Generator().manual_seed(3)
    for vae in (model.net.frozen.vae, model.net.frozen.audio_vae):
        n = vae.latents_mean.numel()
        vae.latents_mean.copy_(torch.randn(n, generator=g))
        vae.latents_std.copy_(0.5 + torch.rand(n, generator=g))

    def parity():
        return pipeline_parity(model, sigma_schedule, euler_step, 4, 3.0, "a red circle")

    assert parity().worst < 1.0
    undone = staticmethod(lambda x, mean, std: x)
    monkeypatch.setattr(LTX2Pipeline, "_denormalize_audio_latents", undone)
    with pytest.raises(ContractError, match="call 0: .*audio_hidden_states"):
        parity()
