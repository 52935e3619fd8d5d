"""CLIP-family image-text scorers: CLIPScore and PickScore.

Both are ``scale * cos(image_emb, text_emb)`` from a transformers ``CLIPModel``; PickScore is a
CLIP-H fine-tune on human preferences whose reward uses the checkpoint's learnt
``logit_scale.exp()`` as the scale. Weights load only from a local directory: diffrl never
downloads at run time, so a cluster without internet behaves like a laptop and a missing
checkpoint is an error at start-up rather than a hang or a silent fetch mid-run.

transformers is imported lazily, so ``diffrl.reward.scorers`` imports (and the registry lists
these names) on an install without it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.types import Trajectory

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def require_local_dir(path: str | Path | None, scorer: str, what: str = "checkpoint") -> Path:
    """The checked local directory ``path``; a clear error otherwise.

    The message says that nothing is downloaded, because the usual mistake is passing a hub id
    such as ``openai/clip-vit-large-patch14`` and expecting it to be fetched.
    """
    if path is None or str(path) == "":
        raise ValueError(
            f"scorer {scorer!r} needs params.path: a local directory holding the {what} "
            "(diffrl never downloads weights; save it with save_pretrained or copy it there)"
        )
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"scorer {scorer!r}: params.path, the {what} directory {str(p)!r}, does not exist "
            "or is not a directory (diffrl never downloads weights: it loads only from a local "
            "path, so a hub id is not accepted; download it beforehand and pass the directory)"
        )
    return p


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def pooled(out: Any) -> Tensor:
    """The projected embedding from a ``get_*_features`` call.

    transformers < 5 returns the tensor itself; 5.x returns a ModelOutput whose
    ``pooler_output`` holds the projection. Accepting both keeps the scorers working across the
    versions users have pinned.
    """
    if isinstance(out, Tensor):
        return out
    emb = getattr(out, "pooler_output", None)
    if not isinstance(emb, Tensor):
        raise TypeError(f"cannot find an embedding in {type(out).__name__}")
    return emb


def unique_index(texts: tuple[str, ...] | list[str]) -> tuple[list[str], Tensor]:
    """Distinct texts and, per row, the index of its text: a group of G samples shares one
    prompt, so the text tower runs once per prompt rather than once per sample."""
    order: dict[str, int] = {}
    idx = [order.setdefault(t, len(order)) for t in texts]
    return list(order), torch.tensor(idx, dtype=torch.long)


@register_scorer("clip_score")
class ClipScorer:
    """``scale * cos(image, prompt)`` with a local transformers CLIP checkpoint.

    Params: ``path`` (required, a ``save_pretrained`` directory with the model and its
    processor), ``processor_path`` (defaults to ``path``; PickScore ships its processor with
    the base CLIP-H), ``scale`` (a number, or None for the checkpoint's ``logit_scale.exp()``),
    ``device``, ``dtype``, ``batch_size`` (images per forward pass, bounds memory).
    """

    needs = frozenset({"image"})

    def __init__(
        self,
        path: str | None = None,
        scale: float | None = 1.0,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        processor_path: str | None = None,
        name: str = "clip_score",
    ) -> None:
        from transformers import CLIPModel, CLIPProcessor

        self.name = name
        model_dir = require_local_dir(path, name)
        proc_dir = require_local_dir(processor_path or model_dir, name, "processor")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        torch_dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model = CLIPModel.from_pretrained(model_dir, local_files_only=True)
        self.model.to(self.device, torch_dtype).eval().requires_grad_(False)
        self.processor = CLIPProcessor.from_pretrained(proc_dir, local_files_only=True)
        self.max_text_len = int(self.model.config.text_config.max_position_embeddings)
        self.scale = float(self.model.logit_scale.exp()) if scale is None else float(scale)

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    @torch.no_grad()
    def score_sync(self, traj: Trajectory) -> ScoreResult:
        images = traj.extra_fields["image"]  # (B, H, W, 3) uint8
        texts, idx = unique_index(traj.prompts.texts)
        text_emb = F.normalize(self.embed_texts(texts).float(), dim=-1)[idx]
        image_emb = torch.cat(
            [
                self.embed_images(images[i : i + self.batch_size])
                for i in range(0, len(images), self.batch_size)
            ]
        )
        image_emb = F.normalize(image_emb.float(), dim=-1)
        scores = (self.scale * (image_emb * text_emb).sum(-1)).cpu()
        return ScoreResult(scores, torch.isfinite(scores))

    def embed_texts(self, texts: list[str]) -> Tensor:
        tok = self.processor.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_text_len,
            return_tensors="pt",
        )
        return pooled(self.model.get_text_features(**tok.to(self.device)))

    def embed_images(self, images: Tensor) -> Tensor:
        pixels = self.processor.image_processor(
            images=list(images.cpu().numpy()), return_tensors="pt"
        )["pixel_values"]
        pixels = pixels.to(self.device, self.model.dtype)
        return pooled(self.model.get_image_features(pixel_values=pixels))


@register_scorer("pickscore")
def pickscore(path: str | None = None, scale: float | None = None, **kwargs: Any) -> ClipScorer:
    """PickScore (Kirstain et al. 2023): the same math as CLIPScore, scaled by default by the
    checkpoint's learnt temperature ``logit_scale.exp()`` as in its reference scoring code."""
    return ClipScorer(path, scale=scale, name="pickscore", **kwargs)
