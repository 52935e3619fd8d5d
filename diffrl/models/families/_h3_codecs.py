"""The latent spaces of the MiniMax-H3 family: one video codec and one audio codec per model.

A codec maps media to the latents the transformer denoises and back. Two pairs exist:

- the release's autoencoders, ``AutoencoderKLMiniMaxH3`` (video, x16 spatial, 17n+5 -> 5n+2
  frames) and ``AutoencoderKLMiniMaxH3Audio`` (a 1-D VAE over mono channels, hop 800), with
  their latent normalisation and the video VAE's ImageNet pixel convention;
- fixed, weightless transforms for the built-in AVBench base (preset ``h3-avbench``): video
  latents ARE the pixels in [-1, 1] (the transformer's patch embedding does the patching), and
  audio latents are an orthonormal DCT-II of non-overlapping ``hop``-sample frames, scaled.
  Both are exactly invertible, so the CPU demo trains the real transformer on honest media
  without first training autoencoders; the DCT puts a beep's energy into a few coefficients
  per frame, which a small transformer learns to place.

Every codec has ``latent_shape``, ``encode`` and ``decode`` in the same units: video
(B, 3, T, H, W) pixels in [-1, 1] <-> (B, C, F, h, w) latents; audio (B, S) samples <->
(B, ch, N, Ca) latents (channel-major; ch = 1 is mono, a stereo model is fed the mono signal on
both channels and mixed down on decode).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from diffrl.errors import ConfigError

PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the video VAE's pixels


def _stat(values, n: int, default: float, like: Tensor, view: tuple[int, ...]) -> Tensor:
    return torch.tensor(values or [default] * n).view(view).to(like)


class VAEVideo:
    """The release's video autoencoder (``AutoencoderKLMiniMaxH3``)."""

    kind = "vae"

    def __init__(self, vae) -> None:
        self.vae = vae

    def latent_shape(self, frames: int, height: int, width: int, patch: tuple[int, ...]):
        vae = self.vae
        ratio = vae.spatial_compression_ratio
        for key, side, p in (("height", height, patch[1]), ("width", width, patch[2])):
            if side % (ratio * p):
                raise ConfigError(
                    f"minimax_h3: model.{key} (or model.resolution) = {side} must be a multiple "
                    f"of {ratio * p} (VAE x{ratio}, patch {p})"
                )
        if height <= vae.tile_sample_min_height and width <= vae.tile_sample_min_width:
            vae.disable_tiling()  # one tile is the whole frame (the release tiles 768 px frames)
        clip, chunk = vae.config.clip_length, vae.tokens_chunk_size
        if frames % clip != chunk % clip or frames < clip:
            first = clip * (1 + chunk // clip) + chunk % clip  # the smallest count it takes
            allowed = ", ".join(str(first + clip * i) for i in range(4))
            raise ConfigError(
                f"minimax_h3: model.frames = {frames}: this video VAE encodes {clip} n + "
                f"{chunk} frames (n >= 1: {allowed}, ...)"
            )
        n_latent = (frames - chunk) // clip * chunk + 2  # 17n+5 pixel frames -> 5n+2 latents
        c = vae.config.latent_channels
        return (c, n_latent, height // ratio, width // ratio)

    def _norm(self, like: Tensor) -> tuple[Tensor, Tensor]:
        cfg, c = self.vae.config, self.vae.config.latent_channels
        view = (1, -1, 1, 1, 1)
        mean = _stat(cfg.latents_mean, c, 0.0, like, view)
        return mean, _stat(cfg.latents_std, c, 1.0, like, view)

    @torch.no_grad()
    def encode(self, pixels: Tensor) -> Tensor:
        """ImageNet pixels, the posterior's mode (the pipeline samples keyframes under seed 42),
        normalised by the VAE's latent statistics."""
        pm = torch.tensor(PIXEL_MEAN).view(1, 3, 1, 1, 1).to(pixels)
        ps = torch.tensor(PIXEL_STD).view(1, 3, 1, 1, 1).to(pixels)
        pix = ((pixels + 1) / 2 - pm) / ps
        z = self.vae.encode(pix.to(next(self.vae.parameters())), return_dict=False)[0].mode()
        mean, std = self._norm(z)
        return (z - mean) / std

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """-> (B, 3, T', H, W) in [0, 1] on the CPU (T' may exceed the clip's frames)."""
        mean, std = self._norm(latents)
        z = (latents * std + mean).to(next(self.vae.parameters()))
        clip = self.vae.decode(z, return_dict=False)[0].float().cpu()
        pm = torch.tensor(PIXEL_MEAN).view(1, 3, 1, 1, 1)
        ps = torch.tensor(PIXEL_STD).view(1, 3, 1, 1, 1)
        return (clip * ps + pm).clamp(0, 1)


class PixelVideo:
    """Video latents are the pixels in [-1, 1]: (B, 3, T, H, W) both ways."""

    kind = "pixels"

    def latent_shape(self, frames: int, height: int, width: int, patch: tuple[int, ...]):
        for key, value, p in (("frames", frames, patch[0]), ("height", height, patch[1]),
                              ("width", width, patch[2])):  # fmt: skip
            if value % p:
                what = "" if key == "frames" else " (or model.resolution)"
                raise ConfigError(
                    f"minimax_h3: model.{key}{what} = {value} must be a multiple of the "
                    f"transformer's patch {p} (pixel latents: patches {tuple(patch)})"
                )
        return (3, frames, height, width)

    def encode(self, pixels: Tensor) -> Tensor:
        return pixels.float()

    def decode(self, latents: Tensor) -> Tensor:
        return ((latents.float().cpu() + 1) / 2).clamp(0, 1)


class VAEAudio:
    """The release's audio autoencoder (``AutoencoderKLMiniMaxH3Audio``), one mono channel per
    call, normalised by its latent statistics."""

    kind = "vae"

    def __init__(self, audio_vae) -> None:
        self.vae = audio_vae
        self.sample_rate = int(audio_vae.config.sampling_rate)

    def latent_shape(self, seconds: float, channels: int) -> tuple[int, int, int]:
        n = int(round(seconds * self.sample_rate / self.vae.hop_length))
        return (channels, n, self.vae.config.latent_channels)

    def _norm(self, like: Tensor) -> tuple[Tensor, Tensor]:
        cfg, c = self.vae.config, self.vae.config.latent_channels
        view = (1, 1, 1, -1)
        mean = _stat(cfg.latents_mean, c, 0.0, like, view)
        return mean, _stat(cfg.latents_std, c, 1.0, like, view)

    @torch.no_grad()
    def encode(self, wave: Tensor, shape: tuple[int, int, int]) -> Tensor:
        ch, n, _ = shape
        b = wave.shape[0]
        mono = wave.float().reshape(b, 1, -1)
        z = self.vae.encode(mono.to(next(self.vae.parameters())), return_dict=False)[0].mode()
        z = z.float().transpose(1, 2)[:, :n]  # (B, N, Ca)
        mean, std = self._norm(z[:, None])
        return ((z[:, None] - mean) / std).expand(b, ch, n, -1).contiguous()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        b, ch, n, ca = latents.shape
        mean, std = self._norm(latents)
        z = (latents * std + mean).reshape(b * ch, n, ca).transpose(1, 2)  # (B*ch, Ca, N)
        wave = self.vae.decode(z.to(next(self.vae.parameters())), return_dict=False)[0]
        return wave.float().cpu().reshape(b, ch, -1).mean(1)  # stereo mixed down: (B, samples)


def dct_basis(n: int) -> Tensor:
    """(n, n) orthonormal DCT-II matrix D (coefficients = D @ frame; D.T inverts)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.float()


class DCTAudio:
    """Audio latents: each ``hop``-sample frame's orthonormal DCT-II, times ``scale``
    (B, S) <-> (B, ch, S / hop, hop). Exactly invertible up to the clip's length."""

    kind = "dct"

    def __init__(self, sample_rate: int, hop: int, scale: float) -> None:
        self.sample_rate, self.hop, self.scale = int(sample_rate), int(hop), float(scale)
        self.basis = dct_basis(self.hop)

    def latent_shape(self, seconds: float, channels: int) -> tuple[int, int, int]:
        samples = seconds * self.sample_rate
        if abs(samples - round(samples)) > 1e-6 or round(samples) % self.hop:
            raise ConfigError(
                f"minimax_h3: {seconds:.4g} s of {self.sample_rate} Hz audio is not a whole "
                f"number of {self.hop}-sample DCT frames"
            )
        return (channels, round(samples) // self.hop, self.hop)

    def encode(self, wave: Tensor, shape: tuple[int, int, int]) -> Tensor:
        ch, n, hop = shape
        b = wave.shape[0]
        if wave.shape[-1] != n * hop:
            raise ValueError(f"audio of {wave.shape[-1]} samples; this codec takes {n * hop}")
        frames = wave.float().reshape(b, n, hop)
        z = frames @ self.basis.T.to(frames) * self.scale
        return z[:, None].expand(b, ch, n, hop).contiguous()

    def decode(self, latents: Tensor) -> Tensor:
        b, ch, n, hop = latents.shape
        frames = latents.float().cpu() / self.scale @ self.basis
        return frames.reshape(b, ch, n * hop).mean(1).clamp(-1, 1)
