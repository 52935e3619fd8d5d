"""diffrl's ImageBind: the release's state-dict layout (names and shapes written out here from
Meta's ``imagebind_huge``, independently of the network's code) loads strictly, a file that
does not fit is refused naming what is wrong, the huge config is the release's size; the
input preparation (16 kHz log-mel windows, 2 s frame pairs, 224 px crops); the scorer end to
end on tiny random weights, and beside CLAP in one reward pool from a recipe-style override.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from test_model_scorers import clap_dir  # noqa: F401  (a fixture)

from diffrl.config import load_config
from diffrl.reward.pool import RewardPool
from diffrl.reward.scorers import build_scorer
from diffrl.reward.scorers.imagebind_net import (
    ImageBindConfig,
    ImageBindNet,
    load_weights,
    state_shapes,
)
from diffrl.reward.scorers.imagebind_prep import (
    fbank,
    frame_pairs,
    mel_banks,
    mel_clips,
    sinc_resample,
)

KV_BIAS = ("audio", "depth", "thermal", "imu")  # trunks with learned key/value bias tokens


def release_layout(c: ImageBindConfig) -> dict[str, tuple[int, ...]]:
    """Every entry of Meta's imagebind_huge.pth for the sizes of ``c``, as the release names
    them (its imagebind_model.py, multimodal_preprocessors.py, transformer.py, helpers.py)."""
    out: dict[str, tuple[int, ...]] = {}
    pre, E = "modality_preprocessors", c.embed_dim
    V, A, T = c.vision.width, c.audio.width, c.text.width
    Dp, Th, Im = c.depth.width, c.thermal.width, c.imu.width
    g = c.image_size // c.patch
    out[f"{pre}.vision.cls_token"] = (1, 1, V)
    out[f"{pre}.vision.rgbt_stem.proj.1.weight"] = (V, 3, 2, c.patch, c.patch)
    out[f"{pre}.vision.pos_embedding_helper.pos_embed"] = (1, g * g + 1, V)
    out[f"{pre}.text.pos_embed"] = (1, 77, T)
    out[f"{pre}.text.mask"] = (77, 77)
    out[f"{pre}.text.token_embedding.weight"] = (c.vocab, T)
    ar, ac = (128 - 16) // 10 + 1, (204 - 16) // 10 + 1
    stems = (("audio", A, "rgbt_stem"), ("depth", Dp, "depth_stem"), ("thermal", Th, "rgbt_stem"))
    for m, w, stem in stems:
        n = ar * ac if m == "audio" else (224 // 16) ** 2
        out[f"{pre}.{m}.cls_token"] = (1, 1, w)
        out[f"{pre}.{m}.{stem}.proj.weight"] = (w, 1, 16, 16)
        out[f"{pre}.{m}.{stem}.norm_layer.weight"] = (w,)
        out[f"{pre}.{m}.{stem}.norm_layer.bias"] = (w,)
        out[f"{pre}.{m}.pos_embedding_helper.pos_embed"] = (1, n + 1, w)
    out[f"{pre}.imu.pos_embed"] = (1, 2000 // 8 + 1, Im)
    out[f"{pre}.imu.cls_token"] = (1, 1, Im)
    out[f"{pre}.imu.imu_stem.proj.weight"] = (Im, 48)
    out[f"{pre}.imu.imu_stem.norm_layer.weight"] = (Im,)
    out[f"{pre}.imu.imu_stem.norm_layer.bias"] = (Im,)
    out["modality_trunks.vision.pre_transformer_layer.0.weight"] = (V,)
    out["modality_trunks.vision.pre_transformer_layer.0.bias"] = (V,)
    for m in ("vision", "text", "audio", "depth", "thermal", "imu"):
        w, n = c.tower(m).width, c.tower(m).blocks
        for i in range(n):
            b = f"modality_trunks.{m}.blocks.{i}"
            out[f"{b}.attn.in_proj_weight"] = (3 * w, w)
            out[f"{b}.attn.in_proj_bias"] = (3 * w,)
            if m in KV_BIAS:
                out[f"{b}.attn.bias_k"] = (1, 1, w)
                out[f"{b}.attn.bias_v"] = (1, 1, w)
            out[f"{b}.attn.out_proj.weight"] = (w, w)
            out[f"{b}.attn.out_proj.bias"] = (w,)
            for ln in ("norm_1", "norm_2"):
                out[f"{b}.{ln}.weight"] = (w,)
                out[f"{b}.{ln}.bias"] = (w,)
            out[f"{b}.mlp.fc1.weight"] = (4 * w, w)
            out[f"{b}.mlp.fc1.bias"] = (4 * w,)
            out[f"{b}.mlp.fc2.weight"] = (w, 4 * w)
            out[f"{b}.mlp.fc2.bias"] = (w,)
        if m == "text":
            out["modality_heads.text.proj.0.weight"] = (w,)
            out["modality_heads.text.proj.0.bias"] = (w,)
            out["modality_heads.text.proj.1.weight"] = (E, w)
        else:
            out[f"modality_heads.{m}.0.weight"] = (w,)
            out[f"modality_heads.{m}.0.bias"] = (w,)
            out[f"modality_heads.{m}.{3 if m == 'imu' else 2}.weight"] = (E, w)
        if m != "vision":
            out[f"modality_postprocessors.{m}.1.log_logit_scale"] = ()
    return out


def random_release_state(c: ImageBindConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=gen) * 0.05 for k, s in release_layout(c).items()}
    state["modality_preprocessors.text.mask"] = torch.full((77, 77), float("-inf")).triu(1)
    scales = {"text": 1 / 0.07, "audio": 20.0, "depth": 5.0, "thermal": 10.0, "imu": 5.0}
    for m, s in scales.items():
        state[f"modality_postprocessors.{m}.1.log_logit_scale"] = torch.tensor(math.log(s))
    return state


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("imagebind") / "imagebind_tiny.pth"
    torch.save(random_release_state(ImageBindConfig.tiny()), path)
    return path


def test_release_layout_loads_strict_and_is_used(tiny_weights: Path) -> None:
    cfg = ImageBindConfig.tiny()
    state = torch.load(tiny_weights, weights_only=True)
    net = ImageBindNet(cfg)
    net.load_state_dict(state, strict=True)  # every name and shape of the release
    torch.testing.assert_close(
        net.modality_trunks.audio.blocks[0].attn.bias_k,
        state["modality_trunks.audio.blocks.0.attn.bias_k"],
    )
    frames = torch.randn(2, 3, 2, 224, 224)
    mel = torch.randn(2, 1, 128, 204)
    ids = torch.zeros(2, 77, dtype=torch.long)
    ids[:, 0], ids[:, 1], ids[:, 2] = 300, 17, cfg.vocab - 1  # start, a word, end of text
    with torch.no_grad():
        v, a, t = net.embed("vision", frames), net.embed("audio", mel), net.embed("text", ids)
        # postprocessors: unit vectors times the logit scale (audio's fixed at 20, text's 1/0.07)
        torch.testing.assert_close(v.norm(dim=-1), torch.ones(2))
        torch.testing.assert_close(a.norm(dim=-1), torch.full((2,), 20.0))
        torch.testing.assert_close(t.norm(dim=-1), torch.full((2,), 1 / 0.07))
        # a still image is the same clip as that frame twice (the temporal patch's pair)
        still = net.embed("vision", frames[:, :, 0])
        pair = frames[:, :, :1].repeat(1, 1, 2, 1, 1)
        torch.testing.assert_close(still, net.embed("vision", pair))
        # the loaded weights are the ones used: another file gives other embeddings
        other = ImageBindNet(cfg)
        other.load_state_dict(random_release_state(cfg, seed=1), strict=True)
        assert (other.embed("audio", mel) - a).abs().max() > 1e-3
        # text reads the end-of-text token: tokens after it (padding) do not matter
        padded = ids.clone()
        padded[:, 3] = 5
        torch.testing.assert_close(net.embed("text", padded), t)

    # load_weights: the same, from the file; vision+audio only skips the others by name
    loaded = load_weights(ImageBindNet(cfg), tiny_weights)
    torch.testing.assert_close(loaded.embed("audio", mel), a)
    with torch.device("meta"):
        av = ImageBindNet(ImageBindConfig.tiny(modalities=("vision", "audio")))
    load_weights(av, tiny_weights)  # meta-built: takes the file's tensors (assign)
    assert not any(p.is_meta for p in av.parameters())
    with torch.no_grad():
        torch.testing.assert_close(av.embed("vision", frames), v)


def test_a_file_that_does_not_fit_is_refused(tiny_weights: Path, tmp_path: Path) -> None:
    cfg = ImageBindConfig.tiny()
    state = torch.load(tiny_weights, weights_only=True)
    renamed = dict(state)
    renamed["modality_trunks.audio.blocks.0.attn.in_proj_w"] = renamed.pop(
        "modality_trunks.audio.blocks.0.attn.in_proj_weight"
    )
    bad = tmp_path / "renamed.pth"
    torch.save(renamed, bad)
    gone = r"missing 1 \['modality_trunks.audio.blocks.0.attn.in_proj_weight'\]"
    with pytest.raises(ValueError, match=gone) as e:
        load_weights(ImageBindNet(cfg), bad)
    assert "unexpected 1 ['modality_trunks.audio.blocks.0.attn.in_proj_w']" in str(e.value)
    reshaped = dict(state)
    reshaped["modality_heads.vision.2.weight"] = torch.zeros(8, cfg.vision.width)
    torch.save(reshaped, bad)
    shape = r"modality_heads.vision.2.weight: file \(8, 32\) vs net \(16, 32\)"
    with pytest.raises(ValueError, match=shape):
        load_weights(ImageBindNet(cfg), bad)
    # the tiny file is not the huge network: refused by shape, not loaded half-way
    with torch.device("meta"):
        huge = ImageBindNet(ImageBindConfig.huge(modalities=("vision", "audio")))
    with pytest.raises(ValueError, match="use Meta's imagebind_huge.pth with size 'huge'"):
        load_weights(huge, tiny_weights)
    # an unknown top-level entry is never dropped silently, even for a partial network
    extra = dict(state, **{"something.else": torch.zeros(1)})
    torch.save(extra, bad)
    with pytest.raises(ValueError, match=r"unexpected 1 \['something.else'\]"):
        load_weights(ImageBindNet(ImageBindConfig.tiny(modalities=("audio",))), bad)
    with pytest.raises(FileNotFoundError, match="never downloads.*imagebind_huge.pth"):
        load_weights(ImageBindNet(cfg), tmp_path / "imagebind_huge.pth")


def test_huge_is_the_release() -> None:
    """Built on the meta device (no memory): every name and shape of imagebind_huge.pth, and
    its size (the vision trunk is ViT-H/14's ~630M; 1.2B in all)."""
    shapes = state_shapes(ImageBindConfig.huge())
    assert shapes == release_layout(ImageBindConfig.huge())
    facts = {
        "modality_preprocessors.vision.rgbt_stem.proj.1.weight": (1280, 3, 2, 14, 14),
        "modality_preprocessors.vision.pos_embedding_helper.pos_embed": (1, 257, 1280),
        "modality_preprocessors.audio.rgbt_stem.proj.weight": (768, 1, 16, 16),
        "modality_preprocessors.audio.pos_embedding_helper.pos_embed": (1, 229, 768),
        "modality_preprocessors.text.token_embedding.weight": (49408, 1024),
        "modality_trunks.vision.blocks.31.attn.in_proj_weight": (3840, 1280),
        "modality_trunks.text.blocks.23.mlp.fc1.weight": (4096, 1024),
        "modality_trunks.audio.blocks.11.attn.bias_k": (1, 1, 768),
        "modality_heads.vision.2.weight": (1024, 1280),
        "modality_heads.audio.2.weight": (1024, 768),
        "modality_heads.text.proj.1.weight": (1024, 1024),
        "modality_postprocessors.audio.1.log_logit_scale": (),
    }
    assert {k: shapes[k] for k in facts} == facts
    assert "modality_trunks.vision.blocks.32.norm_1.weight" not in shapes
    assert "modality_trunks.vision.blocks.0.attn.bias_k" not in shapes  # vision: no kv bias

    def count(prefix: str) -> int:
        return sum(math.prod(s) for k, s in shapes.items() if k.startswith(prefix))

    # the release's input geometry runs through every tower (shapes only, on the meta device)
    with torch.device("meta"):
        net = ImageBindNet(ImageBindConfig.huge())
        inputs = {
            "vision": torch.empty(2, 3, 2, 224, 224),  # a frame pair, 16 x 16 patches
            "audio": torch.empty(2, 1, 128, 204),  # 12 x 19 overlapping patches
            "text": torch.zeros(2, 77, dtype=torch.long),
            "depth": torch.empty(2, 1, 224, 224),
            "thermal": torch.empty(2, 1, 224, 224),
            "imu": torch.empty(2, 6, 2000),
        }
        for m, x in inputs.items():
            assert net.embed(m, x).shape == (2, 1024), m
        with pytest.raises(ValueError, match="gives 512 patches but the position table has 256"):
            net.embed("vision", torch.empty(1, 3, 4, 224, 224))  # 4 frames: two temporal patches

    per_block = 12 * 1280**2 + 13 * 1280  # attention 4D^2+4D, MLP 8D^2+5D, two norms 4D
    assert count("modality_trunks.vision.") == 32 * per_block + 2 * 1280
    assert 625e6 < count("modality_trunks.vision.") < 635e6
    assert 1.19e9 < sum(math.prod(s) for s in shapes.values()) < 1.21e9


def test_fbank_and_windows() -> None:
    rate = 16_000
    t = torch.arange(2 * rate) / rate
    spec = fbank(torch.sin(2 * math.pi * 1000 * t)[None])  # 2 s: 198 whole 25 ms frames
    assert spec.shape == (1, 198, 128)
    banks = mel_banks(128, 512, rate, torch.device("cpu"))
    assert spec[0, 100].argmax() == banks[:, round(1000 / (rate / 512))].argmax()  # 1 kHz bin
    hi = fbank(torch.sin(2 * math.pi * 4000 * t)[None])
    assert hi[0, 100].argmax() > spec[0, 100].argmax() + 30  # higher tone, higher mel bin
    with pytest.raises(ValueError, match="at least 400"):
        fbank(torch.zeros(1, 399))
    # three windows, padded 198 -> 204 frames, normalised: silence is log(eps) everywhere
    mels = mel_clips(torch.zeros(2, 3 * rate), rate)
    assert mels.shape == (2, 3, 1, 128, 204)
    floor = (math.log(torch.finfo(torch.float32).eps) + 4.268) / 9.138
    torch.testing.assert_close(mels[..., :198], torch.full_like(mels[..., :198], floor))
    torch.testing.assert_close(mels[..., 198:], torch.full_like(mels[..., 198:], 4.268 / 9.138))
    # windows at 0-2, 1-3 and 2-4 s of a 4 s clip: a tone from 2.5 to 3.5 s is absent from
    # the first, half in the second, whole in the third
    late = torch.zeros(1, 4 * rate)
    late[0, 5 * rate // 2 : 7 * rate // 2] = torch.sin(2 * math.pi * 1000 * t[:rate])
    energy = mel_clips(late, rate)[0, :, 0, :, :198].mean(dim=(1, 2))
    assert energy[2] > energy[1] + 0.1 and energy[1] > energy[0] + 0.1
    # the rate is honoured: 1 kHz at 32 kHz is resampled, not read as 2 kHz
    t32 = torch.arange(2 * 32_000) / 32_000
    at32 = mel_clips(torch.sin(2 * math.pi * 1000 * t32)[None], 32_000)
    at16 = mel_clips(torch.sin(2 * math.pi * 1000 * t)[None], rate)
    assert at32[0, 0, 0, :, 100].argmax() == at16[0, 0, 0, :, 100].argmax()


@pytest.mark.parametrize("rate", [48_000, 44_100, 24_000, 8_000])
def test_resampler_keeps_the_band_and_drops_what_16khz_cannot_hold(rate: int) -> None:
    def tones(r: int, n: int, freqs) -> torch.Tensor:
        t = torch.arange(n, dtype=torch.float64) / r
        return sum(a * torch.sin(2 * math.pi * f * t) for f, a in freqs).float()[None]

    band = ((440.0, 0.5), (2500.0, 0.3))  # below both Nyquists
    out = sinc_resample(tones(rate, rate, band), rate, 16_000)
    assert out.shape == (1, 16_000)  # one second stays one second
    inner = slice(64, -64)  # away from the zero-padded ends
    want = tones(16_000, 16_000, band)
    assert (out - want)[0, inner].abs().max() < 1e-2
    if rate > 16_000:  # 10 kHz is above 16 kHz's Nyquist: filtered out, not folded to 6 kHz
        hi = sinc_resample(tones(rate, rate, ((10_000.0, 0.5),)), rate, 16_000)
        assert hi[0, inner].abs().max() < 1e-2


def test_frame_pairs_sample_2s_windows_and_crops() -> None:
    # each frame's value is its index: the output tells which frames were taken
    t, fps = 30, 12.0  # 2.5 s
    video = torch.arange(t, dtype=torch.uint8).view(1, t, 1, 1, 1).expand(1, t, 8, 12, 3)
    x = frame_pairs(video, fps, size=8, clips=5, crops=1)
    assert x.shape == (1, 5, 3, 2, 8, 8)
    mean, std = 0.48145466, 0.26862954
    taken = ((x[0, :, 0, :, 0, 0] * std + mean) * 255).round().long()
    # windows start at 0, 1/8, 2/8, 3/8, 1/2 s and last 2 s: frames [ceil(12 s), ceil(12 (s+2)))
    assert taken.tolist() == [[0, 23], [2, 25], [3, 26], [5, 28], [6, 29]]
    short = frame_pairs(video[:, :6], fps, size=8, clips=5, crops=1)  # 0.5 s: the whole clip
    taken = ((short[0, :, 0, :, 0, 0] * std + mean) * 255).round().long()
    assert taken.tolist() == [[0, 5]] * 5
    # landscape: short side scaled to `size`, three crops along the width (start, centre, end)
    ramp = torch.arange(24, dtype=torch.uint8).mul(10).view(1, 1, 1, 24, 1).expand(1, 2, 12, 24, 3)
    crops = frame_pairs(ramp, fps, size=12, clips=1, crops=3)
    assert crops.shape == (1, 3, 3, 2, 12, 12)
    left = crops[0, :, 0, 0, 0, 0]  # the first column of each crop
    assert left[0] < left[1] < left[2]
    with pytest.raises(ValueError, match="crops=2"):
        frame_pairs(ramp, fps, crops=2)


def av_traj(media_traj, rate: int, seconds: float = 2.5, fps: float | None = 8.0, nan=True):
    """3 clips: tones (at ``rate``) and moving bars; row 1's audio holds a NaN if ``nan``."""
    n = int(rate * seconds)
    t = torch.arange(n) / rate
    audio = torch.stack([0.4 * torch.sin(2 * math.pi * f * t) for f in (300.0, 700.0, 1500.0)])
    if nan:
        audio[1, 10] = float("nan")
    frames = int(8 * seconds)
    video = torch.zeros(3, frames, 24, 32, 3, dtype=torch.uint8)
    for i in range(frames):
        video[0, i, :, i % 32] = 255
        video[1, i, i % 24] = 200
        video[2, i, ::2] = 40 * (i % 5)
    fields = {"audio": audio, "video": video, "sample_rate": torch.full((3,), float(rate))}
    if fps is not None:
        fields["fps"] = torch.full((3,), fps)
    return media_traj(["a ball bounces", "rain", "a violin"], **fields)


def test_scorer_end_to_end_on_tiny_weights(tiny_weights: Path, media_traj) -> None:
    params = {"weights": str(tiny_weights), "size": "tiny", "batch_size": 2}
    scorer = build_scorer("imagebind", params)
    assert scorer.name == "imagebind" and scorer.needs == frozenset({"audio", "video"})
    res = asyncio.run(scorer.score(av_traj(media_traj, 16_000)))
    assert res.valid.tolist() == [True, False, True] and torch.isnan(res.scores[1])
    assert (res.scores[res.valid].abs() <= 1 + 1e-5).all()
    # the embedder is the network on the prepared inputs: the same cosine by hand
    emb = scorer.embedder
    traj = av_traj(media_traj, 16_000)
    audio = traj.extra_fields["audio"][[0, 2]]
    with torch.no_grad():
        a = emb.net.embed("audio", mel_clips(audio, 16_000).flatten(0, 1)).view(2, 3, -1).mean(1)
        clips = frame_pairs(traj.extra_fields["video"][[0, 2]], 8.0)
        v = emb.net.embed("vision", clips.flatten(0, 1)).view(2, 15, -1).mean(1)
    ref = torch.cosine_similarity(a, v)
    torch.testing.assert_close(res.scores[[0, 2]], ref, rtol=1e-4, atol=1e-5)
    # audio at 48 kHz is resampled to 16 kHz: the same clips score (nearly) the same
    hi = asyncio.run(scorer.score(av_traj(media_traj, 48_000)))
    torch.testing.assert_close(hi.scores[[0, 2]], res.scores[[0, 2]], rtol=0, atol=2e-3)
    wrong = build_scorer("imagebind", {**params, "sample_rate": 16_000})  # misread 48 kHz
    with pytest.raises(ValueError, match="16000 Hz but the trajectory's audio is 48000 Hz"):
        asyncio.run(wrong.score(av_traj(media_traj, 48_000)))
    # the frame rate comes from the trajectory, or the fps param where it has none
    no_fps = av_traj(media_traj, 16_000, fps=None)
    with pytest.raises(ValueError, match="needs the frame rate"):
        asyncio.run(scorer.score(no_fps))
    told = build_scorer("imagebind", {**params, "fps": 8.0})
    torch.testing.assert_close(asyncio.run(told.score(no_fps)).scores[[0, 2]], res.scores[[0, 2]])
    with pytest.raises(ValueError, match="fps param is 8.0 but the trajectory's video is at 24.0"):
        asyncio.run(told.score(av_traj(media_traj, 16_000, fps=24.0)))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_scorer("imagebind", {"weights": "/nonexistent/imagebind_huge.pth"})
    with pytest.raises(ValueError, match="needs exactly one of.*params.weights"):
        build_scorer("imagebind", {"size": "tiny"})
    with pytest.raises(ValueError, match=r"params.size='large': must be one of \['huge', 'tiny'\]"):
        build_scorer("imagebind", {**params, "size": "large"})


def test_clap_plus_imagebind_from_a_recipe_override(
    tiny_weights: Path,
    clap_dir: Path,  # noqa: F811
    media_traj,
) -> None:
    """reward.scorers=[{clap, 0.5}, {imagebind, 0.5}]: each scorer resamples the 24 kHz
    rollout audio to its own rate; the reward is the weighted sum of their scores."""
    cfg = load_config(
        None,
        [
            f"reward.scorers=[{{name: clap, weight: 0.5, params: {{path: {clap_dir}}}}}, "
            f"{{name: imagebind, weight: 0.5, params: {{weights: {tiny_weights}, size: tiny}}}}]"
        ],
    )
    pool = RewardPool(cfg.reward)
    pool.check_inputs(produced={"video", "fps", "audio", "sample_rate"})
    traj = av_traj(media_traj, 24_000, nan=False)  # a required scorer's NaN stops the run
    scored, metrics = asyncio.run(pool.score(traj))
    assert set(scored.per_scorer) == {"clap", "imagebind"}
    assert scored.valid.all()
    want = 0.5 * scored.per_scorer["clap"] + 0.5 * scored.per_scorer["imagebind"]
    torch.testing.assert_close(scored.rewards, want, rtol=0, atol=1e-6)
    assert (scored.per_scorer["clap"] != scored.per_scorer["imagebind"]).all()  # both weigh in
    for key in ("clap", "imagebind"):  # each as the scorer gives it alone
        alone = next(s for sc, s in pool.scorers if sc.key == key)
        torch.testing.assert_close(scored.per_scorer[key], asyncio.run(alone.score(traj)).scores)
    assert metrics["reward/imagebind/valid_frac"] == 1.0
