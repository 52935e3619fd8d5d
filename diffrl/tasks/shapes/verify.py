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
# Shape tests. Each shape has a positive test; a blob that passes none is "unknown" and fails
# every shape check. Calibrated on ground-truth renders at 24-96 px, crisp, with N(0, 15) noise
# and with a sigma = 0.7 px (at 32) blur (`tests/tasks/shapes/test_blob_shape.py` prints the
# observed ranges); each bound leaves a margin past the worst render and stops short of the
# crafted failures there (plus signs, rings, stars, L shapes, ragged blobs, two discs).
_MAX_HOLES = 0.05  # hole pixels / blob pixels; renders have none, a ring has >= 0.25
_SQUARE_MIN_FILL = 0.88  # bbox fill: renders >= 0.92 (blurred corners), discs <= 0.88
_ROUND_MAX_ASPECT = 1.25  # bbox long/short side of a circle or square: renders <= 1.16
_CIRCLE_MIN_FILL = 0.60  # a disc fills pi/4 of its box: renders 0.67-0.88 (blur cuts corners)
_CIRCLE_MIN_IOU = 0.80  # IoU with the equal-area disc at the centroid: renders >= 0.82
_CIRCLE_MAX_SPREAD = 0.09  # std / mean of the boundary's radius: renders <= 0.078, crafted >= 0.10
_CIRCLE_MAX_DROP = 0.04  # |centroid - bbox centre| / bbox height: renders <= 0.03
_MAX_ASPECT = 1.6  # a triangle's bbox long/short side: renders <= 1.4
_TRIANGLE_FILL = (0.45, 0.88)  # an ideal triangle fills 1/2 of its box; blur raises it to 0.84
_TRIANGLE_MIN_DROP = 0.04  # centroid below bbox centre, as a fraction of bbox height: >= 0.057
_TRIANGLE_MIN_IOU = 0.55  # IoU with the apex-up triangle inscribed in the bbox: renders >= 0.62
_TRIANGLE_MIN_FIT = 0.75  # IoU with the least-squares trapezoid of its row widths: >= 0.86
_TRIANGLE_MAX_TAPER = 0.6  # fitted width at the top / at the bottom: renders <= 0.48


@dataclass(frozen=True)
class Detection:
    """One object the verifier found: kept so failures can be inspected, not just counted."""

    color: str
    shape: str  # one of SHAPES, or "unknown" for a blob that passes no shape's test
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


def _disc_fit(mask: np.ndarray) -> tuple[float, float]:
    """Roundness of a (h, w) blob mask: (IoU with the equal-area disc at its centroid, the
    spread (std / mean) of its boundary pixels' distance from the centroid)."""
    rows, cols = np.nonzero(mask)
    cy, cx = rows.mean() + 0.5, cols.mean() + 0.5
    yy, xx = np.indices(mask.shape) + 0.5  # pixel centres, (2, h, w)
    disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= rows.size / np.pi
    iou = (disc & mask).sum() / (disc | mask).sum()
    edge = mask & ~ndimage.binary_erosion(mask, border_value=0)
    radius = np.hypot(yy[edge] - cy, xx[edge] - cx)
    return float(iou), float(radius.std() / max(radius.mean(), 1e-6))


def _triangle_fit(mask: np.ndarray) -> tuple[float, float, float]:
    """How apex-up-triangular a (h, w) blob mask is: (IoU with the triangle inscribed in its
    bbox, IoU with the trapezoid whose row widths are the least-squares line through the blob's,
    that line's width at the top over its width at the bottom).

    Blur eats a triangle's apex first, so its box shrinks and the inscribed triangle fits less
    well; the trapezoid still fits (its top just is not a point), while stars, L shapes and
    crosses, whose widths do not grow linearly down a centred axis, fit neither."""
    h, w = mask.shape
    yy, xx = np.indices(mask.shape) + 0.5
    ideal = np.abs(xx / w - 0.5) <= yy / h / 2  # as render.py draws it
    tri_iou = (ideal & mask).sum() / (ideal | mask).sum()
    centres = np.arange(h) + 0.5
    slope, top = np.polyfit(centres, mask.sum(axis=1).astype(np.float64), 1)
    width = np.clip(top + slope * centres, 0.0, None)  # (h,) fitted row widths
    cx = np.nonzero(mask)[1].mean() + 0.5
    trapezoid = np.abs(xx - cx) <= width[:, None] / 2
    fit = (trapezoid & mask).sum() / (trapezoid | mask).sum()
    taper = top / max(top + slope * h, 1e-6)
    return float(tri_iou), float(fit), float(taper)


def blob_shape(rows: np.ndarray, cols: np.ndarray) -> str:
    """Name a blob (its pixels' rows and cols) "circle", "square" or "triangle" by a positive
    test for each, else "unknown".

    - square: fills its bbox (>= 0.88) and the bbox is near square;
    - circle: fills about pi/4 of a near-square bbox and is round: the disc of equal area at its
      centroid covers it (IoU) and its boundary's distance from the centroid barely varies;
    - triangle (apex up, as rendered): mass low in the box (centroid ~1/6 of the height below
      centre on crisp renders), fill about 1/2, and row widths growing linearly downward.

    Any blob with a hole is unknown. Naming by elimination (the old rule: not square- or
    triangle-like, so a circle) let a plus sign pass "a red circle".
    """
    top, left = rows.min(), cols.min()
    h, w = int(rows.max() - top + 1), int(cols.max() - left + 1)
    mask = np.zeros((h, w), dtype=bool)
    mask[rows - top, cols - left] = True
    fill, aspect = rows.size / (h * w), max(h, w) / min(h, w)
    drop = (rows.mean() - top + 0.5) / h - 0.5
    holes = ndimage.binary_fill_holes(mask).sum() - rows.size
    if holes > _MAX_HOLES * rows.size or aspect > _MAX_ASPECT:
        return "unknown"
    if fill >= _SQUARE_MIN_FILL and aspect <= _ROUND_MAX_ASPECT:
        return "square"
    if fill >= _CIRCLE_MIN_FILL and aspect <= _ROUND_MAX_ASPECT and abs(drop) <= _CIRCLE_MAX_DROP:
        iou, spread = _disc_fit(mask)
        if iou >= _CIRCLE_MIN_IOU and spread <= _CIRCLE_MAX_SPREAD:
            return "circle"
    lo, hi = _TRIANGLE_FILL
    if lo <= fill <= hi and drop >= _TRIANGLE_MIN_DROP:
        tri_iou, fit, taper = _triangle_fit(mask)
        if (
            tri_iou >= _TRIANGLE_MIN_IOU
            and fit >= _TRIANGLE_MIN_FIT
            and taper <= _TRIANGLE_MAX_TAPER
        ):
            return "triangle"
    return "unknown"


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
