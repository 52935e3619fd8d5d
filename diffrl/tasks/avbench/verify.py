"""AVBench's exact verifiers: programs over pixels and samples, no learned judge.

Two measurements per clip, each kept so that a failure can be inspected:

- ``analyze_audio`` finds the beeps: peaks of the RMS energy envelope (20 ms windows, 5 ms hop,
  ``scipy.signal.find_peaks``), and the dominant frequency of each beep's loud segment (the
  region around its peak above half the peak's energy) by FFT.
- ``analyze_video`` tracks the ball: per frame, the connected blobs that differ from the
  frame's background (its per-channel median) and cover at least ``MIN_OBJECT_SHARE`` of the
  rendered ball's area count as objects; the largest is the ball. Its centre row, its colour
  (the nearest palette hue of its pixels), and the floor contacts as the local minima of its
  height (peaks of the centre row with a prominence of ``CONTACT_PROMINENCE`` px), counted only
  when every frame shows exactly one object: a clip with a second ball in any frame (trained
  T2VA clips hedge the start side that way) or with a frame that lost the ball has no single
  trajectory.

Six checks grouped in four verifiers (``VERIFIERS``), each per clip a boolean and a fraction
(1.0 when the check passes, else partial credit in [0, 1)):

- text-audio: ``pitch`` (every beep in the prompt's band; fraction: the share of beeps that
  are), ``beep_count`` (as many beeps as bounces; fraction: 1 - |error| / wanted);
- audio-video sync: ``sync`` (beeps and contacts pair one-to-one within ±1 frame; fraction:
  pairs / max(beeps, contacts));
- visual: ``color`` (exactly one ball in every frame, mostly of the prompt's colour; fraction:
  the share of its pixels that are, times the share of frames with exactly one ball),
  ``bounce_count`` (contacts = bounces; fraction as for beeps);
- FL2VA: ``frames`` (the clip's first and last frames match the given ones; fraction: the
  share of the two that do). A frame matches when its mean absolute error is under
  ``FRAME_MAE`` over the whole frame and under ``REGION_MAE`` over the object region (pixels
  that are foreground in either frame): the region term catches a wrong-coloured or misplaced
  ball, which changes too few pixels to move the whole-frame mean much.

Pixel thresholds are for 32 px frames and scale with the frame's height.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage
from scipy.signal import find_peaks

from diffrl.tasks.avbench.prompts import COLORS, PITCHES, AVPrompt
from diffrl.tasks.avbench.render import BALL_RADIUS

VERIFIERS: dict[str, tuple[str, ...]] = {
    "text_audio": ("pitch", "beep_count"),
    "av_sync": ("sync",),
    "visual": ("color", "bounce_count"),
    "frames": ("frames",),  # FL2VA only
}

# audio
ENV_WINDOW_S, ENV_HOP_S = 0.020, 0.005
MIN_BEEP_RMS = 0.02  # an envelope below this everywhere is silence (no beeps)
BEEP_REL_HEIGHT = 0.3  # a beep peaks above this share of the loudest one
MIN_BEEP_GAP_S = 0.08  # two peaks closer than this are one beep
MIN_PITCH_HZ = 50.0
# band edges at the geometric midpoints of 300 / 800 / 2000 Hz
BANDS: dict[str, tuple[float, float]] = {
    "low": (150.0, float(np.sqrt(300.0 * 800.0))),
    "mid": (float(np.sqrt(300.0 * 800.0)), float(np.sqrt(800.0 * 2000.0))),
    "high": (float(np.sqrt(800.0 * 2000.0)), 3500.0),
}
assert all(lo <= PITCHES[b] < hi for b, (lo, hi) in BANDS.items())
# video (px at 32)
FOREGROUND_DIFF = 48  # max channel difference from the background that makes a pixel the ball's
BALL_AREA = np.pi * BALL_RADIUS**2  # ~50 px: the rendered ball
# A foreground blob is an object (the ball, or a second one) from a third of the ball's area
# (~17 px at 32, ~4 px at 16): a ball of 0.6 the radius counts; noise and stray pixels do not.
# Ground truth at 16-64 px, clean, with 0.8 px blur + N(0, 8) or with N(0, 16): the ball
# covers >= 0.8 of BALL_AREA and no second blob over 0.16 of it. The AVBench base model's
# clips (16 px) show second balls of 0.6-0.8 of its area in their first frames.
MIN_OBJECT_SHARE = 1 / 3
MIN_SATURATION = 0.25  # below this a pixel has no hue
CONTACT_PROMINENCE = 4.0
SYNC_TOLERANCE_FRAMES = 1.0
FRAME_MAE, REGION_MAE = 10.0, 40.0


@dataclass(frozen=True)
class AudioEvents:
    times: np.ndarray  # (K,) seconds: each beep's energy peak
    pitches: np.ndarray  # (K,) Hz: each beep's dominant frequency


@dataclass(frozen=True)
class BallTrack:
    cy: np.ndarray  # (T,) ball centre row per frame (pixel units); NaN where none was found
    contacts: np.ndarray  # (K,) int64 floor-contact frames; empty unless every frame has one ball
    color_share: dict[str, float]  # palette colour -> share of the ball's hued pixels
    objects: np.ndarray  # (T,) int64 object-sized blobs per frame: 1 in each in ground truth

    @property
    def one_ball(self) -> bool:
        """Exactly one object in every frame: no frame lost the ball, none shows a second."""
        return bool((self.objects == 1).all())


@dataclass(frozen=True)
class Checks:
    """Per-clip results of some checks (names from ``VERIFIERS``)."""

    passed: dict[str, np.ndarray]  # name -> (B,) bool
    fractions: dict[str, np.ndarray]  # name -> (B,) float in [0, 1]; 1.0 exactly when passed

    @property
    def overall(self) -> np.ndarray:  # (B,) bool: every check passes
        return np.logical_and.reduce(list(self.passed.values()))

    @property
    def partial(self) -> np.ndarray:  # (B,) float: the mean of the check fractions
        return np.mean(list(self.fractions.values()), axis=0)

    def merge(self, other: Checks) -> Checks:
        return Checks({**self.passed, **other.passed}, {**self.fractions, **other.fractions})


# --------------------------------------------------------------------------- measurements


def band_of(freq: float) -> str | None:
    return next((b for b, (lo, hi) in BANDS.items() if lo <= freq < hi), None)


def analyze_audio(audio: np.ndarray, sample_rate: int) -> AudioEvents:
    """The beeps of one (samples,) clip: their times and dominant frequencies."""
    audio = np.asarray(audio, dtype=np.float64)
    none = AudioEvents(np.zeros(0), np.zeros(0))
    win, hop = round(ENV_WINDOW_S * sample_rate), max(1, round(ENV_HOP_S * sample_rate))
    if audio.ndim != 1:
        raise ValueError(f"audio must be (samples,), got {audio.shape}")
    if audio.size < win or not np.isfinite(audio).all():
        return none
    frames = np.lib.stride_tricks.sliding_window_view(audio, win)[::hop]  # (E, win)
    env = np.sqrt((frames**2).mean(axis=1))  # (E,) RMS envelope
    if env.max() < MIN_BEEP_RMS:
        return none
    height = max(MIN_BEEP_RMS, BEEP_REL_HEIGHT * env.max())
    gap = max(1, round(MIN_BEEP_GAP_S * sample_rate / hop))
    peaks, _ = find_peaks(env, height=height, distance=gap, prominence=height / 2)
    times, pitches = [], []
    for peak in peaks:
        loud = env >= env[peak] / 2
        lo, hi = peak, peak  # the contiguous loud segment around the peak
        while lo > 0 and loud[lo - 1]:
            lo -= 1
        while hi < env.size - 1 and loud[hi + 1]:
            hi += 1
        seg = audio[lo * hop : hi * hop + win]
        n_fft = max(4096, int(2 ** np.ceil(np.log2(seg.size))))
        spectrum = np.abs(np.fft.rfft(seg * np.hanning(seg.size), n_fft))
        freqs = np.fft.rfftfreq(n_fft, 1 / sample_rate)
        spectrum[freqs < MIN_PITCH_HZ] = 0
        times.append((peak * hop + win / 2) / sample_rate)
        pitches.append(float(freqs[spectrum.argmax()]))
    return AudioEvents(np.asarray(times), np.asarray(pitches))


_PALETTE_NAMES = tuple(COLORS)


def _hue(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, 3) uint8 -> hue in degrees [0, 360) and saturation (HSV), each (N,)."""
    x = rgb.astype(np.float64) / 255
    mx, mn = x.max(axis=1), x.min(axis=1)
    delta = np.where(mx > mn, mx - mn, 1.0)
    r, g, b = x.T
    hue = np.select(
        [mx == r, mx == g], [((g - b) / delta) % 6, (b - r) / delta + 2], (r - g) / delta + 4
    )
    sat = np.where(mx > 0, (mx - mn) / np.where(mx > 0, mx, 1.0), 0.0)
    return hue * 60.0, sat


_PALETTE_HUES = _hue(np.array(list(COLORS.values()), dtype=np.uint8))[0]  # (4,)


def _foreground(frame: np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels far from the frame's background (its per-channel median)."""
    background = np.median(frame.reshape(-1, 3), axis=0)
    return np.abs(frame.astype(np.float64) - background).max(axis=-1) > FOREGROUND_DIFF


def analyze_video(video: np.ndarray) -> BallTrack:
    """Track the ball through one (T, H, W, 3) uint8 clip."""
    if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
        raise ValueError(f"video must be (T, H, W, 3) uint8, got {video.shape} {video.dtype}")
    min_area = MIN_OBJECT_SHARE * BALL_AREA * (video.shape[1] / 32) ** 2
    cy = np.full(video.shape[0], np.nan)
    objects = np.zeros(video.shape[0], dtype=np.int64)
    hue_counts = np.zeros(len(COLORS))
    for f, frame in enumerate(video):
        labels, n = ndimage.label(_foreground(frame), structure=np.ones((3, 3)))
        if n == 0:
            continue
        sizes = ndimage.sum_labels(np.ones_like(labels), labels, index=np.arange(1, n + 1))
        objects[f] = int((sizes >= min_area).sum())
        if objects[f] == 0:
            continue
        rows, cols = np.nonzero(labels == 1 + int(sizes.argmax()))
        cy[f] = rows.mean() + 0.5
        hue, sat = _hue(frame[rows, cols])
        dist = np.abs((hue[:, None] - _PALETTE_HUES[None, :] + 180) % 360 - 180)  # (N, 4)
        hue_counts += np.bincount(dist[sat >= MIN_SATURATION].argmin(axis=1), minlength=4)
    total = hue_counts.sum()
    share = {c: float(hue_counts[i] / total) if total else 0.0 for i, c in enumerate(COLORS)}
    contacts = np.zeros(0, dtype=np.int64)
    if (objects == 1).all():  # a lost or doubled ball has no one trajectory to count bounces on
        contacts, _ = find_peaks(cy, prominence=CONTACT_PROMINENCE * video.shape[1] / 32)
    return BallTrack(cy, np.asarray(contacts, dtype=np.int64), share, objects)


# --------------------------------------------------------------------------- checks


def _count_fraction(found: int, wanted: int) -> float:
    return max(0.0, 1.0 - abs(found - wanted) / wanted)


def _matched(a: np.ndarray, b: np.ndarray, tol: float) -> int:
    """The most one-to-one pairs of sorted points a, b within tol (greedy is optimal on a line)."""
    a, b = np.sort(a), np.sort(b)
    i = j = pairs = 0
    while i < a.size and j < b.size:
        if abs(a[i] - b[j]) <= tol:
            pairs, i, j = pairs + 1, i + 1, j + 1
        elif a[i] < b[j]:
            i += 1
        else:
            j += 1
    return pairs


def _text_audio(ev: AudioEvents, p: AVPrompt) -> dict[str, tuple[bool, float]]:
    lo, hi = BANDS[p.pitch]
    in_band = (ev.pitches >= lo) & (ev.pitches < hi)
    k = ev.times.size
    return {
        "pitch": (bool(k and in_band.all()), float(in_band.mean()) if k else 0.0),
        "beep_count": (k == p.bounces, _count_fraction(k, p.bounces)),
    }


def _sync(ev: AudioEvents, track: BallTrack, fps: float) -> dict[str, tuple[bool, float]]:
    beeps, contacts = ev.times * fps, track.contacts.astype(np.float64)  # both in frames
    most = max(beeps.size, contacts.size)
    frac = _matched(beeps, contacts, SYNC_TOLERANCE_FRAMES) / most if most else 0.0
    return {"sync": (frac == 1.0, frac)}


def _visual(track: BallTrack, p: AVPrompt) -> dict[str, tuple[bool, float]]:
    share = track.color_share
    dominant = max(share, key=share.get) if any(share.values()) else None
    color_ok = track.one_ball and dominant == p.color
    one_ball_frames = float((track.objects == 1).mean())  # a second ball earns no credit
    k = track.contacts.size
    return {
        "color": (color_ok, 1.0 if color_ok else min(share[p.color] * one_ball_frames, 0.99)),
        "bounce_count": (k == p.bounces, _count_fraction(k, p.bounces)),
    }


def frame_errors(frame: np.ndarray, given: np.ndarray) -> tuple[float, float]:
    """(whole-frame MAE, object-region MAE) between two (H, W, 3) uint8 frames, on 0..255."""
    diff = np.abs(frame.astype(np.float64) - given.astype(np.float64))
    region = _foreground(frame) | _foreground(given)
    return float(diff.mean()), float(diff[region].mean()) if region.any() else 0.0


def _frames(video: np.ndarray, first: np.ndarray, last: np.ndarray) -> dict:
    ok = [
        whole < FRAME_MAE and region < REGION_MAE
        for whole, region in (frame_errors(video[0], first), frame_errors(video[-1], last))
    ]
    return {"frames": (all(ok), float(np.mean(ok)))}


def _collect(per_clip: list[dict[str, tuple[bool, float]]]) -> Checks:
    names = per_clip[0].keys() if per_clip else ()
    return Checks(
        {n: np.array([c[n][0] for c in per_clip], dtype=bool) for n in names},
        {n: np.array([c[n][1] for c in per_clip], dtype=np.float64) for n in names},
    )


def _per_clip(value, n: int) -> list[float]:
    """A scalar or (B,) rate (fps, sample rate) as one per clip."""
    arr = np.broadcast_to(np.asarray(value, dtype=np.float64).reshape(-1), (n,))
    return arr.tolist()


def verify_text_audio(audio: np.ndarray, prompts: list[AVPrompt], sample_rate) -> Checks:
    """``pitch`` and ``beep_count`` for (B, samples) audio."""
    rates = _per_clip(sample_rate, len(prompts))
    return _collect(
        [
            _text_audio(analyze_audio(a, int(sr)), p)
            for a, p, sr in zip(audio, prompts, rates, strict=True)
        ]
    )


def verify_sync(video: np.ndarray, audio: np.ndarray, fps, sample_rate) -> Checks:
    """``sync`` for (B, T, H, W, 3) video and (B, samples) audio."""
    n = len(video)
    fpss, rates = _per_clip(fps, n), _per_clip(sample_rate, n)
    return _collect(
        [
            _sync(analyze_audio(a, int(sr)), analyze_video(v), f)
            for v, a, f, sr in zip(video, audio, fpss, rates, strict=True)
        ]
    )


def verify_visual(video: np.ndarray, prompts: list[AVPrompt]) -> Checks:
    """``color`` and ``bounce_count`` for (B, T, H, W, 3) video."""
    return _collect([_visual(analyze_video(v), p) for v, p in zip(video, prompts, strict=True)])


def verify_frames(video: np.ndarray, first: np.ndarray, last: np.ndarray) -> Checks:
    """``frames`` for (B, T, H, W, 3) video against (B, H, W, 3) first and last frames."""
    return _collect([_frames(v, f, la) for v, f, la in zip(video, first, last, strict=True)])


def verify_clips(
    video: np.ndarray,
    audio: np.ndarray,
    prompts: list[AVPrompt],
    fps=16,
    sample_rate=8000,
    first: np.ndarray | None = None,
    last: np.ndarray | None = None,
) -> Checks:
    """Every verifier on a batch, each clip measured once; ``frames`` only when ``first`` and
    ``last`` (the FL2VA conditions) are given. video (B, T, H, W, 3) uint8, audio (B, S)."""
    video, audio = np.asarray(video), np.asarray(audio)
    if not (len(video) == len(audio) == len(prompts)):
        raise ValueError(f"got {len(video)} videos, {len(audio)} audios, {len(prompts)} prompts")
    n = len(prompts)
    fpss, rates = _per_clip(fps, n), _per_clip(sample_rate, n)
    per_clip = []
    for i, p in enumerate(prompts):
        ev, track = analyze_audio(audio[i], int(rates[i])), analyze_video(video[i])
        clip = {**_text_audio(ev, p), **_sync(ev, track, fpss[i]), **_visual(track, p)}
        if first is not None and last is not None:
            clip.update(_frames(video[i], first[i], last[i]))
        per_clip.append(clip)
    return _collect(per_clip)
