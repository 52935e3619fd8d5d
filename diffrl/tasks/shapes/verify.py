"""ShapesBench's verifier: segment a generated image by colour, name each blob's shape, and
check the prompt's colours, counts, shapes and positions exactly. It is the ``shapes`` scorer's
program and the held-out eval's; ``render.py`` draws only images it passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage
from scipy.spatial import ConvexHull

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
# every shape check. The ranges quoted are those of 12,900 ground-truth blobs: 2,376 renders
# at 20-128 px, each crisp, with N(0, 15) noise and with a 0.7 px (at 32) blur. Each bound
# keeps them all and, where the renders leave room, the base model's rougher shapes, while
# crafted plus signs, crosses, rings, stars, L shapes, two joined discs and ragged blobs fail
# (`tests/tasks/shapes/test_blob_shape.py`).
_MAX_HOLES = 0.05  # hole pixels / blob pixels: renders have none, a ring >= 0.25
_MAX_ASPECT = 1.6  # bbox long/short side of any shape: renders <= 1.4 (blurred triangles)
_ROUND_MAX_ASPECT = 1.4  # of a circle or a square: renders <= 1.13
_SQUARE_MIN_FILL = 0.88  # bbox fill: renders >= 0.88 (blur rounds corners), discs <= 0.88
_CIRCLE_FILL = (0.60, 0.90)  # a disc fills pi/4 of its box: renders 0.67-0.88
_CIRCLE_MIN_IOU = 0.78  # IoU with the equal-area disc at the centroid: renders >= 0.82
# share of the convex hull (over pixel centres) that the blob, one-pixel spurs trimmed, leaves
# empty: renders 0, the base model's circles <= 0.09, a plus whose notches are a quarter of
# its span >= 0.10, crosses, stars and ragged blobs >= 0.12
_CIRCLE_MAX_DEFICIT = 0.08
_CIRCLE_MAX_DROP = 0.07  # |centroid - bbox centre| / bbox height: renders <= 0.03
_TRIANGLE_FILL = (0.45, 0.88)  # an ideal triangle fills 1/2 of its box: renders 0.50-0.84
_TRIANGLE_MIN_DROP = 0.04  # centroid below bbox centre, as a share of bbox height: >= 0.057
_TRIANGLE_MIN_IOU = 0.5  # IoU with the apex-up triangle inscribed in the bbox: renders >= 0.62
_TRIANGLE_MIN_FIT = 0.75  # IoU with the shape between its fitted edges: renders >= 0.86
_TRIANGLE_MAX_TAPER = 0.6  # fitted width at the top / at the bottom: renders <= 0.56
_TRIANGLE_MAX_DEFICIT = 0.1  # as for circles (untrimmed): renders 0, an L >= 0.12
_TRIANGLE_MAX_DISC_IOU = 0.88  # not round: renders <= 0.83, a disc with a bump on top >= 0.9


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
_NEIGHBOURS = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=np.int8)  # 4-neighbour count


def _check_image(image: np.ndarray, ndim: int) -> None:
    if not isinstance(image, np.ndarray):
        raise TypeError(f"image must be a numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise TypeError(f"image must be uint8, got dtype {image.dtype} (shape {image.shape})")
    if image.ndim != ndim or image.shape[-1] != 3:
        want = "(H, W, 3)" if ndim == 3 else "(B, H, W, 3)"
        raise ValueError(f"image must have shape {want}, got {image.shape}")


def _disc_iou(mask: np.ndarray) -> float:
    """IoU of a (h, w) blob mask with the disc of equal area at its centroid."""
    rows, cols = np.nonzero(mask)
    yy, xx = np.indices(mask.shape) + 0.5  # pixel centres, (2, h, w)
    disc = (yy - rows.mean() - 0.5) ** 2 + (xx - cols.mean() - 0.5) ** 2 <= rows.size / np.pi
    return float((disc & mask).sum() / (disc | mask).sum())


def _trim_spurs(mask: np.ndarray) -> np.ndarray:
    """The blob without spurs one pixel wide and up to two long (pixels with at most one
    4-neighbour, twice). Not for triangles: their corners are such pixels too."""
    core = np.pad(mask, 1)
    for _ in range(2):
        neighbours = ndimage.convolve(core.astype(np.int8), _NEIGHBOURS, mode="constant")
        core = core & (neighbours >= 2)
    return core[1:-1, 1:-1]


def _convex_deficit(mask: np.ndarray) -> float:
    """The share of the blob's convex hull (over pixel centres) that the blob leaves empty:
    notches, dents and gaps. A digital disc, square or triangle leaves none."""
    points = np.argwhere(mask).astype(np.float64)  # (N, 2)
    if len(np.unique(points[:, 0])) < 2 or len(np.unique(points[:, 1])) < 2:
        return 1.0  # a line or a speck: no area to be convex
    hull = ConvexHull(points)
    grid = np.indices(mask.shape).reshape(2, -1).T  # (h * w, 2)
    inside = (grid @ hull.equations[:, :2].T + hull.equations[:, 2] <= 1e-9).all(axis=1)
    return float(1.0 - mask.sum() / inside.sum())


def _triangle_fit(mask: np.ndarray) -> tuple[float, float, float]:
    """How apex-up-triangular a (h, w) blob mask is: (IoU with the triangle inscribed in its
    bbox, IoU with the shape between its two fitted edges, the fitted width at the top over the
    width at the bottom).

    The edges are least-squares lines through each row's leftmost and rightmost pixel, so any
    triangle with a flat base fits, skewed or not, and so does a blurred one, whose apex blur
    has cut off (its top then is not a point). Stars, L shapes and crosses, whose edges are not
    straight, fit neither."""
    h, w = mask.shape
    yy, xx = np.indices(mask.shape) + 0.5
    ideal = np.abs(xx / w - 0.5) <= yy / h / 2  # as render.py draws it
    tri_iou = (ideal & mask).sum() / (ideal | mask).sum()
    rows = np.arange(h)
    filled = mask.any(axis=1)
    left = np.argmax(mask, axis=1).astype(np.float64)  # (h,) each row's first pixel
    right = w - 1 - np.argmax(mask[:, ::-1], axis=1).astype(np.float64)
    lo = np.polyval(np.polyfit(rows[filled], left[filled], 1), rows)  # (h,) fitted edges
    hi = np.polyval(np.polyfit(rows[filled], right[filled], 1), rows)
    between = (xx - 0.5 >= lo[:, None] - 0.5) & (xx - 0.5 <= hi[:, None] + 0.5)
    fit = (between & mask).sum() / (between | mask).sum()
    top, bottom = hi[0] - lo[0] + 1, hi[-1] - lo[-1] + 1
    return float(tri_iou), float(fit), float(max(top, 0.0) / max(bottom, 1e-6))


def blob_shape(rows: np.ndarray, cols: np.ndarray) -> str:
    """Name a blob (its pixels' rows and cols) "circle", "square" or "triangle" by a positive
    test for each, else "unknown".

    - square: fills its bbox (>= 0.88) and the bbox is near square;
    - circle: fills about pi/4 of a near-square bbox, covers the disc of equal area at its
      centroid (IoU) and is nearly convex (a plus sign's notches, a cross's or star's arms, a
      ragged outline leave much of its convex hull empty);
    - triangle (apex up, as rendered): mass low in the box (centroid ~1/6 of the height below
      centre on crisp renders), fill about 1/2, straight edges that close in upward, and not
      round. It is tested before the circle: blur rounds a small triangle enough to pass a
      circle's IoU, and only its low mass and straight edges tell it apart.

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
    lo, hi = _TRIANGLE_FILL
    if lo <= fill <= hi and drop >= _TRIANGLE_MIN_DROP:
        tri_iou, fit, taper = _triangle_fit(mask)
        straight = fit >= _TRIANGLE_MIN_FIT and taper <= _TRIANGLE_MAX_TAPER
        solid = _convex_deficit(mask) <= _TRIANGLE_MAX_DEFICIT
        round_ = _disc_iou(mask) > _TRIANGLE_MAX_DISC_IOU
        if straight and solid and not round_ and tri_iou >= _TRIANGLE_MIN_IOU:
            return "triangle"
    lo, hi = _CIRCLE_FILL
    if lo <= fill < hi and aspect <= _ROUND_MAX_ASPECT and abs(drop) <= _CIRCLE_MAX_DROP:
        core = _trim_spurs(mask)  # one stray edge pixel stretches a small disc's hull by 1/10
        if _disc_iou(mask) >= _CIRCLE_MIN_IOU and _convex_deficit(core) <= _CIRCLE_MAX_DEFICIT:
            return "circle"
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
