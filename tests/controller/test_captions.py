"""Captions under the sample grids and clip strips keep their word spaces (issue 41, finding 16:
Pillow's default FreeType font draws a space 2 px wide, so "tied to a dock" read "tied toa")."""

from __future__ import annotations

import numpy as np
from PIL import Image

from diffrl.controller import media
from diffrl.controller.run_dir import RunDir


def widest_gap(caption_area: np.ndarray) -> int:
    """The widest run of blank columns between the first and the last inked column."""
    ink = np.flatnonzero((caption_area < 128).any(axis=(0, 2)))
    return int(np.diff(ink).max()) - 1 if len(ink) > 1 else 0


def test_grid_and_strip_captions_keep_word_spaces(tmp_path) -> None:
    tile = 96
    path = RunDir(tmp_path, tensorboard=False).save_grid(
        0, np.zeros((1, 8, 8, 3), np.uint8), ["ii ii"], [None], cols=1, tile=tile
    )
    grid = np.asarray(Image.open(path).convert("RGB"))[tile + 8 :]  # below the bordered tile
    strip = media.strip_png(
        tmp_path / "clip.png",
        np.zeros((2, 8, 8, 3), np.uint8),
        np.zeros(800, np.float32),
        8000,
        "ii ii",
        None,
    )
    below = np.asarray(Image.open(strip).convert("RGB"))[-14:]  # the caption's line
    for area in (grid, below):
        # a space is a character's width (6 px in the bitmap font), not 2 px: "i" leaves the
        # widest side bearings, so the gap inside "ii" stays well under the one between words
        assert widest_gap(area) >= 6
