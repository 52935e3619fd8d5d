"""ShapesBench: a GenEval-style compositional benchmark in miniature. This module is its
grammar: the prompts, their parsed meaning, the categories, the train/eval split, and the image
regions a position names (``render.py`` draws them, ``verify.py`` checks them).

Prompts such as "two red circles on the left" describe 32x32 RGB images of flat, hard-edged
shapes on black. The images are simple enough for a programmatic verifier (colour segmentation,
connected components, fill-ratio shape test) to grade a generated image exactly, so it can serve
as an RL reward without a learned judge.

Coordinates: a pixel with row ``r`` and column ``c`` covers ``[c, c+1) x [r, r+1)``, so its
centre is ``(c + 0.5, r + 0.5)``. Centroids are reported in these continuous units, which makes
the region thresholds (12 and 20 for a 32 px image) symmetric about the image centre (16).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

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


def region_bounds(size: float) -> tuple[float, float]:
    """The centre band along an axis of ``size`` pixels; "left" etc. lie beyond its edges."""
    return size * 3 / 8, size * 5 / 8


def in_region(position: str, cx: float, cy: float, height: int, width: int) -> bool:
    """Whether a centroid (continuous coordinates) lies in the region ``position`` names."""
    (xlo, xhi), (ylo, yhi) = region_bounds(width), region_bounds(height)
    if position == "center":
        return xlo <= cx <= xhi and ylo <= cy <= yhi
    depth = {"left": xlo - cx, "right": cx - xhi, "top": ylo - cy, "bottom": cy - yhi}
    if position not in depth:
        raise ValueError(f"unknown position {position!r}; expected one of {POSITIONS}")
    return depth[position] > 0
