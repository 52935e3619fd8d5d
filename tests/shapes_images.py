"""Edits to ShapesBench renders that tests use to make a verdict fail in a known way."""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from diffrl.tasks.shapes.prompts import COLORS


def square_off_one_blob(image: np.ndarray, color: str) -> None:
    """Fill the bounding box of the first `color` blob in place (a circle becomes a square)."""
    labels, _ = ndimage.label((image == COLORS[color]).all(axis=-1))
    image[ndimage.find_objects(labels)[0]] = COLORS[color]
