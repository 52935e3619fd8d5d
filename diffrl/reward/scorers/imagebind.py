"""Audio-video agreement in a joint embedding space (ImageBind), for omni generators.

The scorer only needs two towers that map into one space, so it is written against a small
protocol (``AVEmbedder``) instead of one model's code. Two embedders ship:

- ``ImageBindEmbedder`` (``embedder: imagebind``): Meta's ``imagebind_huge`` written in diffrl
  (``imagebind_net.py``), loading the released state dict from a local path (``weights``), with
  the release's input preparation (``imagebind_prep.py``: 16 kHz log-mel windows; frame pairs
  at 224 px, CLIP-normalised). ``size: tiny`` is a narrow copy for CPU tests.
- ``TorchScriptAVEmbedder`` (``embedder: torchscript``, ``path``): a ``torch.jit.save``-d module
  carrying its own preprocessing and architecture.

Registered as ``imagebind`` (default embedder: imagebind) and ``imagebind_av`` (default:
torchscript, the older name); both are the same scorer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from diffrl.errors import check_choice
from diffrl.reward.scorer import ScoreResult, audio_rate, register_scorer
from diffrl.reward.scorers.clap import mono
from diffrl.reward.scorers.clip import resolve_dtype
from diffrl.reward.scorers.imagebind_net import ImageBindConfig, ImageBindNet, load_weights
from diffrl.reward.scorers.imagebind_prep import AUDIO_CLIPS, VIDEO_CLIPS, frame_pairs, mel_clips
from diffrl.types import Trajectory

SIZES = {"huge": ImageBindConfig.huge, "tiny": ImageBindConfig.tiny}
EMBEDDERS = ("imagebind", "torchscript")


@runtime_checkable
class AVEmbedder(Protocol):
    """Two towers into one embedding space.

    ``embed_audio(audio, sample_rate)``: audio (B, S) float32 in [-1, 1] at ``sample_rate`` Hz
    -> (B, D). ``embed_video(frames)``: frames (B, T, H, W, 3) uint8 -> (B, D). Resampling,
    frame sampling and normalisation are the embedder's business: they belong with the weights.
    An embedder that samples frames in time sets ``takes_fps = True`` and is called
    ``embed_video(frames, fps=...)`` with the clip's frame rate.
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


class ImageBindEmbedder:
    """``AVEmbedder`` over diffrl's ImageBind network with the weights of a local
    ``imagebind_huge.pth`` (Meta's state dict; ``size: tiny`` for the test-sized network).

    Only the vision and audio towers are built; the file's other modalities are skipped by name
    (``imagebind_net.fit_state_dict``), every vision/audio entry must be there with its shape.
    Audio: ``audio_clips`` 2 s log-mel windows at 16 kHz; video: ``video_clips`` 2 s windows x
    ``crops`` 224 px crops of frame pairs; each side is the mean of its windows' embeddings.
    """

    takes_fps = True

    def __init__(
        self,
        net: ImageBindNet,
        audio_clips: int = AUDIO_CLIPS,
        video_clips: int = VIDEO_CLIPS,
        crops: int = 3,
    ) -> None:
        check_choice("params.crops", crops, (1, 3))
        if audio_clips < 1 or video_clips < 1:
            raise ValueError(f"audio_clips={audio_clips}, video_clips={video_clips}: both >= 1")
        self.cfg = net.cfg
        self.net = net.eval().requires_grad_(False)
        weight = next(net.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.audio_clips, self.video_clips, self.crops = audio_clips, video_clips, crops

    @classmethod
    def load(
        cls,
        weights: str | Path,
        size: str = "huge",
        device: str = "cpu",
        dtype: str = "float32",
        **sampling,
    ) -> ImageBindEmbedder:
        """The vision and audio towers of ``size`` with the weights of a local file."""
        check_choice("params.size", size, SIZES)
        with torch.device("meta"):  # the file's tensors are taken as they are: no double copy
            net = ImageBindNet(SIZES[size](modalities=("vision", "audio")))
        load_weights(net, weights)
        return cls(net.to(torch.device(device), resolve_dtype(dtype)), **sampling)

    def embed_audio(self, audio: Tensor, sample_rate: int) -> Tensor:
        cfg = self.cfg
        mels = mel_clips(
            mono(audio).to(self.device), sample_rate, cfg.mel_bins, cfg.mel_frames, self.audio_clips
        )  # (B, clips, 1, mel, frames)
        emb = self.net.embed("audio", mels.flatten(0, 1).to(self.dtype))
        return emb.float().unflatten(0, mels.shape[:2]).mean(dim=1)

    def embed_video(self, frames: Tensor, fps: float = 0.0) -> Tensor:
        if fps <= 0:
            raise ValueError(
                "ImageBind samples 2 s windows of the video, so it needs the frame rate: the "
                "trajectory's 'fps' field or the scorer's fps param"
            )
        cfg = self.cfg
        clips = frame_pairs(
            frames.to(self.device), fps, cfg.image_size, cfg.frames, self.video_clips, self.crops
        )  # (B, clips * crops, 3, 2, 224, 224)
        emb = self.net.embed("vision", clips.flatten(0, 1).to(self.dtype))
        return emb.float().unflatten(0, clips.shape[:2]).mean(dim=1)


def video_fps(traj: Trajectory, configured: float) -> float:
    """The frame rate of ``traj``'s video: its ``extra_fields["fps"]`` (one per batch), which
    a configured rate may only repeat; ``configured`` (0 = none) where it has none."""
    if "fps" not in traj.extra_fields:
        return configured
    rates = {float(r) for r in traj.extra_fields["fps"].reshape(-1).tolist()}
    if len(rates) != 1:
        raise ValueError(f"one frame rate per batch expected, got {sorted(rates)}")
    rate = rates.pop()
    if configured and configured != rate:
        raise ValueError(
            f"the scorer's fps param is {configured} but the trajectory's video is at {rate} "
            "fps; drop the param (the trajectory's rate is used) or fix it"
        )
    return rate


class ImageBindAVScorer:
    """``scale * cos(embed_audio(audio), embed_video(video))``: does the sound fit the picture.

    Params: ``embedder`` (``imagebind``: diffrl's ImageBind with ``weights``, a local
    ``imagebind_huge.pth``, and ``size`` huge|tiny, ``dtype``, ``audio_clips``,
    ``video_clips``, ``crops``; ``torchscript``: ``path``, a TorchScript file, see
    ``TorchScriptAVEmbedder``; or any ``AVEmbedder`` object, from Python), ``sample_rate`` (0 =
    the trajectory's ``extra_fields["sample_rate"]``; else it must match), ``fps`` (likewise
    with ``extra_fields["fps"]``), ``device``, ``scale``, ``batch_size``. Rows whose audio holds
    a non-finite sample, or whose embedding is not finite, are marked invalid, never scored 0.
    """

    needs = frozenset({"audio", "video"})
    modality = "joint"  # the sound against the picture: both modalities share it

    def __init__(
        self,
        path: str | None = None,
        sample_rate: int = 0,  # 0 = the trajectory's extra_fields['sample_rate']
        device: str = "cpu",
        scale: float = 1.0,
        batch_size: int = 8,
        embedder: str | AVEmbedder | None = None,
        weights: str | None = None,
        size: str = "huge",
        dtype: str = "float32",
        fps: float = 0.0,  # 0 = the trajectory's extra_fields['fps']
        audio_clips: int = AUDIO_CLIPS,
        video_clips: int = VIDEO_CLIPS,
        crops: int = 3,
        name: str = "imagebind_av",
    ) -> None:
        self.name = name
        if sample_rate < 0 or batch_size < 1 or fps < 0:
            raise ValueError(
                f"sample_rate={sample_rate} (>= 0), batch_size={batch_size} (>= 1), fps={fps} "
                "(>= 0): out of range"
            )
        if embedder is None:  # the older form: a TorchScript path, or nothing
            embedder = "torchscript" if path is not None or weights is None else "imagebind"
        if isinstance(embedder, str):
            check_choice("params.embedder", embedder, EMBEDDERS)
            source = path if embedder == "torchscript" else weights
            other = weights if embedder == "torchscript" else path
            if source is None or other is not None:
                key = "path" if embedder == "torchscript" else "weights"
                raise ValueError(
                    f"scorer {name!r} with embedder {embedder!r} needs exactly one of "
                    f"params.path/params.weights: params.{key} (a local file; diffrl never "
                    "downloads weights)"
                )
            if embedder == "torchscript":
                self.embedder: AVEmbedder = TorchScriptAVEmbedder(source, device)
            else:
                self.embedder = ImageBindEmbedder.load(
                    source,
                    size,
                    device,
                    dtype,
                    audio_clips=audio_clips,
                    video_clips=video_clips,
                    crops=crops,
                )
        elif path is not None or weights is not None:
            raise ValueError(
                f"scorer {name!r} needs exactly one of params.path (a local TorchScript file; "
                "diffrl never downloads weights), params.weights or an embedder object"
            )
        else:
            self.embedder = embedder
        self.sample_rate = int(sample_rate)
        self.fps = float(fps)
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
        timed = getattr(self.embedder, "takes_fps", False)
        fps = video_fps(traj, self.fps) if timed else 0.0
        for i in range(0, len(audio), self.batch_size):
            a = self.embedder.embed_audio(audio[i : i + self.batch_size], rate)
            rows = video[i : i + self.batch_size]
            # an embedder that samples in time is told the frame rate (see AVEmbedder)
            v = (
                self.embedder.embed_video(rows, fps=fps)
                if timed
                else self.embedder.embed_video(rows)
            )
            if a.shape != v.shape or a.ndim != 2:
                raise ValueError(
                    f"embedder returned audio {tuple(a.shape)} and video {tuple(v.shape)}; "
                    "both must be (B, D) with the same D"
                )
            parts.append((F.normalize(a.float(), dim=-1) * F.normalize(v.float(), dim=-1)).sum(-1))
        scores = (self.scale * torch.cat(parts)).cpu()
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
        return ScoreResult(scores, torch.isfinite(scores))


register_scorer("imagebind_av")(ImageBindAVScorer)


@register_scorer("imagebind")
def imagebind_scorer(**params) -> ImageBindAVScorer:
    """``imagebind``: the same scorer, its embedder diffrl's ImageBind unless set."""
    params.setdefault("embedder", "imagebind")
    params.setdefault("name", "imagebind")
    return ImageBindAVScorer(**params)
