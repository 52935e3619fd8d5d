"""Ground-truth AVBench clips: a bouncing ball (video) and a beep at each floor contact (audio).

Video: ``FRAMES`` frames of ``SIZE`` x ``SIZE`` RGB at ``FPS``. A disc of the prompt's colour
drifts across a plain grey background; its height follows one ``|sin|`` arc per bounce, so
with n bounces the floor contacts fall at frames ``(k + 1/2) * FRAMES / n`` (k = 0..n-1:
frame 6 for one bounce; 3, 9 for two; 2, 6, 10 for three), never at the clip's ends.

Audio: ``FRAMES / FPS`` = 0.75 s of mono ``SAMPLE_RATE`` audio: a Hann-windowed sine beep at
the prompt's pitch centred on each contact time (frame / FPS), light noise elsewhere.

The seed sets only what the prompt leaves open (start side and position, background shade,
beep loudness, noise), so a clip is a deterministic function of (prompt, seed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from diffrl.tasks.avbench.prompts import COLORS, AVPrompt, parse_prompt

FRAMES = 12
SIZE = 32
FPS = 16
SAMPLE_RATE = 8000
SAMPLES = FRAMES * SAMPLE_RATE // FPS  # 6000 = 0.75 s

MIN_FRAMES = 10
BALL_RADIUS = 4.0  # px at SIZE 32
FLOOR_CY, TOP_CY = 27.0, 9.0  # ball centre row at a floor contact / at the top of an arc
TRAVEL = 12.0  # horizontal drift over the clip, px
BEEP_SECONDS = 0.06
NOISE_STD = 0.003


def contact_frames(bounces: int, frames: int = FRAMES) -> np.ndarray:
    """(bounces,) float frame indices of the floor contacts (integers for 12 frames)."""
    return (np.arange(bounces) + 0.5) * frames / bounces


def heights(bounces: int, frames: int = FRAMES) -> np.ndarray:
    """(frames,) height above the floor in [0, 1]: one |sin| arc per bounce, 0 at contacts."""
    period = frames / bounces
    f = np.arange(frames, dtype=np.float64)
    return np.abs(np.sin(np.pi * (f - period / 2) / period))


def _rng(prompt: AVPrompt, seed: int, stream: int) -> np.random.Generator:
    """One generator per (prompt, seed) and stream (0 video, 1 audio), so either medium can be
    rendered alone and still match the other."""
    key = int.from_bytes(hashlib.sha256(prompt.text.encode()).digest()[:8], "little")
    return np.random.default_rng([int(seed), key, stream])


def _as_prompt(prompt: AVPrompt | str) -> AVPrompt:
    return prompt if isinstance(prompt, AVPrompt) else parse_prompt(prompt)


@dataclass(frozen=True)
class ClipSpec:
    """A clip's geometry; the default is AVBench's. Another spec renders the same scenes at a
    model's own frame count, size and rates (pixel distances scale with ``size``)."""

    frames: int = FRAMES
    size: int = SIZE
    fps: float = FPS
    sample_rate: int = SAMPLE_RATE

    @property
    def samples(self) -> int:
        return round(self.frames / self.fps * self.sample_rate)

    def __post_init__(self) -> None:
        # three |sin| arcs need >= 10 frames for every contact to be an interior minimum;
        # the high band (2 kHz, edge 3.5 kHz) needs a Nyquist frequency above 3.5 kHz
        if self.frames < MIN_FRAMES or self.size < 16 or self.fps <= 0 or self.sample_rate < 8000:
            raise ValueError(
                f"{self}: AVBench clips need frames >= {MIN_FRAMES}, size >= 16, fps > 0 and "
                "sample_rate >= 8000"
            )
        if self.frames / self.fps < 0.25:
            raise ValueError(f"{self}: a clip shorter than 0.25 s cannot fit three beeps")


DEFAULT_SPEC = ClipSpec()


def render_video(
    prompt: AVPrompt | str, seed: int = 0, spec: ClipSpec = DEFAULT_SPEC
) -> np.ndarray:
    """(frames, size, size, 3) uint8 ground-truth frames."""
    p = _as_prompt(prompt)
    rng = _rng(p, seed, 0)
    k, t = spec.size / SIZE, spec.frames
    start = rng.uniform(7.0, 11.0) * k
    cx = start + TRAVEL * k * np.arange(t) / (t - 1)  # (T,)
    if rng.random() < 0.5:  # drift right-to-left instead
        cx = spec.size - cx
    cy = (FLOOR_CY - (FLOOR_CY - TOP_CY) * heights(p.bounces, t)) * k  # (T,)
    background = int(rng.integers(15, 46))
    centres = np.arange(spec.size) + 0.5  # pixel (r, c) covers [c, c+1) x [r, r+1)
    rows, cols = centres[None, :, None], centres[None, None, :]
    radius = BALL_RADIUS * k
    inside = (cols - cx[:, None, None]) ** 2 + (rows - cy[:, None, None]) ** 2 <= radius**2
    video = np.full((t, spec.size, spec.size, 3), background, dtype=np.uint8)
    video[inside] = COLORS[p.color]  # inside: (T, H, W)
    return video


def render_audio(
    prompt: AVPrompt | str, seed: int = 0, spec: ClipSpec = DEFAULT_SPEC
) -> np.ndarray:
    """(samples,) float32 in [-1, 1]: a beep centred on each contact, noise elsewhere."""
    p = _as_prompt(prompt)
    rng = _rng(p, seed, 1)
    t = np.arange(spec.samples) / spec.sample_rate
    audio = rng.normal(0.0, NOISE_STD, spec.samples)
    half = BEEP_SECONDS / 2
    for frame in contact_frames(p.bounces, spec.frames):
        centre = frame / spec.fps
        near = np.abs(t - centre) < half
        window = 0.5 + 0.5 * np.cos(np.pi * (t[near] - centre) / half)  # Hann, peak at centre
        # a cosine in phase with the contact: the waveform is the prompt's, only its loudness is
        # left open. (A random phase made every waveform sample's mean over seeds zero, so a
        # flow model's loss barely saw the beeps: the AVBench base learned the video, not them.)
        amp = rng.uniform(0.4, 0.6)
        audio[near] += amp * window * np.cos(2 * np.pi * p.frequency * (t[near] - centre))
    return np.clip(audio, -1.0, 1.0).astype(np.float32)


def render(
    prompt: AVPrompt | str, seed: int = 0, spec: ClipSpec = DEFAULT_SPEC
) -> tuple[np.ndarray, np.ndarray]:
    """One ground-truth clip: video (T, H, W, 3) uint8 and audio (samples,) float32."""
    return render_video(prompt, seed, spec), render_audio(prompt, seed, spec)


def render_batch(
    prompts: list[AVPrompt] | list[str],
    seeds: list[int] | np.ndarray | None = None,
    spec: ClipSpec = DEFAULT_SPEC,
) -> tuple[np.ndarray, np.ndarray]:
    """Clips for a batch: video (B, T, H, W, 3) uint8 and audio (B, samples) float32.
    ``seeds`` defaults to 0 for every clip."""
    seeds = [0] * len(prompts) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
    clips = [render(p, s, spec) for p, s in zip(prompts, seeds, strict=True)]
    return np.stack([v for v, _ in clips]), np.stack([a for _, a in clips])


def conditions(
    prompt: AVPrompt | str, seed: int = 0, spec: ClipSpec = DEFAULT_SPEC
) -> dict[str, np.ndarray]:
    """FL2VA conditions: the ground-truth first and last frames, (H, W, 3) uint8 each."""
    video = render_video(prompt, seed, spec)
    return {"first_frame": video[0].copy(), "last_frame": video[-1].copy()}
