"""Sample clips as files people open: a WAV, an animated GIF, a PNG strip (frames over the
spectrogram), and an MP4 with sound where an ``ffmpeg`` is on the PATH.

Plain functions over numpy arrays; numpy, PIL and the standard library only. Every file is
written beside its path and moved over it, so a kill leaves the old file or the new one, whole.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
import textwrap
import wave
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from diffrl.diskio import replacing  # a disk error is one line; the old file stays whole

# pass / fail; a None verdict (no verdict) falls back to NO_VERDICT
VERDICT_COLOURS: dict[bool | None, tuple[int, int, int]] = {
    True: (30, 170, 60),
    False: (210, 40, 40),
}
NO_VERDICT = (150, 150, 150)  # grey: the task gives no verdict


def caption_font() -> ImageFont.ImageFont:
    """PIL's bitmap font, 6 px a character, spaces included: what captions are wrapped for.
    Pillow >= 10.1's ``load_default()`` is a FreeType font whose space is 2 px wide, so a
    wrapped caption read "boat tied toa dock"."""
    return ImageFont.load_default_imagefont()


# the spectrogram's colour map, quiet to loud: black, purple, orange, pale yellow
_STOPS = np.array([[0, 0, 4], [120, 30, 130], [240, 110, 40], [252, 250, 190]], dtype=np.float64)


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> Path:
    """audio (S,) float in [-1, 1] -> a 16-bit PCM mono WAV; samples beyond [-1, 1] are clipped
    and samples that are not finite written as silence (a diverged clip is still worth hearing)."""
    pcm = np.round(_mono(audio) * 32767).astype("<i2")
    rate = _rate(sample_rate, "sample_rate")  # checked before a file is opened
    with replacing(path) as tmp, wave.open(str(tmp), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return Path(path)


def write_gif(path: Path, video: np.ndarray, fps: float, scale: int | None = None) -> Path:
    """video (T, H, W, 3) uint8 -> an animated GIF that loops forever, each frame ``1/fps`` s
    (GIF counts in 10 ms, so 16 fps plays at 60 ms). Frames are upscaled ``scale`` times with
    nearest-neighbour, by default to about 128 px, so a 32 px clip is visible. Two identical
    frames in a row are stored once with the summed duration (PIL does that; timing is kept)."""
    frames = _frames(video, _video(video).shape[1] * (scale or _scale_to(video, 128)))
    ms = 1000 / _rate(fps, "fps")
    with replacing(path) as tmp:
        frames[0].save(
            tmp, format="GIF", save_all=True, append_images=frames[1:], duration=ms, loop=0
        )
    return Path(path)


def spectrogram(
    audio: np.ndarray, sample_rate: int, n_fft: int | None = None, hop: int | None = None
) -> np.ndarray:
    """(F, N) log-magnitude STFT in dB: F = n_fft // 2 + 1 rows from 0 Hz (row 0) up to
    sample_rate / 2, row f at f * sample_rate / n_fft Hz; N Hann-windowed frames ``hop`` samples
    apart. ``n_fft`` defaults to the power of two nearest 32 ms (256 at 8 kHz), ``hop`` to a
    quarter of it. Audio shorter than one window is padded with silence."""
    x = _mono(audio)
    n_fft = n_fft or 2 ** round(math.log2(_rate(sample_rate, "sample_rate") * 0.032))
    hop = hop or max(1, n_fft // 4)
    if x.size < n_fft:
        x = np.pad(x, (0, n_fft - x.size))
    windows = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop]  # (N, n_fft)
    mag = np.abs(np.fft.rfft(windows * np.hanning(n_fft), axis=1))  # (N, F)
    return 20 * np.log10(mag.T + 1e-10)


def strip_png(
    path: Path,
    video: np.ndarray,
    audio: np.ndarray,
    sample_rate: int,
    caption: str,
    ok: bool | None,
    frame_px: int = 64,
    spec_px: int = 96,
    max_frames: int = 24,
) -> Path:
    """One clip on one PNG: its T frames side by side (each ``frame_px`` high; past
    ``max_frames``, that many evenly spaced, so a 121-frame clip stays a readable strip), under
    them the spectrogram stretched to the same width (``spec_px`` high, low frequencies at the
    bottom, 80 dB shown), inside a green / red / grey border for pass / fail / no verdict, and
    the caption wrapped under it."""
    t = len(_video(video))
    frames = _frames(video[np.linspace(0, t - 1, min(t, max_frames)).round().astype(int)], frame_px)
    frame_w = frames[0].width
    width = len(frames) * frame_w
    db = spectrogram(audio, sample_rate)[::-1]  # (F, N), flipped: low frequencies at the bottom
    # the top is at least 0 dB (a sine of amplitude 4 / n_fft), so silence shows black rather
    # than as the loudest thing in the picture
    level = np.clip((db - max(db.max(), 0.0)) / 80 + 1, 0, 1)
    spec = Image.fromarray(_colour(level)).resize((width, spec_px), Image.Resampling.BILINEAR)

    pad, gap, line_h = 4, 2, 11
    lines = textwrap.wrap(caption, max(8, (width + 2 * pad) // 6)) or [""]  # ~6 px a character
    box_h = pad + frame_px + gap + spec_px + pad
    canvas = Image.new("RGB", (width + 2 * pad, box_h + 4 + line_h * len(lines)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.rectangle([1, 1, width + 2 * pad - 2, box_h - 2], fill=VERDICT_COLOURS.get(ok, NO_VERDICT))
    for i, frame in enumerate(frames):
        canvas.paste(frame, (pad + i * frame_w, pad))
    canvas.paste(spec, (pad, pad + frame_px + gap))
    draw.text((2, box_h + 2), "\n".join(lines), fill=(0, 0, 0), font=caption_font(), spacing=1)
    with replacing(path) as tmp:
        canvas.save(tmp, format="PNG")
    return Path(path)


def write_mp4(
    path: Path, video: np.ndarray, audio: np.ndarray, fps: float, sample_rate: int
) -> Path | None:
    """video (T, H, W, 3) uint8 and audio (S,) float -> an MP4 with sound, upscaled as the GIF
    is, in the default MP4 codecs of the ``ffmpeg`` on the PATH (H.264 and AAC in most builds);
    None, and nothing written, where there is no ffmpeg. An ffmpeg that fails or hangs raises
    OSError with its last words."""
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        return None
    fps = _rate(fps, "fps")
    height = _video(video).shape[1] * _scale_to(video, 128)
    frames = np.stack([np.asarray(f) for f in _frames(video, height)])  # (T, H', W', 3)
    frames = frames[:, : frames.shape[1] // 2 * 2, : frames.shape[2] // 2 * 2]  # yuv420p: even
    with tempfile.TemporaryDirectory() as d, replacing(path) as tmp:
        raw, wav = Path(d) / "video.rgb", Path(d) / "audio.wav"
        raw.write_bytes(np.ascontiguousarray(frames).tobytes())
        write_wav(wav, audio, sample_rate)
        _, h, w, _ = frames.shape
        video_in = ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{w}x{h}", "-r", str(fps)]
        cmd = [ffmpeg, "-y", "-loglevel", "error", *video_in, "-i", str(raw), "-i", str(wav)]
        cmd += ["-pix_fmt", "yuv420p", "-f", "mp4", str(tmp)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        except subprocess.CalledProcessError as e:
            raise OSError(f"ffmpeg failed writing {path}: {e.stderr.strip()[-500:]}") from e
        except subprocess.TimeoutExpired as e:
            raise OSError(f"ffmpeg took over {e.timeout} s writing {path}") from e
    return Path(path)


def _video(video: np.ndarray) -> np.ndarray:
    if not (isinstance(video, np.ndarray) and video.dtype == np.uint8 and video.ndim == 4):
        got = f"{getattr(video, 'shape', '?')} {getattr(video, 'dtype', type(video).__name__)}"
        raise ValueError(f"video must be (T, H, W, 3) uint8, got {got}")
    if video.shape[-1] != 3 or 0 in video.shape:
        raise ValueError(f"video must be (T, H, W, 3) uint8 with T, H, W >= 1, got {video.shape}")
    return video


def _mono(audio: np.ndarray) -> np.ndarray:
    """(S,) float64 in [-1, 1]; what is not finite becomes silence."""
    a = np.asarray(audio)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"audio must be (S,) float in [-1, 1], got {a.shape} {a.dtype}")
    return np.clip(np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0), -1, 1)


def _rate(value, name: str):
    """A positive, finite fps or sample rate (a sample rate as int)."""
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return int(round(v)) if name == "sample_rate" else v


def _scale_to(video: np.ndarray, px: int) -> int:
    """The whole upscale factor that brings the larger side of a frame to about ``px``."""
    return max(1, round(px / max(_video(video).shape[1:3])))


def _frames(video: np.ndarray, height: int) -> list[Image.Image]:
    """Each frame as a PIL image ``height`` px high, its aspect kept: upscaled sharply with
    nearest-neighbour (pixel art stays pixel art), downscaled smoothly."""
    _, h, w, _ = _video(video).shape
    size = (max(1, round(w * height / h)), height)
    resample = Image.Resampling.NEAREST if height >= h else Image.Resampling.LANCZOS
    return [Image.fromarray(f).resize(size, resample) for f in video]


def _colour(level: np.ndarray) -> np.ndarray:
    """(F, N) in [0, 1] -> (F, N, 3) uint8 through the colour map's stops."""
    x = np.linspace(0, 1, len(_STOPS))
    rgb = [np.interp(level, x, _STOPS[:, c]) for c in range(3)]
    return np.stack(rgb, axis=-1).round().astype(np.uint8)
