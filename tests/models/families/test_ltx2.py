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


# --- frame conditions: I2AV (first frame) and FL2VA (first and last) --------------------------

N_FIRST = 4 * 4  # frame 0's tokens: the 4 x 4 latent grid (patch 1)


def _frames(k: int, seed: int = 0):
    """k conditions per prompt for the 2 prompts, (H, W, 3) uint8 each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    keys = ("first_frame", "last_frame")[:k]
    return [
        {key: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for key in keys} for _ in PROMPTS
    ]


def _sample(model, cond, steps: int = 3):
    """An Euler ODE sample, as the rollout's ODE sampler steps it."""
    from diffrl.rollout.samplers import euler_step, sigma_schedule

    fam = model.family
    ids = fam.tokenize(PROMPTS).input_ids
    x = torch.randn(2, *fam.latent_shape(), generator=torch.Generator().manual_seed(4))
    sigmas = sigma_schedule(steps, 3.0)
    with torch.no_grad():
        for i in range(steps):
            s = sigmas[i].expand(2)
            x = euler_step(x, model(x, s, ids, cond=cond), s, sigmas[i + 1].expand(2))
    return x


@pytest.mark.parametrize("k", [1, 2])
def test_frame_conditions_are_the_pipelines_and_come_out_held(model, k) -> None:
    """The first frame's latent is what LTX2ImageToVideoPipeline puts at latent frame 0 (its
    mask 1 there), and a sample comes out with exactly it at frame 0 (the decoded frame is
    then the VAE's round trip of the given one); FL2VA's last frame moves the other frames."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2ImageToVideoPipeline

    from diffrl.types import images_from_uint8

    fam, f = model.family, model.net.frozen
    conds = _frames(k)
    cond = fam.encode_conditions(conds)
    assert cond.shape == (2, k, 8, 1, 4, 4) and cond.dtype == torch.float32
    pipe = LTX2ImageToVideoPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=f.vae, audio_vae=f.audio_vae,
        text_encoder=f.text_encoder, tokenizer=fam.tokenizer, connectors=f.connectors,
        transformer=model.net.transformer, vocoder=f.vocoder,
    )  # fmt: skip
    first = torch.stack([torch.from_numpy(c["first_frame"]) for c in conds])
    with torch.no_grad():
        packed, mask = pipe.prepare_latents(
            images_from_uint8(first), 2, 8, 32, 32, 9, dtype=torch.float32,
            device=torch.device("cpu"), generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    assert mask[:, :N_FIRST].eq(1).all() and mask[:, N_FIRST:].eq(0).all()
    torch.testing.assert_close(packed[:, :N_FIRST], cond[:, 0].flatten(2).transpose(1, 2))

    x0 = _sample(model, cond)
    video, _ = fam.geometry.unflatten(x0)
    torch.testing.assert_close(video[:, :, :1], cond[:, 0], rtol=0, atol=1e-5)
    assert (video[:, :, 1:] - cond[:, 0]).abs().max() > 0.1  # the other frames are generated
    if k == 2:  # the appended last frame reaches the generated frames
        other = cond.clone()
        other[:, 1] = torch.randn_like(other[:, 1])
        moved = fam.geometry.unflatten(_sample(model, other))[0]
        assert (moved[:, :, 1:] - video[:, :, 1:]).abs().max() > 1e-3
        torch.testing.assert_close(moved[:, :, :1], video[:, :, :1], rtol=0, atol=1e-5)


def test_conditioning_tokens_are_clean_and_carry_no_gradient_or_loss(model) -> None:
    """What the transformer is handed (frame 0's tokens = the first frame's latent, the last
    frame's appended, both at timestep 0, the last placed at the clip's last pixel frame),
    and that no parameter and no condition gets gradient through them: frame 0's velocity
    is (x - condition) / sigma, so with x0's frame 0 the condition its flow-matching loss is 0."""
    from diffrl.models.family import noised

    fam, net = model.family, model.net
    cond = fam.encode_conditions(_frames(2, seed=1))
    seen = {}

    def grab(module, args, kwargs):
        seen.update(kwargs)

    hook = net.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    sigma, ids = torch.tensor([0.3, 0.8]), fam.tokenize(PROMPTS).input_ids
    x0 = torch.randn(2, *fam.latent_shape(), generator=torch.Generator().manual_seed(5))
    video0, _ = fam.geometry.unflatten(x0)
    video0[:, :, :1] = cond[:, 0]  # a sample that came out holding its first frame
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(6))
    x = noised(x0, sigma, eps)
    leaf = cond.clone().requires_grad_(True)
    try:
        v = model(x, sigma, ids, cond=leaf)
    finally:
        hook.remove()
    tokens, t = seen["hidden_states"], seen["timestep"]
    n = 5 * N_FIRST
    assert tokens.shape[1] == t.shape[1] == n + N_FIRST  # the last frame: 16 tokens appended
    torch.testing.assert_close(tokens[:, :N_FIRST], cond[:, 0].flatten(2).transpose(1, 2))
    torch.testing.assert_close(tokens[:, n:], cond[:, 1].flatten(2).transpose(1, 2))
    assert t[:, :N_FIRST].eq(0).all() and t[:, n:].eq(0).all()
    torch.testing.assert_close(t[:, N_FIRST:n], (1000 * sigma)[:, None].expand(2, n - N_FIRST))
    assert seen["audio_timestep"].shape == (2,)
    frame_span = seen["video_coords"][:, 0, n:]  # (start, end) in seconds: frame 8 of 0..8
    torch.testing.assert_close(frame_span, torch.tensor([8.0, 9.0]).expand_as(frame_span) / 24)

    d0 = N_FIRST * 8  # frame 0's entries are the first of the video part (C, F, h, w) ...
    video_v, _ = fam.geometry.unflatten(v)
    target, _ = fam.geometry.unflatten(eps - x0)
    torch.testing.assert_close(video_v[:, :, 0], target[:, :, 0], rtol=0, atol=1e-5)
    assert (video_v[:, :, 1:] - target[:, :, 1:]).abs().max() > 0.1
    video_v[:, :, 0].sum().backward()  # ... and no parameter is reached from them
    grads = [p.grad for p in net.transformer.parameters() if p.grad is not None]
    assert all(g.abs().max() == 0 for g in grads) and d0 > 0
    assert leaf.grad is None
    model.zero_grad(set_to_none=True)
    video_v2, _ = fam.geometry.unflatten(model(x, sigma, ids, cond=leaf))
    video_v2[:, :, 1:].pow(2).mean().backward()  # the generated frames do train
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in net.transformer.parameters())
    assert leaf.grad is None
    model.zero_grad(set_to_none=True)


def test_conditions_hash_and_conditioned_block(model) -> None:
    """The frames' latents are hashed like input_ids: one changed pixel of one prompt's last
    frame changes that row's hash alone; ``family.conditioned`` scopes a block's keyframes."""
    from diffrl.types import hash_cond_rows

    fam = model.family
    conds = _frames(2, seed=2)
    cond = fam.encode_conditions(conds)
    assert hash_cond_rows(fam.encode_conditions(conds)) == hash_cond_rows(cond)
    conds[1]["last_frame"] = conds[1]["last_frame"].copy()
    conds[1]["last_frame"][5, 7, 0] ^= 0x40
    other = hash_cond_rows(fam.encode_conditions(conds))
    assert other[0] == hash_cond_rows(cond)[0] and other[1] != hash_cond_rows(cond)[1]
    i2av = hash_cond_rows(fam.encode_conditions([{"first_frame": c["first_frame"]} for c in conds]))
    assert i2av[0] != hash_cond_rows(cond)[0]  # I2AV's rows are not FL2VA's

    x = torch.randn(2, *fam.latent_shape(), generator=torch.Generator().manual_seed(7))
    sigma, ids = torch.tensor([0.4, 0.6]), fam.tokenize(PROMPTS).input_ids
    with torch.no_grad():
        direct, plain = model(x, sigma, ids, cond=cond), model(x, sigma, ids)
        with fam.conditioned(model, cond) as held:
            scoped = held(x, sigma, ids)
        assert model.net.keyframes is None
        torch.testing.assert_close(scoped, direct, rtol=0, atol=0)
        torch.testing.assert_close(model(x, sigma, ids), plain, rtol=0, atol=0)  # T2VA again


def test_unsupported_conditions_are_refused(model) -> None:
    from dataclasses import replace

    from diffrl.errors import ContractError

    fam = model.family
    frames = _frames(2)
    with pytest.raises(ConfigError, match=r"config key 'data.task'.*this task gives ref_image"):
        fam.encode_conditions([{"ref_image": f["first_frame"]} for f in frames])
    with pytest.raises(ConfigError, match=r"'data.task'.*per row"):  # rows of two modes
        fam.encode_conditions([frames[0], {"first_frame": frames[1]["first_frame"]}])
    with pytest.raises(ConfigError, match="'data.task'.*none"):
        fam.encode_conditions([])
    geometry = fam.geometry
    model.net.geometry = replace(geometry, video=(8, 1, 4, 4))  # a one-latent-frame clip
    try:
        with pytest.raises(ConfigError, match=r"'model.frames' = 9: .*here 1\)"):
            fam.encode_conditions(frames)
    finally:
        model.net.geometry = geometry
    cond = fam.encode_conditions(frames)
    x, ids = torch.randn(2, *fam.latent_shape()), fam.tokenize(PROMPTS).input_ids
    with pytest.raises(ContractError, match=r"expected \(B, K, 8, 1, 4, 4\)"):
        model(x, torch.tensor([0.5, 0.5]), ids, cond=cond[:, :, :, :, :2])
    with pytest.raises(ContractError, match="K = 1 .I2AV. or 2"):
        model(x, torch.tensor([0.5, 0.5]), ids, cond=torch.cat([cond, cond], 1))
    with pytest.raises(ConfigError, match="K 1"), fam.conditioned(model, cond[:, 0]):
        pass
