"""Ground-truth AVBench clips: a bouncing ball (video) and a beep at each floor contact (audio).

Video: ``FRAMES`` frames of ``SIZE`` x ``SIZE`` RGB at ``FPS``. A disc of the prompt's colour
drifts across a plain grey background; its height follows one ``|sin|`` arc per bounce, so
with n bounces the floor contacts fall at frames ``(k + 1/2) * FRAMES / n`` (k = 0..n-1:
frame 6 for one bounce; 3, 9 for two; 2, 6, 10 for three), never at the clip's ends.

Audio: ``FRAMES / FPS`` = 0.75 s of mono ``SAMPLE_RATE`` audio: a Hann-windowed sine beep at
the prompt's pitch centred on each contact time (frame / FPS), light noise elsewhere.

The seed sets only what the prompt leaves open (start side and position, background shade,
beep loudness and phase, noise), so a clip is a deterministic function of (prompt, seed).
"""

from __future__ import annotations

import hashlib

import numpy as np

from diffrl.tasks.avbench.prompts import COLORS, AVPrompt, parse_prompt

FRAMES = 12
SIZE = 32
FPS = 16
SAMPLE_RATE = 8000
SAMPLES = FRAMES * SAMPLE_RATE // FPS  # 6000 = 0.75 s

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


def render_video(prompt: AVPrompt | str, seed: int = 0) -> np.ndarray:
    """(FRAMES, SIZE, SIZE, 3) uint8 ground-truth frames."""
    p = _as_prompt(prompt)
    rng = _rng(p, seed, 0)
    start = rng.uniform(7.0, 11.0)
    cx = start + TRAVEL * np.arange(FRAMES) / (FRAMES - 1)  # (T,)
    if rng.random() < 0.5:  # drift right-to-left instead
        cx = SIZE - cx
    cy = FLOOR_CY - (FLOOR_CY - TOP_CY) * heights(p.bounces)  # (T,)
    background = int(rng.integers(15, 46))
    centres = np.arange(SIZE) + 0.5  # pixel (r, c) covers [c, c+1) x [r, r+1)
    rows, cols = centres[None, :, None], centres[None, None, :]
    inside = (cols - cx[:, None, None]) ** 2 + (rows - cy[:, None, None]) ** 2 <= BALL_RADIUS**2
    video = np.full((FRAMES, SIZE, SIZE, 3), background, dtype=np.uint8)
    video[inside] = COLORS[p.color]  # inside: (T, H, W)
    return video


def render_audio(prompt: AVPrompt | str, seed: int = 0) -> np.ndarray:
    """(SAMPLES,) float32 in [-1, 1]: a beep centred on each contact, noise elsewhere."""
    p = _as_prompt(prompt)
    rng = _rng(p, seed, 1)
    t = np.arange(SAMPLES) / SAMPLE_RATE
    audio = rng.normal(0.0, NOISE_STD, SAMPLES)
    half = BEEP_SECONDS / 2
    for frame in contact_frames(p.bounces):
        centre = frame / FPS
        near = np.abs(t - centre) < half
        window = 0.5 + 0.5 * np.cos(np.pi * (t[near] - centre) / half)  # Hann, peak at centre
        amp, phase = rng.uniform(0.4, 0.6), rng.uniform(0, 2 * np.pi)
        audio[near] += amp * window * np.sin(2 * np.pi * p.frequency * t[near] + phase)
    return np.clip(audio, -1.0, 1.0).astype(np.float32)


def render(prompt: AVPrompt | str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One ground-truth clip: video (T, H, W, 3) uint8 and audio (samples,) float32."""
    return render_video(prompt, seed), render_audio(prompt, seed)


def render_batch(
    prompts: list[AVPrompt] | list[str], seeds: list[int] | np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Clips for a batch: video (B, T, H, W, 3) uint8 and audio (B, samples) float32.
    ``seeds`` defaults to 0 for every clip."""
    seeds = [0] * len(prompts) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
    clips = [render(p, s) for p, s in zip(prompts, seeds, strict=True)]
    return np.stack([v for v, _ in clips]), np.stack([a for _, a in clips])


def conditions(prompt: AVPrompt | str, seed: int = 0) -> dict[str, np.ndarray]:
    """FL2VA conditions: the ground-truth first and last frames, (H, W, 3) uint8 each."""
    video = render_video(prompt, seed)
    return {"first_frame": video[0].copy(), "last_frame": video[-1].copy()}
