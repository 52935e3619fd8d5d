"""ShapesBench: a GenEval-style compositional benchmark in miniature.

Prompts such as "two red circles on the left" describe 32x32 RGB images of flat, hard-edged
shapes on black. The images are simple enough for a programmatic verifier (colour segmentation,
connected components, fill-ratio shape test) to grade a generated image exactly, so it can serve
as an RL reward without a learned judge. The grammar, the ground-truth renderer (pretraining
data) and the verifier (reward) live together here because they must agree with each other.

Coordinates: a pixel with row ``r`` and column ``c`` covers ``[c, c+1) x [r, r+1)``, so its
centre is ``(c + 0.5, r + 0.5)``. Centroids are reported in these continuous units, which makes
the region thresholds (12 and 20 for a 32 px image) symmetric about the image centre (16).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
from scipy import ndimage

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom", "center")
IMAGE_SIZE = 32
CATEGORIES = ("single_object", "counting", "position", "counting_position", "color_attr")

_NUMBER_WORDS = {1: "a", 2: "two", 3: "three"}
_EVAL_FRACTION = 0.2
_MIN_EVAL_PER_CATEGORY = 2

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

# Renderer parameters (for a 32 px image; scaled linearly with size).
_OBJ_MIN_32, _OBJ_MAX_32 = 7, 10
_GAP = 2  # empty pixels required between bounding boxes
_REGION_MARGIN_32 = 1.5  # how far inside a region a positioned centroid must be
_PLACE_ATTEMPTS, _BOX_TRIES, _RENDER_RETRIES = 300, 40, 20  # rejection-sampling budgets
_Box = tuple[int, int, int]  # (x0, y0, side) of an object's square bounding box
_Item = tuple[str, str | None]  # (shape, position) of one object to place


@dataclass(frozen=True)
class ObjectSpec:
    """One group of identical objects requested by a prompt."""

    count: int  # 1..3
    color: str
    shape: str
    position: str | None  # None = anywhere


@dataclass(frozen=True)
class ShapesPrompt:
    """A prompt text together with its parsed meaning and benchmark category."""

    text: str
    objects: tuple[ObjectSpec, ...]
    category: str


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


# --------------------------------------------------------------------------- prompts


def _phrase(obj: ObjectSpec) -> str:
    noun = obj.shape if obj.count == 1 else obj.shape + "s"
    text = f"{_NUMBER_WORDS[obj.count]} {obj.color} {noun}"
    if obj.position == "center":
        text += " in the center"
    elif obj.position is not None:
        text += f" on the {obj.position}"
    return text


def _make(category: str, *objects: ObjectSpec) -> ShapesPrompt:
    return ShapesPrompt(" and ".join(_phrase(o) for o in objects), tuple(objects), category)


@functools.lru_cache(maxsize=1)
def _all_prompts_cached() -> tuple[ShapesPrompt, ...]:
    combos = [(c, s) for c in COLORS for s in SHAPES]
    out: list[ShapesPrompt] = []
    out += [_make("single_object", ObjectSpec(1, c, s, None)) for c, s in combos]
    out += [_make("counting", ObjectSpec(n, c, s, None)) for c, s in combos for n in (2, 3)]
    out += [_make("position", ObjectSpec(1, c, s, p)) for c, s in combos for p in POSITIONS]
    edges = [p for p in POSITIONS if p != "center"]
    out += [_make("counting_position", ObjectSpec(n, c, s, p)) for c, s in combos for n in (2, 3)
            for p in edges]  # fmt: skip
    out += [_make("color_attr", ObjectSpec(1, c1, s1, None), ObjectSpec(1, c2, s2, None))
            for c1, s1 in combos for c2, s2 in combos if c1 != c2 and s1 != s2]  # fmt: skip
    return tuple(out)


def all_prompts() -> list[ShapesPrompt]:
    """Every prompt of the grammar, in a fixed order (264 prompts)."""
    return list(_all_prompts_cached())


@functools.lru_cache(maxsize=1)
def _eval_texts() -> frozenset[str]:
    chosen: set[str] = set()
    for category in CATEGORIES:
        members = [p for p in _all_prompts_cached() if p.category == category]
        groups: dict[str, list[str]] = {}
        for p in members:
            # "a red circle and a blue square" and its mirror describe the same scene; keying
            # both on one canonical text keeps them in one split so eval is truly held out.
            groups.setdefault(" and ".join(sorted(p.text.split(" and "))), []).append(p.text)
        target = max(_MIN_EVAL_PER_CATEGORY, round(_EVAL_FRACTION * len(members)))
        order = sorted(groups, key=lambda k: (hashlib.sha256(k.encode()).hexdigest(), k))
        taken: list[str] = []
        for key in order:
            if len(taken) < target:
                taken += groups[key]
        chosen.update(taken)
    return frozenset(chosen)


def split_prompts(split: str) -> list[ShapesPrompt]:
    """Deterministic train/eval split; eval holds ~20% of each category for generalisation."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; expected one of 'train', 'eval'")
    held_out, want_eval = _eval_texts(), split == "eval"
    return [p for p in _all_prompts_cached() if (p.text in held_out) == want_eval]


@functools.lru_cache(maxsize=1)
def _prompt_index() -> dict[str, ShapesPrompt]:
    return {p.text: p for p in _all_prompts_cached()}


def parse_prompt(text: str) -> ShapesPrompt:
    """Recover the structured prompt from its text; the grammar is finite, so look it up."""
    try:
        return _prompt_index()[text]
    except (KeyError, TypeError):
        raise ValueError(f"prompt is outside the ShapesBench grammar: {text!r}") from None


def _region_bounds(size: float) -> tuple[float, float]:
    return size * 3 / 8, size * 5 / 8


def _in_region(position: str, cx: float, cy: float, height: int, width: int) -> bool:
    (xlo, xhi), (ylo, yhi) = _region_bounds(width), _region_bounds(height)
    if position == "center":
        return xlo <= cx <= xhi and ylo <= cy <= yhi
    depth = {"left": xlo - cx, "right": cx - xhi, "top": ylo - cy, "bottom": cy - yhi}
    if position not in depth:
        raise ValueError(f"unknown position {position!r}; expected one of {POSITIONS}")
    return depth[position] > 0


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
    lo, hi = _region_bounds(size)
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
        if _blob_shape(*np.nonzero(_shape_mask(shape, side)[0])) == shape
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


def _blob_shape(rows: np.ndarray, cols: np.ndarray) -> str:
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
            found.append(Detection(color, _blob_shape(rows, cols), cx, cy, int(rows.size)))
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
            _in_region(o.position, d.cx, d.cy, height, width)
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
