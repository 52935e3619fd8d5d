"""Edits to ShapesBench renders that tests use to make a verdict fail in a known way."""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from diffrl.tasks.shapes.prompts import COLORS


def square_off_one_blob(image: np.ndarray, color: str) -> None:
    """Fill the bounding box of the first `color` blob in place (a circle becomes a square)."""
    labels, _ = ndimage.label((image == COLORS[color]).all(axis=-1))
    image[ndimage.find_objects(labels)[0]] = COLORS[color]


# --------------------------------------------------------------------------- crafted failures
# Blobs that are no circle, square or triangle, drawn at any image size (pixel lengths are
# for 32 px and scale with `size`). The verifier must name each "unknown".


def _grid(size: int) -> tuple[np.ndarray, np.ndarray, float]:
    yy, xx = np.indices((size, size)) + 0.5  # pixel centres
    return yy, xx, size / 32


def plus_sign(size: int, span: int, arm: int) -> np.ndarray:
    """A plus of `span` px whose arms are `arm` px thick, as an (size, size) mask."""
    k = size // 32
    span, arm = span * k, arm * k
    mask, o, n = np.zeros((size, size), dtype=bool), 10 * k, (span - arm) // 2
    mask[o : o + span, o + n : o + n + arm] = True
    mask[o + n : o + n + arm, o : o + span] = True
    return mask


def x_cross(size: int, span: float, arm: float) -> np.ndarray:
    yy, xx, k = _grid(size)
    u, v = (xx - 16 * k + yy - 16 * k) / np.sqrt(2), (xx - 16 * k - yy + 16 * k) / np.sqrt(2)
    reach, half = span * k * 0.6, arm * k / 2
    return ((np.abs(u) <= reach) & (np.abs(v) <= half)) | (
        (np.abs(v) <= reach) & (np.abs(u) <= half)
    )


def ragged_blob(size: int, seed: int) -> np.ndarray:
    """The largest 8-connected part of eight 3 px squares dropped at random in a 10 px box."""
    k, rng = size // 32, np.random.default_rng(seed)
    mask = np.zeros((size, size), dtype=bool)
    for _ in range(8):
        y, x = rng.integers(11 * k, 19 * k, 2)
        mask[y : y + 3 * k, x : x + 3 * k] = True
    labels, n = ndimage.label(mask, structure=np.ones((3, 3)))
    sizes = ndimage.sum_labels(mask, labels, range(1, n + 1))
    return labels == 1 + int(np.argmax(sizes))


def noisy_blob(size: int, seed: int) -> np.ndarray:
    """A disc whose radius wobbles by random harmonics 2-7 (25% each)."""
    yy, xx, k = _grid(size)
    rng = np.random.default_rng(seed)
    angle, radius = np.arctan2(yy - 16 * k, xx - 16 * k), np.hypot(yy - 16 * k, xx - 16 * k)
    wobble = sum(
        rng.normal(0, 0.25) * np.cos(j * angle + rng.uniform(0, 2 * np.pi)) for j in range(2, 8)
    )
    return radius <= 4.5 * k * (1 + wobble)


def crafted_blobs(size: int) -> dict[str, np.ndarray]:
    """Named (size, size) masks of shapes that must be "unknown"."""
    yy, xx, k = _grid(size)
    c = 16 * k
    r, angle = np.hypot(yy - c, xx - c), np.arctan2(yy - c, xx - c)
    left, right = (
        np.hypot(yy - c, xx - c + 4 * k) <= 4 * k,
        np.hypot(yy - c, xx - c - 4 * k) <= 4 * k,
    )
    lower = np.hypot(yy - c - 5.5 * k, xx - c - 5.5 * k) <= 4 * k
    overlapping = np.hypot(yy - c - 4 * k, xx - c - 4 * k) <= 4 * k
    in_box = (xx >= 11 * k) & (yy < 21 * k)
    blobs = {
        "plus thin 9/3": plus_sign(size, 9, 3),
        "plus 10/4": plus_sign(size, 10, 4),
        "plus thick 12/6": plus_sign(size, 12, 6),
        "plus thick 11/5": plus_sign(size, 11, 5),
        "x thin": x_cross(size, 10, 2.5),
        "x thick": x_cross(size, 10, 4),
        "L": in_box & (((xx < 14 * k) & (yy >= 11 * k)) | ((xx < 21 * k) & (yy >= 18 * k))),
        "L thick": in_box & (((xx < 16 * k) & (yy >= 11 * k)) | ((xx < 21 * k) & (yy >= 16 * k))),
        "ring": (r <= 5 * k) & (r >= 2.5 * k),
        "thin ring": (r <= 5 * k) & (r >= 3.5 * k),
        "star": r <= (3 + 2.5 * np.cos(5 * (angle + np.pi / 2))) * k * 1.1,
        "fat star": r <= (4 + 1.2 * np.cos(5 * (angle + np.pi / 2))) * k,
        "two touching discs": left | right,
        "two discs, diagonal": (r <= 4 * k) | lower,
        "two overlapping discs": (r <= 4 * k) | overlapping,
        "ellipse 1.7": ((xx - c) / (6.8 * k)) ** 2 + ((yy - c) / (4 * k)) ** 2 <= 1,
        "ellipse 1.5": ((xx - c) / (6 * k)) ** 2 + ((yy - c) / (4 * k)) ** 2 <= 1,
        "rectangle 1.5": (np.abs(xx - c) <= 6 * k) & (np.abs(yy - c) <= 4 * k),
        "half disc": (r <= 5 * k) & (yy >= c),
        "upside-down triangle": (np.abs(xx - c) <= (c + 5 * k - yy) / 2) & (yy >= c - 5 * k),
    }
    for seed in range(3):
        blobs[f"ragged {seed}"] = ragged_blob(size, seed)
        blobs[f"noisy blob {seed}"] = noisy_blob(size, seed)
    return blobs


def bumpy_disc(size: int, seed: int) -> np.ndarray:
    """A disc (radius 4.5 px at 32) with three one-pixel bumps and two one-pixel dents on its
    edge, the roughness a generator's circles show: still a circle."""
    yy, xx, k = _grid(size)
    rng = np.random.default_rng(seed)
    mask = np.hypot(yy - 16 * k, xx - 16 * k) <= 4.5 * k
    edge = np.argwhere(mask & ~ndimage.binary_erosion(mask))
    for i, (r, c) in enumerate(edge[rng.choice(len(edge), 5, replace=False)]):
        if i < 3:  # a bump: the background pixel just outside, away from the centre
            r, c = r + int(np.sign(r + 0.5 - 16 * k)), c + int(np.sign(c + 0.5 - 16 * k))
        mask[r, c] = i < 3
    return mask
