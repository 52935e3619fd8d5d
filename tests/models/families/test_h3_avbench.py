"""The built-in AVBench base: MiniMax-H3's real transformer over pixel video and DCT audio
latents (preset h3-avbench, weights builtin:avbench_h3). Its codecs are exact, and on its own
ground truth the start-up probe confirms H3's data-progress convention and refuses a wrong
declaration."""

from __future__ import annotations

import pytest
import torch

from diffrl.errors import ConfigError, ContractError

pytest.importorskip("diffusers")
from diffrl.build import reconstruction_probe  # noqa: E402
from diffrl.models.families._h3_codecs import DCTAudio, dct_basis  # noqa: E402
from diffrl.models.registry import ModelConfig, load_model  # noqa: E402
from diffrl.tasks import TaskConfig, build_task  # noqa: E402
from diffrl.tasks.avbench import ClipSpec, render_batch  # noqa: E402

TEXTS = ["a red ball bounces twice, high beeps", "a blue ball bounces once, low beeps"]


def base(convention: str = ""):
    weights, preset = "builtin:avbench_h3", "h3-avbench"
    cfg = ModelConfig(family="minimax_h3", preset=preset, weights=weights, convention=convention)
    return load_model(cfg)


@pytest.fixture(scope="module")
def model():
    return base()


def test_dct_is_orthonormal_and_the_audio_codec_exact() -> None:
    d = dct_basis(100)
    assert torch.allclose(d @ d.T, torch.eye(100), atol=1e-5)
    codec = DCTAudio(8000, 100, 0.5)
    wave = torch.rand(3, 6000) * 2 - 1
    z = codec.encode(wave, (1, 60, 100))
    assert z.shape == (3, 1, 60, 100)
    assert torch.allclose(codec.decode(z), wave, atol=1e-5)
    with pytest.raises(ConfigError, match="whole number of 100-sample DCT frames"):
        codec.latent_shape(0.7501, 1)


def test_clips_round_trip_through_the_latent(model) -> None:
    fam = model.family
    assert model.net.video_shape == (3, 12, 16, 16) and model.net.audio_shape == (1, 60, 100)
    assert model.net.k == pytest.approx(0.5)  # per-modality shifts 2 (video) and 1 (audio)
    video, audio = render_batch(TEXTS, [0, 1], ClipSpec(12, 16, 16.0, 8000))
    x0 = fam.encode_clip(torch.from_numpy(video), torch.from_numpy(audio))
    assert x0.shape == (2, *fam.latent_shape())
    out = fam.decode(x0)
    assert torch.equal(out["video"], torch.from_numpy(video))  # pixel latents: exact
    assert torch.allclose(out["audio"], torch.from_numpy(audio), atol=1e-5)
    assert out["sample_rate"].tolist() == [8000.0, 8000.0] and out["fps"].tolist() == [16.0] * 2
    with pytest.raises(ValueError, match="uint8"):
        fam.encode_clip(torch.from_numpy(video).float(), torch.from_numpy(audio))


def test_the_probe_confirms_data_progress_and_refuses_a_wrong_declaration(model) -> None:
    task = build_task(TaskConfig(task="avbench"))
    report = reconstruction_probe(task, model)  # AVBench's clips, encoded into the joint latent
    assert report is not None and report.conclusive and report.cosine > 0.9
    for wrong in ("sigma", "sigma_x1000"):
        with pytest.raises(ContractError, match="data_progress"):
            reconstruction_probe(task, base(wrong))


def test_fl2va_conditions_are_encoded_once_per_prompt(model) -> None:
    from diffrl.build import prompt_set

    task = build_task(TaskConfig(task="avbench_fl2va"))
    prompts = task.prompts("test")[:3]
    pset = prompt_set(task, model, prompts)
    assert pset.cond.shape == (3, 2, 3, 1, 16, 16)
    conds = task.prompt_conditions(prompts, model.family.media_geometry())
    first = torch.from_numpy(conds[0]["first_frame"]).permute(2, 0, 1).float() / 127.5 - 1
    assert torch.allclose(pset.cond[0, 0, :, 0], first)  # pixel keyframes: the frame itself
    batch = pset.batch([2, 0]).repeat(2)
    assert torch.equal(batch.cond, pset.cond[[2, 2, 0, 0]])
