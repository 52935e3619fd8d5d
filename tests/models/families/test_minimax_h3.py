"""The MiniMax-H3 family on a tiny random pipeline directory (CPU): 8 frames of 32 x 32 px video
and 0.5 s of 8 kHz audio in one packed sequence, through the real MiniMaxH3Transformer3DModel,
both MiniMax-H3 VAEs and a 2-layer Qwen3-VL text encoder."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from diffrl.errors import ConfigError, ContractError, FieldError
from diffrl.models.convention import noised, probe_convention
from diffrl.models.family import FamilyModel
from diffrl.models.host_offload import HostResident
from diffrl.models.probe import NoReference
from diffrl.models.registry import ModelConfig, family, load_model

pytest.importorskip("diffusers")
from diffrl.models.families import minimax_h3  # noqa: E402

try:
    from .conftest import BF16_REL_TOL
except ImportError:
    from conftest import BF16_REL_TOL

PROMPTS = ["a red circle above a dog", "two blue squares on the left of a green triangle"]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return minimax_h3.save_tiny(tmp_path_factory.mktemp("h3") / "pipe")


@pytest.fixture(scope="module")
def model(pipe_dir):
    return load_model(ModelConfig(family="minimax_h3", path=str(pipe_dir)))


def test_loads_from_dir(model, pipe_dir) -> None:
    fam, net = model.family, model.net
    assert family("minimax_h3") is minimax_h3.FAMILY
    assert fam.name == "minimax_h3" and model.convention.name == "data_progress"
    # video (4, 5, 8, 8) = 1280 then audio (1 channel, 20 latents, 4) = 80, flat
    assert net.video_shape == (4, 5, 8, 8) and net.audio_shape == (1, 20, 4)
    assert fam.latent_shape() == (1360,)
    assert net.k == pytest.approx(3.0 / 12.0)  # read from the two schedulers in the directory
    assert 2e4 < sum(p.numel() for p in model.parameters()) < 5e5
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for target in minimax_h3.LORA_TARGETS:
        assert any(n.endswith("." + target) for n in linears), target
    assert 2 * fam.flops(1) > fam.flops(2) > fam.flops(1) > 0  # one call: its time MLP once
    preset = load_model(ModelConfig(preset="h3-tiny"))
    assert preset.family.latent_shape() == fam.latent_shape()
    # a raw decoder output, not the last (post-norm) entry: layer 1 of the tiny encoder's 2
    assert net.text_layer == preset.net.text_layer == 1


def test_missing_or_malformed_dir(pipe_dir, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"not a directory(.|\n)*AutoencoderKLMiniMaxH3Audio"):
        load_model(ModelConfig(family="minimax_h3", path=str(tmp_path / "nowhere")))
    broken = tmp_path / "broken"
    shutil.copytree(pipe_dir, broken)
    shutil.rmtree(broken / "audio_vae")
    with pytest.raises(ConfigError, match=r"lacks audio_vae/(.|\n)*audio_scheduler"):
        load_model(ModelConfig(family="minimax_h3", path=str(broken)))
    with pytest.raises(ConfigError, match=r"model.frames = 9: .* 5 n \+ 3 frames \(n >= 1: 8, 13"):
        load_model(ModelConfig(preset="h3-tiny", frames=9))


def test_real_size_dit_on_meta() -> None:
    """The release's DiT (the class defaults), counted on the meta device: 33 B dense."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        dit = MiniMaxH3Transformer3DModel.from_config(
            minimax_h3.PRESETS["minimax-h3"]["transformer"]
        )
    n = sum(p.numel() for p in dit.parameters())
    assert 32e9 < n < 35e9, n
    assert len(dit.transformer_blocks) == 50 and dit.config.hidden_size == 5376
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        te = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(**minimax_h3.PRESETS["minimax-h3"]["text_encoder"])
        )
    n_te = sum(p.numel() for p in te.parameters())
    assert 30e9 < n_te < 36e9, n_te  # Qwen3-VL-32B; the DiT reads hidden_states[50] of 64


def test_tokenize_once_and_drift_is_caught(model, pipe_dir) -> None:
    fam = model.family
    batch = fam.tokenize(PROMPTS)
    assert batch.input_ids.shape == (2, 16)
    assert fam.tokenize(PROMPTS).hashes == batch.hashes
    again = load_model(ModelConfig(family="minimax_h3", path=str(pipe_dir)))
    assert again.family.tokenize(PROMPTS).hashes == batch.hashes
    # H3's t2va presentation: the prompt verbatim, no chat template, no special tokens
    tokens = fam.tokenizer.convert_ids_to_tokens(batch.input_ids[0])
    assert tokens[:6] == ["a", "red", "circle", "above", "a", "dog"]
    assert set(tokens[6:]) == {"<|endoftext|>"}  # padding only
    # contract 3: a rollout that decodes the ids and re-applies a (Qwen) chat template, as the
    # failure in the seed did, tokenizes another row: the hash the actor checks differs
    text = fam.tokenizer.decode(batch.input_ids[0], skip_special_tokens=True)
    chat = f"<|im_start|>user\n{text}<|im_end|>"
    assert fam.tokenize([chat]).hashes[0] != batch.hashes[0]


def test_forward_and_cache(model) -> None:
    net, fam = model.net, model.family
    net.cache.store.clear()
    ids = fam.tokenize(PROMPTS).input_ids.repeat_interleave(2, 0)
    x = torch.randn(4, *fam.latent_shape())
    misses = net.cache.misses
    with torch.no_grad():
        model(x, torch.full((4,), 0.5), ids)
        v = model(x, torch.tensor([0.1, 0.4, 0.6, 0.9]), ids)  # one call per (length, sigma)
    assert net.cache.misses - misses == 2
    assert v.shape == x.shape and torch.isfinite(v).all() and v.abs().max() > 0
    with pytest.raises(ContractError, match="per-sample shape"):
        model(torch.randn(2, 4, 5, 8, 8), torch.full((2,), 0.5), ids[:2])


def test_offloaded_encoder_visits_from_the_host(model) -> None:
    """MiniMax-H3's offloaded encoder (models/families/minimax_h3.py): the encode through a
    visit equals the resident encoder's, bit for bit, and the copies share one host copy
    (``models/host_offload.py``; its mechanics in tests/models/test_host_offload.py)."""
    net = model.net
    ids = model.family.tokenize(["a red ball bounces"]).input_ids
    want = net.encode_uncached(ids)[0]
    net.offload = True
    net.frozen.te_home = home = HostResident(net.frozen.text_encoder)
    visits = []
    real = home.visit

    def visit(device, copy=False):
        visits.append(device)
        return real(device, copy=True)

    home.visit = visit  # type: ignore[method-assign]
    try:
        got = net.encode_uncached(ids)[0]
        assert visits and torch.equal(got, want)
        assert home.peak_on_device == 2
        assert copy.deepcopy(model).net.frozen.te_home is home
    finally:
        net.offload = False
        del net.frozen.te_home


def test_decode_media(model) -> None:
    fam = model.family
    media = fam.decode(torch.randn(2, *fam.latent_shape()))
    assert set(media) == fam.media
    video = media["video"]
    assert video.shape == (2, 8, 32, 32, 3) and video.dtype == torch.uint8
    assert torch.equal(media["image"], video[:, 4])
    assert media["fps"].tolist() == [16.0, 16.0]
    assert media["audio"].shape == (2, 4000) and media["audio"].dtype == torch.float32
    assert media["sample_rate"].tolist() == [8000.0, 8000.0]
    assert fam.encode_pixels(torch.rand(2, 3, 64, 64) * 2 - 1).shape == (2, 1360)


class OracleDiT(nn.Module):
    """Stands in for the transformer with H3's exact answer for one known clean sample: from
    each row's noisy state and its own timestep t (data-progress, per row, so the audio rows
    read t_a) it recovers eps = (y - t x0) / (1 - t) and returns the data-ward x0 - eps."""

    def __init__(self, config, video_rows: Tensor, audio_rows: Tensor) -> None:
        super().__init__()
        self.config = config
        self.dummy = nn.Parameter(torch.zeros(1))
        self.video_rows, self.audio_rows = video_rows, audio_rows  # (1, N, C) in H3's space

    def forward(self, hidden_states, audio_hidden_states, timestep, timestep_indices, **lay):
        def velocity(y, x0, idx):
            x0 = x0.repeat(1, y.shape[1] // x0.shape[1], 1)  # packed: every sample's rows
            t = timestep[timestep_indices[idx]].float()[None, :, None]
            return x0 - (y.float() - t * x0) / (1 - t)

        return (
            velocity(hidden_states, self.video_rows, lay["video_indices"]),
            velocity(audio_hidden_states, self.audio_rows, lay["audio_indices"]),
        )


def _oracle_model(model, x0: Tensor, convention: str) -> FamilyModel:
    net = copy.deepcopy(model.net)  # the frozen encoders stay shared (Shared)
    fam = model.family
    video, audio = fam.split(x0[:1])  # H3-space: audio = k * canonical
    cfg = model.net.transformer.config
    net.transformer = OracleDiT(
        cfg,
        minimax_h3.patchify(video, tuple(cfg.patch_size)),
        audio.reshape(1, -1, audio.shape[-1]),
    )
    return FamilyModel(net, fam, convention)


def test_convention_and_per_modality_sigma_against_an_oracle(model) -> None:
    """With H3's exact answer inside, the net (data_progress, t = 1 - sigma, sign flipped, the
    audio rows at sigma_a = f_k(sigma) through y = g x_b) gives exactly eps - x0 on the
    canonical interpolation; declared otherwise it does not, and the probe stops "sigma"."""
    fam = model.family
    g = torch.Generator().manual_seed(7)  # not 0: the probe draws its eps from seed 0
    x0 = torch.randn(1, *fam.latent_shape(), generator=g).repeat(3, 1)
    ids = fam.tokenize(["a red circle", "two blue squares", "a dog"]).input_ids
    eps = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.2, 0.5, 0.9])
    right = _oracle_model(model, x0, "data_progress")
    with torch.no_grad():
        v = right(noised(x0, sigma, eps), sigma, ids)
    torch.testing.assert_close(v, eps - x0, rtol=1e-4, atol=1e-4)
    report = probe_convention(right, x0, ids)
    assert report.conclusive and report.cosine > 0.99 and not report.flipped_time_better
    # the seed's failure, the scheduler's sigma fed as H3's t without the flip: the probe stops it
    with pytest.raises(ContractError, match="wrong way"):
        probe_convention(_oracle_model(model, x0, "sigma"), x0, ids)
    # 1000 sigma (diffusers' usual timestep): the outputs differ and miss the oracle's target
    # by far; the probe's direction/mirror checks do not see a time scale (cos stays > 0)
    wrong = _oracle_model(model, x0, "sigma_x1000")
    with torch.no_grad():
        vw = wrong(noised(x0, sigma, eps), sigma, ids)
    target = eps - x0
    assert ((vw - target).norm() / target.norm()) > 0.3
    # the audio sigma really is per modality: at k = 1 (equal shifts) the same oracle, whose
    # audio rows now sit at sigma, gives a different audio velocity
    flat = _oracle_model(model, x0, "data_progress")
    flat.net.k = 1.0
    dv = model.net.dims[0]
    with torch.no_grad():
        va = flat(noised(x0, sigma, eps), sigma, ids)[:, dv:]
    assert not torch.allclose(va, v[:, dv:], atol=1e-2)


def test_audio_shift_is_the_odds_shift() -> None:
    u = torch.linspace(0.05, 0.95, 7)
    s_v, s_a = minimax_h3.odds_shift(u, 12.0), minimax_h3.odds_shift(u, 3.0)
    torch.testing.assert_close(minimax_h3.odds_shift(s_v, 3.0 / 12.0), s_a)


def test_fl2va_conditioning_rows_are_frozen(model) -> None:
    fam = model.family
    ids = fam.tokenize(PROMPTS).input_ids
    frames = torch.rand(2, 2, 3, 32, 32) * 2 - 1  # first and last frame per sample
    keyframes = fam.encode_keyframes(frames)
    assert keyframes.shape == (2, 2, 4, 1, 8, 8)
    keyframes.requires_grad_(True)
    x = torch.randn(2, *fam.latent_shape(), requires_grad=True)
    sigma = torch.tensor([0.4, 0.7])
    plain = model(x, sigma, ids).detach()
    with fam.conditioned(model, keyframes) as cond:
        v = cond(x, sigma, ids)
    assert model.net.keyframes is None  # the block scopes the conditioning
    assert v.shape == x.shape and not torch.allclose(v, plain)  # the rows condition
    v.square().mean().backward()
    assert keyframes.grad is None  # no gradient reaches the conditioning rows
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_serving_layout_syncs_exactly(model, family_sync_errors) -> None:
    rollout = copy.deepcopy(model)
    model.family.serving_layout(rollout)
    block = rollout.net.transformer.transformer_blocks[0]
    assert block.attn.fused_projections and not hasattr(block.attn, "to_q")
    assert rollout.net.transformer.token_refiner.refiner_blocks[0].attn.fused_projections
    err32, err16, moved = family_sync_errors(model)
    print(f"sync: fp32 {err32:.2e}, bf16 {err16:.2e}, moved {moved:.2e}")
    assert moved > 1e-3  # the update is not a no-op (the canonical audio part is mostly x)
    assert err32 < 1e-3 * moved
    assert err32 < 1e-5, err32
    assert err16 < BF16_REL_TOL, err16


def test_text_encoder_trim_keeps_the_conditioning_layer() -> None:
    """Dropping the layers past text_layer + 1 leaves hidden_states[text_layer] unchanged, and
    keeping only text_layer layers would not (the last entry comes after the final norm)."""
    from transformers import Qwen3VLForConditionalGeneration

    from diffrl.models.families._diffusers import random_component

    cfg = minimax_h3.tiny_qwen3_vl(32, 8, [1, 1, 2])
    cfg["text_config"].update(num_hidden_layers=4, vocab_size=64)
    torch.manual_seed(0)
    full = random_component(Qwen3VLForConditionalGeneration, cfg, torch.float32, "cpu")
    ids = torch.randint(0, 64, (2, 7))

    def hidden(te, layer: int) -> Tensor:
        return te.model(input_ids=ids, output_hidden_states=True).hidden_states[layer]

    want = hidden(full, 2)
    short = copy.deepcopy(full)
    short.model.language_model.layers = short.model.language_model.layers[:2]
    assert not torch.allclose(hidden(short, 2), want)  # why trim keeps one extra layer
    trimmed = minimax_h3.trim_text_encoder(full, 2)
    assert len(trimmed.model.language_model.layers) == 3
    assert trimmed.config.text_config.num_hidden_layers == 3
    torch.testing.assert_close(hidden(trimmed, 2), want, rtol=0, atol=0)


def _release_geometry_model():
    """h3-tiny's modules at the release's geometry: 24 fps stereo, 123 frames (5.1 s, the
    pipeline's 5 to 15 s in its VAE's 5 n + 3 frames) -> 205 audio latents per channel."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        parts = minimax_h3._random("h3-tiny", torch.float32, torch.device("cpu"))
    video, audio = minimax_h3.codecs(
        parts.pop("vae"), parts.pop("audio_vae"), minimax_h3.PRESETS["h3-tiny"]
    )
    return minimax_h3.build(
        **parts, video_codec=video, audio_codec=audio, resolution=32, frames=123,
        max_text_len=16, fps=24.0, audio_shift_ratio=0.25, audio_channels=2, text_layer=1,
    )  # fmt: skip


def test_reference_on_the_release_geometry_runs_the_pipelines_layout(monkeypatch) -> None:
    """On the release's geometry the parity reference runs diffusers' own layout step (its
    canvas, 17 n + 5 frame and 40-per-second audio-latent arithmetic, not diffrl's), and the
    rollout's transformer inputs equal the pipeline's at the release's video shift."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    from diffrl.models.probe import pipeline_parity
    from diffrl.rollout.samplers import euler_step, sigma_schedule

    ran = []
    step = MiniMaxH3PrepareLayoutStep.__call__

    def spy(self, components, state):
        ran.append(type(self))
        return step(self, components, state)

    monkeypatch.setattr(MiniMaxH3PrepareLayoutStep, "__call__", spy)
    model = _release_geometry_model()
    assert model.net.audio_shape == (2, 205, 4)
    report = pipeline_parity(model, sigma_schedule, euler_step, 6, 12.0, "a red circle")
    assert ran == [MiniMaxH3PrepareLayoutStep]
    assert report.calls == 2 and report.worst < 1.0
    assert {"audio_hidden_states", "position_ids", "timestep_indices"} <= set(report.inputs)


def test_reference_refuses_what_the_pipeline_cannot_run(model) -> None:
    """H3's scheduler builds its own uniform grid, so another grid is refused rather than
    silently replaced; a model without autoencoders (h3-avbench) has no pipeline to run."""
    ref = model.family.reference(model, 3.0)
    noise = torch.zeros(1, *model.family.latent_shape())
    with pytest.raises(ContractError, match="builds its own grid"):
        ref.call("a red circle", noise, [1.0, 0.9, 0.2])
    avbench = load_model(ModelConfig(preset="h3-avbench"))
    with pytest.raises(NoReference, match="no diffusers pipeline to compare with"):
        avbench.family.reference(avbench, 1.0)


def test_non_square_frames_and_frame_counts() -> None:
    """model.height/model.width (2:3 here) reach the latents, the packed sequence's rotary
    grid, decode, keyframes and the parity probe; a size or frame count the VAE cannot take
    and a family that renders square frames only are refused, naming the key."""
    from diffrl.models.probe import pipeline_parity
    from diffrl.rollout.samplers import euler_step, sigma_schedule

    torch.manual_seed(0)
    model = load_model(ModelConfig(preset="h3-tiny", height=32, width=48, frames=13))
    fam, net = model.family, model.net
    assert net.video_shape == (4, 8, 8, 12)  # 5 n + 3 frames -> 3 n + 2 latents; x4 VAE
    assert fam.media_geometry()["height"] == 32 and fam.media_geometry()["width"] == 48
    lay = net.layout(3, minimax_h3.ANCHORS, "cpu")
    video_pos = lay["position_ids"][lay["video_indices"]]
    assert video_pos[:, 1].unique().numel() == 4 and video_pos[:, 2].unique().numel() == 6
    media = fam.decode(torch.randn(1, *fam.latent_shape()))
    assert media["video"].shape == (1, 13, 32, 48, 3)
    assert media["audio"].shape == (1, 6400)  # 32 latents of a hop of 200
    keyframes = fam.keyframe_latents(*torch.randint(0, 256, (2, 1, 20, 30, 3), dtype=torch.uint8))
    assert keyframes.shape == (1, 2, 4, 1, 8, 12)
    ids = fam.tokenize(PROMPTS[:1]).input_ids
    with torch.no_grad(), fam.conditioned(model, keyframes) as cond:
        v = cond(torch.randn(1, *fam.latent_shape()), torch.tensor([0.5]), ids)
    assert torch.isfinite(v).all()
    report = pipeline_parity(model, sigma_schedule, euler_step, 6, 3.0, "a red circle")
    assert report.calls == 2 and report.worst < 1.0
    with pytest.raises(ConfigError, match="model.width .* = 44 must be a multiple of 8"):
        load_model(ModelConfig(preset="h3-tiny", height=32, width=44))
    with pytest.raises(FieldError, match="height=32: give model.height and model.width together"):
        ModelConfig(preset="h3-tiny", height=32).validate()
    with pytest.raises(ConfigError, match="model.height = 32: .*'sd3' renders square frames"):
        load_model(ModelConfig(preset="sd35-tiny", height=32, width=48))
    with pytest.raises(ConfigError, match=r"model.width \(or model.resolution\) = 18 .* patch 4"):
        load_model(ModelConfig(preset="h3-avbench", height=16, width=18))


def _semantic_model():
    """h3-tiny (2:3 frames) with a tokenizer that has Qwen3-VL's vision tokens and the FL2VA
    semantic branch on."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from diffusers import MiniMaxH3Transformer3DModel as DiT
    from transformers import Qwen3VLForConditionalGeneration as VL

    from diffrl.models.families._diffusers import random_component
    from diffrl.models.families._h3_vision import VISION_TOKENS

    spec, cpu = minimax_h3.PRESETS["h3-tiny"], torch.device("cpu")
    tok = minimax_h3.tiny_tokenizer(spec["max_text_len"])
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    te_cfg = {k: dict(v) for k, v in spec["text_encoder"].items()}
    te_cfg["text_config"]["vocab_size"] = len(tok)
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    te_cfg |= dict(vision_start_token_id=start, image_token_id=pad, vision_end_token_id=end)
    video, audio = minimax_h3.codecs(
        random_component(AutoencoderKLMiniMaxH3, spec["vae"], torch.float32, cpu),
        random_component(AutoencoderKLMiniMaxH3Audio, spec["audio_vae"], torch.float32, cpu),
        spec,
    )
    return minimax_h3.build(
        random_component(DiT, spec["transformer"], torch.float32, cpu),
        random_component(VL, te_cfg, torch.float32, cpu), video, audio, tok,
        resolution=0, height=32, width=48, frames=8, max_text_len=16, fps=16.0,
        audio_shift_ratio=0.25, audio_channels=1, text_layer=1, semantic_keyframes=True,
    )  # fmt: skip


def _keyframes(rng) -> dict:
    return {
        k: rng.integers(0, 256, (32, 48, 3), dtype=np.uint8) for k in ("first_frame", "last_frame")
    }


def test_fl2va_semantic_branch() -> None:
    """The keyframes' vision block changes the encoder states against text-only FL2VA; the
    condition's hash changes with the keyframes; the second call hits the encode cache."""
    from diffrl.types import hash_cond_rows

    torch.manual_seed(0)
    model = _semantic_model()
    net, fam = model.net, model.family
    p = net.semantic
    assert p.n_image_tokens == 24  # 32 x 48 px in 4 px patches, 2 x 2 merged: 8 x 12 / 4
    rng = np.random.default_rng(0)
    frames = [
        {
            k: rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
            for k in ("first_frame", "last_frame")
        }
        for _ in range(2)
    ]
    cond = fam.encode_conditions(frames)
    ids = fam.tokenize(PROMPTS[:1]).input_ids.expand(2, -1)
    lat, patches = net.split_cond(cond)
    assert lat.shape == (2, 2, 4, 1, 8, 12) and patches.shape == (2, 2, 96, 96)
    assert hash_cond_rows(cond)[0] != hash_cond_rows(cond)[1]  # the hash follows the frames
    net.cache.store.clear()
    misses = net.cache.misses
    sem = net.semantic_states(ids, patches, torch.float32)
    n_pre = len(p.prefix()[0])
    (plain,) = net.conditions(ids[:1], dtype=torch.float32)
    assert sem.shape[1] == n_pre + plain.shape[1]
    assert not torch.allclose(sem[0, n_pre:], plain[0])  # the prompt attends to the keyframes
    assert not torch.allclose(sem[0], sem[1])  # other keyframes, other states
    assert net.cache.misses - misses == 3  # the two FL2VA rows and the text-only one
    x = torch.randn(2, *fam.latent_shape())
    with torch.no_grad():
        v = model(x, torch.tensor([0.5, 0.5]), ids, cond=cond)
        with fam.conditioned(model, lat) as text_only:  # the keyframe rows alone
            v_text = text_only(x, torch.tensor([0.5, 0.5]), ids)
        with pytest.raises(ContractError, match="semantic branch takes one flat row"):
            model(x, torch.tensor([0.5, 0.5]), ids, cond=lat)
    assert net.cache.misses - misses == 3  # cached: the forward re-encodes nothing
    assert torch.isfinite(v).all() and not torch.allclose(v, v_text)
    lay = net.layout(n_pre + 3, minimax_h3.ANCHORS, "cpu", tuple(p.prefix()[1]))
    assert (lay["token_tags"][:n_pre] == minimax_h3.VIDEO_TAG).sum() == 2 * (24 + 2)
    # under ETP the build encodes the presentations before sealing the cache (diffrl.build)
    net.cache.store.clear()
    net.encode_with_conditions(ids, cond, chunk=1)
    net.conditions(ids)  # the text-only rows (encode_all's part)
    net.cache.sealed = "test"
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(x, torch.tensor([0.5, 0.5]), ids, cond=cond), v)
        with pytest.raises(ContractError, match="sealed"):
            model(x, torch.tensor([0.5, 0.5]), ids, cond=cond + 0.5)  # other keyframes
    finally:
        net.cache.sealed = ""
    # Ref2VA's presentation: "<Picture 1>: " and a vision block, then "<Audio 1>: " (text)
    q = net.semantic_ref
    assert len(q.labels) == 1 and q.tail and q.prefix()[1][-len(q.tail) :] == [1] * len(q.tail)
    refs = [
        {"ref_image": f["first_frame"], "ref_audio": np.zeros(4000, np.float32)} for f in frames
    ]
    ref_cond = fam.encode_conditions(refs)
    assert net.cond_mode == "ref2va" and net.split_ref2va(ref_cond)[2].shape == (2, 1, 96, 96)
    with torch.no_grad():
        assert torch.isfinite(model(x, torch.tensor([0.5, 0.5]), ids, cond=ref_cond)).all()


def test_fl2va_semantic_branch_matches_the_pipelines_text_step() -> None:
    """diffrl's FL2VA presentation against diffusers' ``MiniMaxH3FL2VATextEncoderStep`` run on
    the same keyframe patches (the image processor needs torchvision: it stands in with
    diffrl's patches, whose layout ``image_patches`` documents): the same states, row for row,
    and the same per-row tags; a presentation without the labels is caught."""
    from types import SimpleNamespace

    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep
    from diffusers.modular_pipelines.modular_pipeline import PipelineState

    from diffrl.models.families import _h3_vision

    torch.manual_seed(0)
    model = _semantic_model()
    net, fam = model.net, model.family
    p = net.semantic
    rng = np.random.default_rng(1)
    frames = [
        {
            k: rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
            for k in ("first_frame", "last_frame")
        }
    ]
    _, patches = net.split_cond(fam.encode_conditions(frames))
    gh, gw = p.grid
    processor = minimax_h3._pipeline_classes()[2](fam.tokenizer)
    processor.image_processor = lambda images, return_tensors: {
        "pixel_values": patches[0].reshape(-1, patches.shape[-1]),
        "image_grid_thw": torch.tensor([[1, gh, gw]] * 2),
    }
    processor.image_processor.merge_size = p.merge
    components = SimpleNamespace(
        tokenizer=fam.tokenizer, processor=processor, text_encoder=net.frozen.text_encoder,
        text_tag=minimax_h3.TEXT_TAG, video_tag=minimax_h3.VIDEO_TAG, text_encoder_layer=1,
        _execution_device=torch.device("cpu"),
    )  # fmt: skip
    state = PipelineState()
    state.set("prompt", PROMPTS[0])
    state.set("keyframes", ["first", "last"])  # two images: the stand-in processor's
    _, state = MiniMaxH3FL2VATextEncoderStep()(components, state)
    want, want_tags = state.get("prompt_embeds")[0], state.get("text_token_tags")
    ids = fam.tokenize(PROMPTS[:1]).input_ids
    got = net.semantic_states(ids, patches, torch.float32)[0, : want.shape[0]]
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    tags = list(p.prefix()[1]) + [minimax_h3.TEXT_TAG] * (want.shape[0] - len(p.prefix()[1]))
    assert want_tags.tolist() == tags
    te, n_prompt = net.frozen.text_encoder, want.shape[0] - len(p.prefix()[0])
    swapped = _h3_vision.encode(te, ids, net.pad_id, patches.flip(1), p, 1)[0, : want.shape[0]]
    assert not torch.allclose(swapped, want.float(), atol=1e-4)  # last keyframe first: caught
    unlabelled = _h3_vision.Presentation(**{**vars(p), "labels": ((), ())})
    states = _h3_vision.encode(te, ids, net.pad_id, patches, unlabelled, 1)[0]
    n_pre = len(unlabelled.prefix()[0])
    prompt = states[n_pre : n_pre + n_prompt]  # the prompt's rows without the labels ahead
    assert not torch.allclose(prompt, want[-n_prompt:].float(), atol=1e-4)


def test_ref2va_layout_is_the_pipelines_for_stereo() -> None:
    """[text | image | soundtrack | target audio | target video]: diffrl's Ref2VA layout equals
    diffusers' ``build_ref2va_packed_sequence`` for an [image, audio] request (stereo, where the
    pipeline's audio helper applies), non-square; a wrong clock is caught."""
    from types import SimpleNamespace

    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3Ref2VAPrepareLayoutStep as Step,
    )

    from diffrl.models.families._h3_ref2va import ref2va_layout

    tags = torch.tensor([1, 1, 0, 0, 0, 1, 1])  # a label, a vision block, the prompt
    video_shape, audio_shape, patch = (4, 7, 6, 10), (2, 9, 4), (1, 2, 2)
    refs = [
        SimpleNamespace(kind="image", has_audio=False),
        SimpleNamespace(kind="audio", has_audio=True),
    ]
    want = Step.build_ref2va_packed_sequence(
        tags, refs, [torch.zeros(1, 4, 1, 6, 10)], [torch.zeros(2 * 5, 4)], 7, 6, 10, 9, patch, 2,
        minimax_h3.AUDIO_TAG, minimax_h3.VIDEO_TAG,
    )  # fmt: skip
    got = ref2va_layout(tags, video_shape, audio_shape, patch, 5, (0, 2))
    assert got[5:] == want[5:] == (15, 10)
    for g, w in zip(got[:5], want[:5], strict=True):
        assert torch.equal(g, w)
    late = ref2va_layout(
        torch.ones(8, dtype=torch.long), video_shape, audio_shape, patch, 5, (0, 2)
    )
    assert not torch.equal(late[0][8:], want[0][7:])  # one more text row moves the whole clock


def test_ref2va_task_mode() -> None:
    """AVBench Ref2VA on h3-avbench: the data stage encodes a reference image and soundtrack
    once (hashed with the ids); the net packs them as conditioning rows (image at
    t = max(t, 0.999), soundtrack clean at t = 1), cut from the output, no gradient; a
    different reference changes the velocity."""
    from diffrl.build import prompt_set
    from diffrl.tasks import build_task
    from diffrl.tasks.base import TaskConfig
    from diffrl.types import images_from_uint8

    torch.manual_seed(0)
    model = load_model(ModelConfig(preset="h3-avbench"))
    net, fam = model.net, model.family
    task = build_task(TaskConfig(task="avbench_ref2va"))
    prompts = task.prompts("train")[:2]
    pset = prompt_set(task, model, prompts)
    assert net.cond_mode == "ref2va" and pset.cond.shape == (2, 3 * 16 * 16 + 60 * 100)
    image, audio, patches = net.split_ref2va(pset.cond)
    ref = task.prompt_conditions(prompts, fam.media_geometry())[1]
    pixels = images_from_uint8(torch.from_numpy(ref["ref_image"])[None])[0]
    assert torch.equal(image[1, 0, :, 0], pixels)  # h3-avbench's latents are its pixels
    wave = torch.from_numpy(ref["ref_audio"])[None]
    torch.testing.assert_close(audio[1], fam.audio_codec.encode(wave, net.audio_shape)[0])
    assert patches is None and pset.batch([0, 1]).cond_hash is not None
    seen = {}
    forward = net.transformer.forward

    def spy(**kw):
        seen.update(kw)
        return forward(**kw)

    net.transformer.forward = spy
    ids = pset.input_ids
    x = torch.randn(2, *fam.latent_shape(), requires_grad=True)
    cond = pset.cond.clone().requires_grad_(True)
    sigma = torch.tensor([0.6, 0.6])
    v = model(x, sigma, ids, cond=cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    row_t = seen["timestep"][seen["timestep_indices"]]
    aud, vid = seen["audio_indices"], seen["video_indices"]
    assert torch.all(row_t[aud[:60]] == 1.0) and torch.all(row_t[vid[:16]] == 0.999)
    assert torch.allclose(row_t[vid[16:]], torch.tensor(0.4)) and len(aud) == 120
    v.square().mean().backward()
    assert cond.grad is None and x.grad.abs().sum() > 0
    other = pset.cond.clone()
    other[:, 3 * 16 * 16 :] = other[:, 3 * 16 * 16 :].roll(7, dims=1)  # another soundtrack
    with torch.no_grad():
        assert not torch.allclose(model(x, sigma, ids, cond=other), v)
    net.cond_mode = "fl2va"  # an engine built apart from the data stage: the row's length decides
    with torch.no_grad():
        torch.testing.assert_close(model(x, sigma, ids, cond=pset.cond), v.detach())
    with pytest.raises(ContractError, match="conditions of shape"):
        model(x, sigma, ids, cond=pset.cond[:, :-1])
