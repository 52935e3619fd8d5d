"""JPEG (in)compressibility, DDPO's weight-free rewards (Black et al. 2023).

The JPEG size of an image is a cheap proxy for its detail: flat, simple images compress well,
busy textured ones do not. Rewarding ``-size`` drives a model towards minimalism and ``+size``
towards detail, which makes these a useful sanity task for an RL loop: no weights, exact,
deterministic, and a clear visual trend when training works.
"""

from __future__ import annotations

import asyncio
import io

import torch
from PIL import Image

from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.types import Trajectory


def jpeg_kb(image, quality: int = 95) -> float:
    """Size in kB (1000 bytes, as DDPO) of one (H, W, 3) uint8 image saved as JPEG."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


class JpegSizeScorer:
    """``sign * size_kb / scale`` per image; ``sign`` is -1 (compressibility) or +1."""

    needs = frozenset({"image"})

    def __init__(self, name: str, sign: float, quality: int = 95, scale: float = 1.0) -> None:
        if not 1 <= quality <= 100:
            raise ValueError(f"quality={quality}: must be in [1, 100]")
        if scale <= 0:
            raise ValueError(f"scale={scale}: must be > 0")
        self.name = name
        self.sign = sign
        self.quality = int(quality)
        self.scale = float(scale)

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    def score_sync(self, traj: Trajectory) -> ScoreResult:
        images = traj.extra_fields["image"].cpu().numpy()  # (B, H, W, 3) uint8
        sizes = torch.tensor([jpeg_kb(img, self.quality) for img in images], dtype=torch.float32)
        scores = self.sign * sizes / self.scale
        return ScoreResult(
            scores, torch.ones(len(scores), dtype=torch.bool), {"size_kb": float(sizes.mean())}
        )


@register_scorer("jpeg_compressibility")
def jpeg_compressibility(quality: int = 95, scale: float = 1.0) -> JpegSizeScorer:
    """``-size_kb / scale``: smaller files score higher."""
    return JpegSizeScorer("jpeg_compressibility", -1.0, quality, scale)


@register_scorer("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = 95, scale: float = 1.0) -> JpegSizeScorer:
    """``+size_kb / scale``: larger files score higher."""
    return JpegSizeScorer("jpeg_incompressibility", 1.0, quality, scale)
