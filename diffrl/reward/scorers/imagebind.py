"""Audio-video agreement in a joint embedding space (ImageBind-style), for omni generators.

The scorer only needs two towers that map into one space, so it is written against a small
protocol (``AVEmbedder``) instead of one model's code: any checkpoint that can embed a batch of
audio clips and a batch of videos can be plugged in, and the reward is their cosine. The one
concrete embedder loads a TorchScript module from a local file, because a scripted module
carries its own preprocessing and architecture: diffrl needs neither the model's source nor a
download at run time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from diffrl.reward.scorer import ScoreResult, audio_rate, register_scorer
from diffrl.types import Trajectory


@runtime_checkable
class AVEmbedder(Protocol):
    """Two towers into one embedding space.

    ``embed_audio(audio, sample_rate)``: audio (B, S) float32 in [-1, 1] at ``sample_rate`` Hz
    -> (B, D). ``embed_video(frames)``: frames (B, T, H, W, 3) uint8 -> (B, D). Resampling,
    frame sampling and normalisation are the embedder's business: they belong with the weights.
    """

    def embed_audio(self, audio: Tensor, sample_rate: int) -> Tensor: ...

    def embed_video(self, frames: Tensor) -> Tensor: ...


class TorchScriptAVEmbedder:
    """An ``AVEmbedder`` from a ``torch.jit.save``-d module exporting ``embed_audio`` and
    ``embed_video`` (``@torch.jit.export``) with the signatures of the protocol."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(
                f"TorchScript AV embedder {str(p)!r} does not exist or is not a file (diffrl "
                "never downloads weights: pass the path of a torch.jit.save-d module)"
            )
        self.device = torch.device(device)
        self.module = torch.jit.load(str(p), map_location=self.device).eval()
        missing = [m for m in ("embed_audio", "embed_video") if not hasattr(self.module, m)]
        if missing:
            raise ValueError(
                f"TorchScript module {str(p)!r} lacks {missing}; export them with "
                "@torch.jit.export (embed_audio(audio, sample_rate) and embed_video(frames))"
            )

    def embed_audio(self, audio: Tensor, sample_rate: int) -> Tensor:
        return self.module.embed_audio(audio.to(self.device), int(sample_rate))

    def embed_video(self, frames: Tensor) -> Tensor:
        return self.module.embed_video(frames.to(self.device))


@register_scorer("imagebind_av")
class ImageBindAVScorer:
    """``scale * cos(embed_audio(audio), embed_video(video))``: does the sound fit the picture.

    Params: ``path`` (a TorchScript file, see ``TorchScriptAVEmbedder``) or ``embedder`` (any
    ``AVEmbedder``, for use from Python), ``sample_rate`` (0 = the
    trajectory's ``extra_fields["sample_rate"]``; else it must match),
    ``device``, ``scale``, ``batch_size``. Rows whose audio holds a non-finite sample, or whose
    embedding is not finite, are marked invalid, never scored 0.
    """

    needs = frozenset({"audio", "video"})

    def __init__(
        self,
        path: str | None = None,
        sample_rate: int = 0,  # 0 = the trajectory's extra_fields['sample_rate']
        device: str = "cpu",
        scale: float = 1.0,
        batch_size: int = 8,
        embedder: AVEmbedder | None = None,
        name: str = "imagebind_av",
    ) -> None:
        self.name = name
        if (path is None) == (embedder is None):
            raise ValueError(
                f"scorer {name!r} needs exactly one of params.path (a local TorchScript "
                "file; diffrl never downloads weights) or embedder"
            )
        if sample_rate < 0 or batch_size < 1:
            raise ValueError(
                f"sample_rate={sample_rate} (>= 0), batch_size={batch_size} (>= 1): out of range"
            )
        self.embedder: AVEmbedder = embedder or TorchScriptAVEmbedder(path, device)  # type: ignore[arg-type]
        self.sample_rate = int(sample_rate)
        self.scale = float(scale)
        self.batch_size = batch_size

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    @torch.no_grad()
    def score_sync(self, traj: Trajectory) -> ScoreResult:
        audio = traj.extra_fields["audio"].float()  # (B, S)
        video = traj.extra_fields["video"]  # (B, T, H, W, 3) uint8
        if audio.shape[0] != video.shape[0]:
            raise ValueError(f"audio has {audio.shape[0]} rows but video {video.shape[0]}")
        finite = torch.isfinite(audio.flatten(1)).all(dim=1)
        audio = torch.where(finite.view(-1, *[1] * (audio.ndim - 1)), audio, 0.0)
        parts, rate = [], audio_rate(traj, self.sample_rate)
        for i in range(0, len(audio), self.batch_size):
            a = self.embedder.embed_audio(audio[i : i + self.batch_size], rate)
            v = self.embedder.embed_video(video[i : i + self.batch_size])
            if a.shape != v.shape or a.ndim != 2:
                raise ValueError(
                    f"embedder returned audio {tuple(a.shape)} and video {tuple(v.shape)}; "
                    "both must be (B, D) with the same D"
                )
            parts.append((F.normalize(a.float(), dim=-1) * F.normalize(v.float(), dim=-1)).sum(-1))
        scores = (self.scale * torch.cat(parts)).cpu()
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
        return ScoreResult(scores, torch.isfinite(scores))
