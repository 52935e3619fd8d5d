"""Sample clips: WAV, GIF, the frames-over-spectrogram PNG, the run directory's clips and the
eval hook that writes them (a bad clip warns and training goes on)."""

from __future__ import annotations

import asyncio
import shutil
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.controller import media, step
from diffrl.controller.run_dir import RunDir
from diffrl.tasks import TaskConfig, build_task
from diffrl.tasks.avbench import render_batch
from diffrl.tasks.base import EvalResult
from diffrl.types import PromptBatch, Trajectory

TEXT = "a red ball bounces twice, high beeps"
HAS_FFMPEG = shutil.which("ffmpeg") is not None


@pytest.fixture(scope="module")
def clip() -> tuple[np.ndarray, np.ndarray]:
    video, audio = render_batch([TEXT])  # (1, 12, 32, 32, 3) uint8, (1, 6000) float32
    return video[0], audio[0]


def test_wav_round_trips(tmp_path, clip) -> None:
    _, audio = clip
    audio = np.concatenate([audio, [1.5, -2.0, np.nan]]).astype(np.float32)  # clipped, silenced
    path = media.write_wav(tmp_path / "a.wav", audio, 8000)
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 8000)
        back = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2") / 32767
    want = np.nan_to_num(np.clip(audio, -1, 1))
    assert back.shape == want.shape
    np.testing.assert_allclose(back, want, atol=1 / 32767)
    assert [p.name for p in tmp_path.iterdir()] == ["a.wav"]  # no temp file left behind


def test_gif_has_every_frame_upscaled_and_loops(tmp_path, clip) -> None:
    video, _ = clip
    path = media.write_gif(tmp_path / "a.gif", video, fps=16)
    with Image.open(path) as im:
        assert im.n_frames == 12 and im.size == (128, 128)
        assert im.info["loop"] == 0 and im.info["duration"] in (60, 70)  # 62.5 ms in 10 ms steps
        im.seek(5)
        frame = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(frame[::4, ::4], video[5])  # nearest-neighbour, 4 x
    with Image.open(media.write_gif(tmp_path / "b.gif", video, fps=16, scale=2)) as im:
        assert im.size == (64, 64)


def test_spectrogram_of_a_sine_peaks_at_its_row() -> None:
    sr, n_fft = 8000, 256
    t = np.arange(sr) / sr
    db = media.spectrogram(0.5 * np.sin(2 * np.pi * 2000 * t), sr)
    assert db.shape == (n_fft // 2 + 1, 1 + (sr - n_fft) // (n_fft // 4))
    assert (db.argmax(axis=0) == 2000 * n_fft // sr).all()  # row 64 of 129, every frame
    assert media.spectrogram(np.zeros(100), sr).shape == (129, 1)  # padded to one window


@pytest.mark.parametrize(("ok", "colour"), [(True, (30, 170, 60)), (None, (150, 150, 150))])
def test_strip_png_layout(tmp_path, clip, ok, colour) -> None:
    video, _ = clip
    tone = 0.5 * np.sin(2 * np.pi * 500 * np.arange(6000) / 8000)  # 500 Hz: 1/8 of the way up
    path = media.strip_png(tmp_path / "a.png", video, tone, 8000, TEXT, ok)
    im = np.asarray(Image.open(path).convert("RGB"))
    width = 12 * 64 + 2 * 4  # the frames (64 px each) side by side, a 4 px border each side
    box_h = 4 + 64 + 2 + 96 + 4  # frames, a gap, the spectrogram, the border
    assert im.shape[1] == width and im.shape[0] > box_h  # the caption under the box
    assert tuple(im[2, 2]) == colour and tuple(im[box_h - 3, width - 3]) == colour
    frame3 = im[4 : 4 + 64 : 2, 4 + 64 * 3 : 4 + 64 * 4 : 2]  # nearest-neighbour, 2 x
    np.testing.assert_array_equal(frame3, video[3])
    spec = im[4 + 64 + 2 : box_h - 4, 4 : width - 4].astype(float).sum(axis=(1, 2))  # (96,)
    assert spec.argmax() == round(95 * (1 - 500 / 4000))  # low frequencies at the bottom


def test_a_long_clip_shows_max_frames_evenly_spaced(tmp_path) -> None:
    video = np.repeat(np.arange(100, dtype=np.uint8)[:, None, None, None], 8, axis=1)
    video = np.repeat(np.repeat(video, 8, axis=2), 3, axis=3)  # (100, 8, 8, 3): frame i is grey i
    path = media.strip_png(tmp_path / "a.png", video, np.zeros(800), 8000, "", None, max_frames=5)
    im = np.asarray(Image.open(path).convert("RGB"))
    assert im.shape[1] == 5 * 64 + 8
    assert [im[10, 4 + 64 * i + 10, 0] for i in range(5)] == [0, 25, 50, 74, 99]


def test_silence_draws_a_dark_spectrogram(tmp_path, clip) -> None:
    video, _ = clip
    path = media.strip_png(tmp_path / "a.png", video, np.zeros(6000), 8000, "", False)
    im = np.asarray(Image.open(path).convert("RGB"))
    assert im[4 + 64 + 2 : 4 + 64 + 2 + 96, 4:-4].max() < 10


@pytest.mark.parametrize(
    ("video", "audio", "match"),
    [
        (np.zeros((2, 8, 8, 3), np.uint8), np.zeros((1, 2, 100)), "audio must be"),
        (np.zeros((2, 8, 8, 3), np.float32), np.zeros(100), "video must be"),
        (np.zeros((8, 8, 3), np.uint8), np.zeros(100), "video must be"),
        (np.zeros((2, 8, 8, 4), np.uint8), np.zeros(100), "video must be"),
        (np.zeros((2, 8, 8, 3), np.uint8), np.zeros(100, np.int16), "audio must be"),
    ],
)
def test_bad_shapes_are_clear_value_errors(tmp_path, video, audio, match) -> None:
    with pytest.raises(ValueError, match=match):
        media.strip_png(tmp_path / "a.png", video, audio, 8000, "", None)
    assert list(tmp_path.iterdir()) == []


def test_bad_rates_are_value_errors(tmp_path, clip) -> None:
    video, audio = clip
    with pytest.raises(ValueError, match="fps"):
        media.write_gif(tmp_path / "a.gif", video, fps=0)
    with pytest.raises(ValueError, match="sample_rate"):
        media.write_wav(tmp_path / "a.wav", audio, float("nan"))


def test_run_dir_save_clips_writes_each_clip(tmp_path) -> None:
    video, audio = render_batch([TEXT, "a blue ball bounces once, low beeps"])
    run = RunDir(tmp_path, tensorboard=False)
    out = run.save_clips(
        7, video, audio, np.full(2, 16.0), np.full(2, 8000), ["a", "b"], [True, False]
    )
    assert out == tmp_path / "samples" / "clips" / "step_000007"
    exts = {".gif", ".wav", ".png"} | ({".mp4"} if HAS_FFMPEG else set())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"clip_{k:02d}{e}" for k in range(2) for e in exts
    )
    with wave.open(str(out / "clip_01.wav")) as w:
        assert w.getnframes() == 6000 and w.getframerate() == 8000
    with pytest.raises(ValueError, match="agree on N"):
        run.save_clips(8, video, audio[:1], 16.0, 8000, ["a", "b"], [True, False])


@pytest.mark.skipif(not HAS_FFMPEG, reason="no ffmpeg on the PATH")
def test_mp4_has_video_and_sound(tmp_path, clip) -> None:
    video, audio = clip
    path = media.write_mp4(tmp_path / "a.mp4", video, audio, 16, 8000)
    assert path.stat().st_size > 0 and path.read_bytes()[4:8] == b"ftyp"


def test_no_ffmpeg_writes_no_mp4(tmp_path, clip, monkeypatch) -> None:
    monkeypatch.setattr(media.shutil, "which", lambda name: None)
    video, audio = clip
    assert media.write_mp4(tmp_path / "a.mp4", video, audio, 16, 8000) is None
    assert list(tmp_path.iterdir()) == []


def avbench_trajectory(texts: list[str], g: int = 2) -> Trajectory:
    rows = tuple(t for t in texts for _ in range(g))
    n = len(rows)
    video, audio = render_batch(list(rows), list(range(n)))
    batch = PromptBatch(
        texts=rows,
        input_ids=torch.zeros(n, 4, dtype=torch.int64),
        ids_hash=tuple(str(i) for i in range(n)),
        prompt_ids=torch.arange(len(texts)).repeat_interleave(g),
    )
    return Trajectory(
        prompts=batch,
        group=batch.prompt_ids.clone(),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 1),
        extra_fields={
            "video": torch.from_numpy(video),
            "audio": torch.from_numpy(audio).unsqueeze(1),  # (B, 1, S): a channel axis
            "fps": torch.full((n,), 16.0),
            "sample_rate": torch.full((n,), 8000),
        },
    )


def test_avbench_eval_carries_one_clip_per_prompt() -> None:
    task = build_task(TaskConfig(task="avbench"))
    texts = [p.text for p in task.prompts("test")[:2]]
    traj = avbench_trajectory(texts)
    result = asyncio.run(task.evaluate(traj))
    video = traj.extra_fields["video"].numpy()
    assert result.captions == texts and result.clips is not None
    np.testing.assert_array_equal(result.clips["video"], video[::2])
    np.testing.assert_array_equal(result.clips["audio"], traj.extra_fields["audio"][::2, 0])
    assert result.clips["fps"].tolist() == [16.0, 16.0]
    assert result.clips["sample_rate"].tolist() == [8000, 8000]


def eval_parts(result: EvalResult, monkeypatch) -> SimpleNamespace:
    async def evaluate_adapter(parts, adapter):
        return result

    monkeypatch.setattr(step, "evaluate_adapter", evaluate_adapter)
    return SimpleNamespace(
        actor=SimpleNamespace(eval_adapter="default"),
        cfg=SimpleNamespace(run=SimpleNamespace(eval_live=False)),
    )


def test_run_eval_writes_the_clips(tmp_path, monkeypatch) -> None:
    video, audio = render_batch([TEXT])
    clips = {
        "video": video,
        "audio": audio,
        "fps": np.array([16.0]),
        "sample_rate": np.array([8000]),
    }
    result = EvalResult({"eval/overall": 1.0}, video[:, 6], [TEXT], [True], clips)
    run = RunDir(tmp_path, tensorboard=False)
    assert asyncio.run(step.run_eval(eval_parts(result, monkeypatch), run, 3)) == {
        "eval/overall": 1.0
    }
    assert (tmp_path / "samples" / "clips" / "step_000003" / "clip_00.gif").exists()


def test_a_bad_clip_warns_and_the_eval_goes_on(tmp_path, monkeypatch, capsys) -> None:
    video, audio = render_batch([TEXT])
    clips = {"video": video, "audio": audio[:, None, None], "fps": 16.0, "sample_rate": 8000}
    result = EvalResult({"eval/overall": 0.5}, video[:, 6], [TEXT], [False], clips)
    run = RunDir(tmp_path, tensorboard=False)
    assert asyncio.run(step.run_eval(eval_parts(result, monkeypatch), run, 4)) == {
        "eval/overall": 0.5
    }
    assert (tmp_path / "samples" / "step_000004.png").exists()  # the grid is still written
    assert "sample clips not written" in capsys.readouterr().err
