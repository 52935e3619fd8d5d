"""ImageBind's input preparation, in torch: what its release does to a sound file and a video
file before the network, applied to the rollout's tensors.

Audio (per clip): resample to 16 kHz; three 2 s windows spread evenly over the clip (the first
at 0, the last ending at the end; all three the whole clip when it is shorter); each window has
its mean removed, becomes a Kaldi-style log-mel filterbank (25 ms Hann frames every 10 ms, 128
mel bins, pre-emphasis 0.97, power spectrum, 512-point FFT), is padded or cut to 204 frames and
normalised with the training set's mean -4.268 and std 9.138. torchaudio is not a dependency
(the env has none), so the filterbank is written here from Kaldi's definition, and resampling
uses torchaudio when it is installed, else a windowed-sinc resampler written here with the same
filter as torchaudio's default (in torch, so it stays on the audio's device).

Video (per clip): five 2 s windows spread the same way over the clip's duration (frames / fps);
from each, the first and last frame (two uniformly spaced samples, the pair the temporal patch
embeds); scaled so the short side is 224 (bilinear), normalised with CLIP's mean/std, and cut
into three 224 px crops along the long side (start, centre, end). The network embeds every
(window, crop) and the embedder averages them, as the release does.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor

SAMPLE_RATE = 16_000
CLIP_SECONDS = 2.0
AUDIO_CLIPS = 3
VIDEO_CLIPS = 5
MEL_MEAN, MEL_STD = -4.268, 9.138
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
WIN_MS, HOP_MS = 25, 10
PREEMPHASIS = 0.97
LOW_HZ = 20.0


def clip_starts(duration: float, clip: float, count: int) -> list[Fraction]:
    """Start times of ``count`` windows of ``clip`` seconds spread evenly over ``duration``
    (exact fractions, so sample and frame indices do not drift with float rounding)."""
    span = max(Fraction(duration) - Fraction(clip), Fraction(0))
    step = span / max(count - 1, 1)
    return [step * i for i in range(count)]


def sinc_resample(
    audio: Tensor, rate: int, target: int, zeros: int = 6, rolloff: float = 0.99
) -> Tensor:
    """(B, S) at ``rate`` -> (B, ceil(S * target / rate)) at ``target``: band-limited
    interpolation with a Hann-windowed sinc (``zeros`` zero crossings each side, cut-off at
    ``rolloff`` of the lower Nyquist), as one strided convolution. The same filter as
    torchaudio's default resampler, in plain torch, so it runs where the audio is."""
    g = math.gcd(int(rate), int(target))
    up, down = int(target) // g, int(rate) // g  # `up` outputs for every `down` inputs
    cutoff = min(up, down) * rolloff
    width = math.ceil(zeros * down / cutoff)  # input samples each side of an output
    taps = torch.arange(-width, width + down, dtype=torch.float64, device=audio.device) / down
    phase = -torch.arange(up, dtype=torch.float64, device=audio.device)[:, None] / up
    t = ((phase + taps) * cutoff).clamp(-zeros, zeros)  # (up, taps) in units of the cut-off
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t * math.pi) / (t * math.pi))
    kernels = (sinc * window * cutoff / down).to(audio.dtype)[:, None]  # (up, 1, taps)
    x = F.pad(audio[:, None], (width, width + down))  # (B, 1, S + pad)
    y = F.conv1d(x, kernels, stride=down)  # (B, up, S / down + 1): one row per output phase
    out = y.transpose(1, 2).flatten(1)
    return out[:, : math.ceil(up * audio.shape[-1] / down)]


def resample(audio: Tensor, rate: int, target: int = SAMPLE_RATE) -> Tensor:
    """(B, S) at ``rate`` -> (B, S') at ``target``: torchaudio's resampler where it is
    installed (what the release uses), else the same filter written here."""
    if rate == target:
        return audio
    try:
        import torchaudio.functional as AF
    except ImportError:
        return sinc_resample(audio, rate, target)
    return AF.resample(audio, rate, target)


def _mel(hz: Tensor) -> Tensor:
    return 1127.0 * torch.log1p(hz / 700.0)


def mel_banks(bins: int, n_fft: int, rate: int, device: torch.device) -> Tensor:
    """(bins, n_fft // 2 + 1) triangular filters, equally spaced on Kaldi's mel scale between
    20 Hz and Nyquist, triangular in mel (not Hz); the Nyquist column is zero, as Kaldi's."""
    mel_lo, mel_hi = math.log1p(LOW_HZ / 700.0) * 1127.0, math.log1p(rate / 2 / 700.0) * 1127.0
    delta = (mel_hi - mel_lo) / (bins + 1)
    left = mel_lo + delta * torch.arange(bins, dtype=torch.float64, device=device)[:, None]
    centre, right = left + delta, left + 2 * delta
    mel = _mel(rate / n_fft * torch.arange(n_fft // 2, dtype=torch.float64, device=device))
    up, down = (mel - left) / (centre - left), (right - mel) / (right - centre)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return F.pad(banks, (0, 1)).float()


def fbank(wave: Tensor, rate: int = SAMPLE_RATE, bins: int = 128) -> Tensor:
    """Kaldi-style log-mel filterbank of (B, S) -> (B, frames, bins), frames = 1 + (S - win)
    // hop (only whole frames, Kaldi's snip_edges)."""
    win, hop = rate * WIN_MS // 1000, rate * HOP_MS // 1000
    if wave.shape[-1] < win:
        raise ValueError(
            f"{wave.shape[-1]} samples: a filterbank needs at least {win} ({WIN_MS} ms)"
        )
    n_fft = 1 << (win - 1).bit_length()  # next power of two: 512 for 400
    frames = wave.float().unfold(-1, win, hop)  # (B, F, win)
    frames = frames - frames.mean(dim=-1, keepdim=True)  # per-frame DC offset
    prev = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)  # x[-1] := x[0]
    frames = frames - PREEMPHASIS * prev
    frames = frames * torch.hann_window(win, periodic=False, device=wave.device)
    power = torch.fft.rfft(frames, n=n_fft).abs().pow(2)  # (B, F, n_fft/2 + 1)
    mel = power @ mel_banks(bins, n_fft, rate, wave.device).T
    return mel.clamp(min=torch.finfo(torch.float32).eps).log()


def mel_clips(
    audio: Tensor,
    rate: int,
    bins: int = 128,
    frames: int = 204,
    clips: int = AUDIO_CLIPS,
) -> Tensor:
    """(B, S) audio at ``rate`` -> (B, clips, 1, bins, frames) normalised log-mel windows."""
    wave = resample(audio.float(), rate)
    length = wave.shape[-1]
    n = int(CLIP_SECONDS * SAMPLE_RATE)
    out = []
    for start in clip_starts(length / SAMPLE_RATE, CLIP_SECONDS, clips):
        a = int(start * SAMPLE_RATE)
        seg = wave[:, a : min(a + n, length)]
        seg = seg - seg.mean(dim=-1, keepdim=True)
        spec = fbank(seg, SAMPLE_RATE, bins).transpose(1, 2)  # (B, bins, F)
        spec = F.pad(spec, (0, max(frames - spec.shape[-1], 0)))[..., :frames]
        out.append((spec - MEL_MEAN) / MEL_STD)
    return torch.stack(out, dim=1).unsqueeze(2)


def frame_pairs(
    video: Tensor,
    fps: float,
    size: int = 224,
    pair: int = 2,
    clips: int = VIDEO_CLIPS,
    crops: int = 3,
) -> Tensor:
    """(B, T, H, W, 3) uint8 -> (B, clips * crops, 3, pair, size, size) CLIP-normalised.

    A window [start, start + 2 s) holds the frames whose time index / fps falls in it; ``pair``
    of them are taken evenly spaced (first and last for a pair). ``crops`` is 3 (start, centre,
    end of the long side, as the release) or 1 (centre)."""
    if crops not in (1, 3):
        raise ValueError(f"crops={crops}: 1 (centre) or 3 (start, centre, end)")
    b, t = video.shape[:2]
    if t < 1 or fps <= 0:
        raise ValueError(f"a video of {t} frames at {fps} fps cannot be sampled")
    picks = []
    for start in clip_starts(t / fps, CLIP_SECONDS, clips):
        first = min(math.ceil(start * Fraction(fps)), t - 1)
        last = max(
            min(math.ceil((start + Fraction(CLIP_SECONDS)) * Fraction(fps)) - 1, t - 1), first
        )
        picks += torch.linspace(first, last, pair).long().tolist()  # truncation, as the release
    x = video[:, picks].permute(0, 1, 4, 2, 3).float() / 255.0  # (B, clips*pair, 3, H, W)
    h, w = x.shape[-2:]
    short = min(h, w)  # the short side becomes `size`, the long one keeps the aspect (floored)
    new = tuple(size if d == short else math.floor(d / short * size) for d in (h, w))
    x = F.interpolate(x.flatten(0, 1), size=new, mode="bilinear", align_corners=False)
    mean = torch.tensor(CLIP_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=x.device).view(1, 3, 1, 1)
    x = ((x - mean) / std).unflatten(0, (b, clips, pair))  # (B, clips, pair, 3, h, w)
    h, w = new
    long = max(h, w)
    offsets = (
        [math.ceil((long - size) / 2)]
        if crops == 1
        else [0, math.ceil((long - size) / 2), long - size]
    )
    out = []
    for o in offsets:
        y0, x0 = (o, math.ceil((h - size) / 2)) if h > w else (math.ceil((h - size) / 2), o)
        out.append(x[..., y0 : y0 + size, x0 : x0 + size])
    # (B, clips, crops, pair, 3, s, s) -> (B, clips * crops, 3, pair, s, s)
    return torch.stack(out, dim=2).flatten(1, 2).transpose(2, 3).contiguous()
