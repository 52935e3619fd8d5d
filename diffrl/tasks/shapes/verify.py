"""ShapesBench's verifier: segment a generated image by colour, name each blob's shape, and
check the prompt's colours, counts, shapes and positions exactly. It is the ``shapes`` scorer's
program and the held-out eval's; ``render.py`` draws only images it passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from diffrl.tasks.shapes.prompts import (
    CATEGORIES,
    COLORS,
    IMAGE_SIZE,
    ShapesPrompt,
    in_region,
)

# Verifier thresholds. The palette's closest pair (red/yellow) is ~176 apart, so a radius of
# 110 around each colour tolerates heavy noise while blurred edge pixels that have faded
# towards black fall outside every colour and count as background.
_COLOR_RADIUS = 110.0
_MIN_BRIGHTNESS = 100  # max channel; keeps dark smudges from being read as objects
_MIN_AREA_32 = 10  # components smaller than this (at 32x32) are noise
_SQUARE_MIN_FILL = 0.88
_TRIANGLE_MAX_FILL = 0.62
_MAX_ASPECT = 1.6  # bbox long/short side; beyond this a blob matches no shape
_TRIANGLE_MIN_DROP = 0.04  # centroid below bbox centre, as a fraction of bbox height


@dataclass(frozen=True)
class Detection:
    """One object the verifier found: kept so failures can be inspected, not just counted."""

    color: str
    shape: str  # one of SHAPES, or "unknown" for elongated blobs
    cx: float
    cy: float
    area: int


@dataclass(frozen=True)
class Verdict:
    """Verifier output: the overall pass/fail plus which constraint failed and why."""

    overall: bool
    constraints: dict[str, bool]  # keys: "color", "count", "shape", "position"
    detected: tuple[Detection, ...]
    # per constraint, the share of its checks that pass (one per wanted colour, per requested
    # object group plus "no other colours", per detection); 1.0 exactly when the constraint
    # holds, so a reward can credit two of three circles without changing the verdict
    fractions: dict[str, float]


# --------------------------------------------------------------------------- verifier

_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)


def _check_image(image: np.ndarray, ndim: int) -> None:
    if not isinstance(image, np.ndarray):
        raise TypeError(f"image must be a numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise TypeError(f"image must be uint8, got dtype {image.dtype} (shape {image.shape})")
    if image.ndim != ndim or image.shape[-1] != 3:
        want = "(H, W, 3)" if ndim == 3 else "(B, H, W, 3)"
        raise ValueError(f"image must have shape {want}, got {image.shape}")


def blob_shape(rows: np.ndarray, cols: np.ndarray) -> str:
    """Name a blob from its bbox fill ratio, aspect and how bottom-heavy its mass is.

    Fill alone (square 1.0, disc ~0.79, triangle ~0.5) works on crisp renders, but blur eats a
    triangle's thin apex first, leaving a trapezoid whose fill looks like a disc's. Its mass
    still sits low in the box (centroid ~1/6 of the height below centre, vs ~0 for discs and
    squares), so ``drop`` keeps such blobs triangles.
    """
    top, h = rows.min(), int(rows.max() - rows.min() + 1)
    w = int(cols.max() - cols.min() + 1)
    fill, aspect = rows.size / (h * w), max(h, w) / min(h, w)
    drop = (rows.mean() - top + 0.5) / h - 0.5
    if aspect > _MAX_ASPECT:
        return "unknown"
    if fill > _SQUARE_MIN_FILL:
        return "square"
    if fill < _TRIANGLE_MAX_FILL or drop > _TRIANGLE_MIN_DROP:
        return "triangle"
    return "circle"


def detect(image: np.ndarray) -> tuple[Detection, ...]:
    """Segment an image into coloured objects; the building block of ``verify``."""
    _check_image(image, ndim=3)
    dist = np.linalg.norm(image[:, :, None, :].astype(np.float32) - _PALETTE, axis=-1)
    nearest = dist.argmin(axis=-1)
    valid = (dist.min(axis=-1) < _COLOR_RADIUS) & (image.max(axis=-1) >= _MIN_BRIGHTNESS)
    min_area = max(4, round(_MIN_AREA_32 * image.shape[0] * image.shape[1] / IMAGE_SIZE**2))
    found: list[Detection] = []
    for index, color in enumerate(COLORS):
        labels, _ = ndimage.label(valid & (nearest == index), structure=np.ones((3, 3)))
        for label, box in enumerate(ndimage.find_objects(labels), start=1):
            rows, cols = np.nonzero(labels[box] == label)
            if rows.size < min_area:
                continue
            cx = float(cols.mean() + box[1].start + 0.5)
            cy = float(rows.mean() + box[0].start + 0.5)
            found.append(Detection(color, blob_shape(rows, cols), cx, cy, int(rows.size)))
    return tuple(found)


def verify(image: np.ndarray, prompt: ShapesPrompt) -> Verdict:
    """Grade one image against its prompt, constraint by constraint (the RL reward)."""
    detected = detect(image)
    height, width = image.shape[:2]
    by_color: dict[str, list[Detection]] = {}
    for d in detected:
        by_color.setdefault(d.color, []).append(d)
    wanted = {obj.color for obj in prompt.objects}
    checks = {  # each constraint is the conjunction of its checks
        "color": [bool(by_color.get(c)) for c in wanted],
        "count": [len(by_color.get(o.color, [])) == o.count for o in prompt.objects]
        + [set(by_color) <= wanted],
        "shape": [d.shape == o.shape for o in prompt.objects for d in by_color.get(o.color, [])],
        "position": [
            in_region(o.position, d.cx, d.cy, height, width)
            for o in prompt.objects
            if o.position is not None
            for d in by_color.get(o.color, [])
        ],
    }
    constraints = {name: all(passed) for name, passed in checks.items()}
    fractions = {  # no checks (no detections of that colour) holds vacuously, as `all` does
        name: sum(passed) / len(passed) if passed else 1.0 for name, passed in checks.items()
    }
    return Verdict(all(constraints.values()), constraints, detected, fractions)


def score_batch(images: np.ndarray, prompts: list[ShapesPrompt]) -> list[Verdict]:
    """Verify a (B, H, W, 3) uint8 batch, one prompt per image."""
    _check_image(images, ndim=4)
    if len(images) != len(prompts):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
    return [verify(img, p) for img, p in zip(images, prompts, strict=True)]


def category_accuracy(verdicts: list[Verdict], prompts: list[ShapesPrompt]) -> dict[str, float]:
    """Fraction fully correct per category present (in CATEGORIES order) plus "overall"."""
    if len(verdicts) != len(prompts):
        raise ValueError(f"got {len(verdicts)} verdicts but {len(prompts)} prompts")
    if not verdicts:
        raise ValueError("category_accuracy needs at least one verdict")
    hits: dict[str, list[bool]] = {}
    for v, p in zip(verdicts, prompts, strict=True):
        hits.setdefault(p.category, []).append(v.overall)
    result = {c: sum(hits[c]) / len(hits[c]) for c in CATEGORIES if c in hits}
    result["overall"] = sum(v.overall for v in verdicts) / len(verdicts)
    return result
