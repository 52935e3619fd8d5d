"""ShapesBench's ground-truth renderer (the pre-training data and the probe's known-good
samples): hard-edged shapes placed by rejection sampling so that each image passes the verifier
(``verify.py``), which it checks before returning one.
"""

from __future__ import annotations

import functools

import numpy as np

from diffrl.tasks.shapes.prompts import COLORS, IMAGE_SIZE, SHAPES, ShapesPrompt, region_bounds
from diffrl.tasks.shapes.verify import blob_shape, verify

# Renderer parameters (for a 32 px image; scaled linearly with size).
_OBJ_MIN_32, _OBJ_MAX_32 = 7, 10
_GAP = 2  # empty pixels required between bounding boxes
_REGION_MARGIN_32 = 1.5  # how far inside a region a positioned centroid must be
_PLACE_ATTEMPTS, _BOX_TRIES, _RENDER_RETRIES = 300, 40, 20  # rejection-sampling budgets
_Box = tuple[int, int, int]  # (x0, y0, side) of an object's square bounding box
_Item = tuple[str, str | None]  # (shape, position) of one object to place


@functools.cache
def _shape_mask(shape: str, side: int) -> tuple[np.ndarray, float, float]:
    """Boolean mask of a shape in a side x side box, plus its centroid (continuous coords)."""
    centres = (np.arange(side) + 0.5) / side  # pixel centres in [0, 1]
    v, u = np.meshgrid(centres, centres, indexing="ij")
    if shape == "square":
        mask = np.ones((side, side), dtype=bool)
    elif shape == "circle":
        mask = (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    elif shape == "triangle":
        mask = np.abs(u - 0.5) <= v / 2  # apex at top centre, base along the bottom row
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    rows, cols = np.nonzero(mask)
    mask.setflags(write=False)
    return mask, float(cols.mean() + 0.5), float(rows.mean() + 0.5)


def _axis_range(
    position: str | None, axis: str, offset: float, side: int, size: int, margin: float
) -> tuple[int, int]:
    """Allowed box origins along one axis so the centroid lands well inside the region."""
    lo_edge, hi_edge = 0, size - side
    lo, hi = region_bounds(size)
    first, last = ("left", "right") if axis == "x" else ("top", "bottom")
    if position == first:
        hi_edge = min(hi_edge, int(np.floor(lo - margin - offset)))
    elif position == last:
        lo_edge = max(lo_edge, int(np.ceil(hi + margin - offset)))
    elif position == "center":
        lo_edge = max(lo_edge, int(np.ceil(lo + margin - offset)))
        hi_edge = min(hi_edge, int(np.floor(hi - margin - offset)))
    return lo_edge, hi_edge


def _separated(a: _Box, b: _Box) -> bool:
    """True if the boxes leave >= _GAP empty pixels between them along x or y."""
    (ax, ay, aside), (bx, by, bside) = a, b
    return max(bx - ax - aside, ax - bx - bside, by - ay - aside, ay - by - bside) >= _GAP


@functools.cache
def _allowed_sides(shape: str, size: int) -> tuple[int, ...]:
    """Object sides in the size range whose rasterised mask the verifier reads as ``shape``.

    All of 7..10 qualify at 32 px; at other image sizes e.g. a 6 px disc reads as a square.
    """
    smin = max(3, round(_OBJ_MIN_32 * size / IMAGE_SIZE))
    smax = max(smin, round(_OBJ_MAX_32 * size / IMAGE_SIZE))
    sides = [
        side
        for side in range(smin, smax + 1)
        if blob_shape(*np.nonzero(_shape_mask(shape, side)[0])) == shape
    ]
    if not sides:
        raise ValueError(f"no object size renders a verifiable {shape} at image size {size}")
    return tuple(sides)


def _place(items: list[_Item], rng: np.random.Generator, size: int) -> list[_Box]:
    """Rejection-sample non-overlapping boxes (x0, y0, side), shrinking objects if crowded."""
    margin = _REGION_MARGIN_32 * size / IMAGE_SIZE
    for attempt in range(_PLACE_ATTEMPTS):
        # Early attempts draw from the full size range; later ones only from its smaller part.
        keep = 1.0 - attempt / _PLACE_ATTEMPTS
        boxes: list[_Box] = []
        for shape, position in items:
            sides = _allowed_sides(shape, size)
            side = int(rng.choice(sides[: max(1, int(np.ceil(keep * len(sides))))]))
            _, ox, oy = _shape_mask(shape, side)
            x_lo, x_hi = _axis_range(position, "x", ox, side, size, margin)
            y_lo, y_hi = _axis_range(position, "y", oy, side, size, margin)
            if x_lo > x_hi or y_lo > y_hi:
                break
            for _ in range(_BOX_TRIES):
                box = (int(rng.integers(x_lo, x_hi + 1)), int(rng.integers(y_lo, y_hi + 1)), side)
                if all(_separated(box, other) for other in boxes):
                    boxes.append(box)
                    break
            else:
                break
        else:
            return boxes
    raise RuntimeError(f"could not place {items} in a {size}x{size} image")


def _draw(prompt: ShapesPrompt, rng: np.random.Generator, size: int) -> np.ndarray:
    """One placement + rasterisation pass, without the final self-check."""
    objects = [obj for obj in prompt.objects for _ in range(obj.count)]
    boxes = _place([(obj.shape, obj.position) for obj in objects], rng, size)
    image = np.zeros((size, size, 3), dtype=np.uint8)
    for obj, (x0, y0, side) in zip(objects, boxes, strict=True):
        mask, _, _ = _shape_mask(obj.shape, side)
        image[y0 : y0 + side, x0 : x0 + side][mask] = COLORS[obj.color]
    return image


def render(prompt: ShapesPrompt, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """Draw a ground-truth image satisfying ``prompt`` (uint8, H x W x 3, hard edges)."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    if size < 20:
        raise ValueError(f"size must be >= 20 so three objects fit in one region, got {size}")
    for _ in range(_RENDER_RETRIES):
        image = _draw(prompt, rng, size)
        # Placement is designed to satisfy the verifier; checking costs little and guarantees
        # ground truth never contradicts the reward, even if constants are retuned later.
        if verify(image, prompt).overall:
            return image
    raise RuntimeError(f"could not render a verifiable image for {prompt.text!r} at {size} px")
