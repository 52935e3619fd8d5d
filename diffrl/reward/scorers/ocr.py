"""Text rendering reward: does the image spell the text the prompt quotes (FlowGRPO's OCR task).

The target is the text between double quotes in the prompt (``a sign that says "diffrl"``).
The image is read with RapidOCR (PP-OCR detection + recognition on onnxruntime, weights shipped
inside the wheel, so it runs offline). Recognised pieces are joined; both sides are lowercased
and stripped of spaces, and the score is ``1 - min(lev(found, target), len(target)) /
len(target)``, 1 when the target occurs anywhere in what was read. Extra text therefore costs
nothing and a missing or misspelt letter costs ``1 / len(target)``: a dense signal for RL.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from typing import Any

import numpy as np
import torch

from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.types import Trajectory

log = logging.getLogger(__name__)

# "straight" or “curly” double quotes
_QUOTED = re.compile(r"\"([^\"]*)\"|“([^”]*)”")


def quoted_text(prompt: str) -> str:
    """The text the prompt asks to render: every double-quoted span, joined in order."""
    spans = [a or b for a, b in _QUOTED.findall(prompt)]
    target = "".join(spans)
    if not normalize(target):
        raise ValueError(
            f"OCR scorer: prompt {prompt!r} has no text in double quotes to read back; "
            'write the target text as e.g. a sign that says "hello"'
        )
    return target


def normalize(text: str) -> str:
    """Lowercase, whitespace removed: OCR splits and spaces words unreliably."""
    return "".join(text.lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute: cost 1 each), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_similarity(found: str, target: str) -> float:
    """1 - capped normalised edit distance of ``found`` to ``target`` (both normalised)."""
    found, target = normalize(found), normalize(target)
    if not target:
        raise ValueError("empty OCR target")
    if target in found:
        return 1.0
    return 1.0 - min(levenshtein(found, target), len(target)) / len(target)


@register_scorer("ocr")
class OcrScorer:
    """Reads each image with RapidOCR and compares it with the prompt's quoted text.

    Params: ``min_confidence`` (recognised pieces below it are ignored; 0 keeps all, as
    FlowGRPO does), ``use_cls`` (the 180-degree text-direction classifier: off by default,
    generated text is upright), ``ocr_kwargs`` (passed to ``RapidOCR``, e.g.
    ``{"det_limit_side_len": 512, "intra_op_num_threads": 4}``). A prompt without quoted text
    is an error; an image the engine fails on is marked invalid, never scored 0.
    """

    needs = frozenset({"image"})

    def __init__(
        self,
        min_confidence: float = 0.0,
        use_cls: bool = False,
        ocr_kwargs: dict[str, Any] | None = None,
        name: str = "ocr",
    ) -> None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise ImportError(
                "the 'ocr' scorer needs rapidocr-onnxruntime (pip install rapidocr-onnxruntime; "
                "its detection and recognition weights ship inside the wheel)"
            ) from e
        self.name = name
        self.min_confidence = float(min_confidence)
        self.engine = RapidOCR(use_cls=use_cls, **(ocr_kwargs or {}))
        self._lock = threading.Lock()  # one onnxruntime pipeline; calls are serialised

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    def read(self, image: np.ndarray) -> str:
        """All recognised text of one (H, W, 3) uint8 RGB image, pieces joined in reading
        order (RapidOCR sorts boxes top-to-bottom, left-to-right)."""
        with self._lock:
            # RapidOCR decodes arrays as OpenCV does, i.e. BGR: hand it BGR.
            result, _ = self.engine(np.ascontiguousarray(image[..., ::-1]))
        if not result:
            return ""
        return "".join(text for _, text, conf in result if float(conf) >= self.min_confidence)

    def score_sync(self, traj: Trajectory) -> ScoreResult:
        targets = {t: quoted_text(t) for t in set(traj.prompts.texts)}  # fails fast, all rows
        images = traj.extra_fields["image"].cpu().numpy()  # (B, H, W, 3) uint8
        scores = torch.full((len(images),), float("nan"))
        exact = 0
        for i, (img, prompt) in enumerate(zip(images, traj.prompts.texts, strict=True)):
            try:
                found = self.read(img)
            except Exception as e:  # one unreadable image must not sink the batch
                log.warning("OCR failed on sample %d, marked missing: %s", i, e)
                continue
            scores[i] = ocr_similarity(found, targets[prompt])
            exact += int(scores[i] == 1.0)
        valid = torch.isfinite(scores)
        return ScoreResult(scores, valid, {"exact": exact / max(len(images), 1)})
