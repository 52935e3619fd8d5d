"""ShapesBench's shape naming (``blob_shape``): every shape passes a positive test, and a blob
that passes none is "unknown", which fails every shape check. Ground-truth renders at every
size (crisp, noisy, blurred) keep their names, and so do discs as rough as a generator draws
them; crafted non-shapes (plus signs, crosses, rings, stars, L shapes, two discs, ragged
blobs) are unknown.

Known limit: a plus whose arms are wider than half its span (a 9 px plus with 5 px arms: 2 px
notches) is a digital disc give or take a pixel a corner at 32 px and reads as a circle; at
64 px one with notches of a fifth of its span still does. Narrower arms fail."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy import ndimage
from shapes_images import bumpy_disc, crafted_blobs, noisy_blob, plus_sign, ragged_blob

from diffrl.tasks.shapes.prompts import COLORS, IMAGE_SIZE, SHAPES, all_prompts, parse_prompt
from diffrl.tasks.shapes.render import _OBJ_MAX_32, _OBJ_MIN_32, _shape_mask, render
from diffrl.tasks.shapes.verify import blob_shape, detect, verify


def _blurred(image: np.ndarray, sigma: float) -> np.ndarray:
    out = ndimage.gaussian_filter(image.astype(np.float64), sigma=(sigma, sigma, 0))
    return np.clip(out.round(), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("size", [20, 24, 32, 48, 64, 96, 128])
def test_rendered_masks_keep_their_names(size: int) -> None:
    """Every object side render.py may draw at this size (it keeps only named ones) is named
    right, and at 32 px and above that is every side in the size range."""
    smin = max(3, round(_OBJ_MIN_32 * size / IMAGE_SIZE))
    smax = max(smin, round(_OBJ_MAX_32 * size / IMAGE_SIZE))
    for shape in SHAPES:
        named = [
            s
            for s in range(smin, smax + 1)
            if blob_shape(*np.nonzero(_shape_mask(shape, s)[0])) == shape
        ]
        assert named, (shape, size)
        if size >= IMAGE_SIZE:
            assert named == list(range(smin, smax + 1)), (shape, size)


@pytest.mark.parametrize("size", [24, 48, 64])
def test_renders_pass_clean_noisy_and_blurred(size: int) -> None:
    """Ground truth at sizes other than 32 (test_shapes covers 32 on every prompt), with the
    N(0, 15) noise and the sigma = 0.7 px (at 32) blur that generated images show."""
    rng = np.random.default_rng(size)
    for prompt in all_prompts()[::9]:
        image = render(prompt, rng, size=size)
        noisy = np.clip(image + rng.normal(0.0, 15.0, image.shape), 0, 255).astype(np.uint8)
        for variant in (image, noisy, _blurred(image, 0.7 * size / IMAGE_SIZE)):
            assert verify(variant, prompt).overall, (prompt.text, size)


@pytest.mark.parametrize("size", [32, 64])
def test_crafted_blobs_are_unknown(size: int) -> None:
    for name, mask in crafted_blobs(size).items():
        image = np.zeros((size, size, 3), dtype=np.uint8)
        image[mask] = COLORS["red"]
        found = detect(image)
        assert [d.shape for d in found] == ["unknown"], (name, size, found)
        for shape in SHAPES:
            v = verify(image, parse_prompt(f"a red {shape}"))
            assert not v.overall and not v.constraints["shape"] and v.fractions["shape"] == 0.0
            assert v.constraints["color"] and v.constraints["count"]


def test_plus_sign_fails_circle_prompts_and_partial_credit() -> None:
    """The issue's case: a red plus on the background passed "a red circle". Beside a real
    circle it earns half the shape credit for "two red circles", not all of it."""
    image = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    image[plus_sign(IMAGE_SIZE, 10, 4)] = COLORS["red"]
    assert not verify(image, parse_prompt("a red circle")).overall
    disc = _shape_mask("circle", 8)[0]
    image[2:10, 22:30][disc] = COLORS["red"]
    v = verify(image, parse_prompt("two red circles"))
    assert sorted(d.shape for d in v.detected) == ["circle", "unknown"]
    assert not v.overall and v.fractions["shape"] == 0.5 and v.constraints["count"]


def test_random_ragged_blobs_are_rarely_named() -> None:
    """Random unions of small squares and wobbly discs, 100 of each at 32 px: the old rule
    named 183 of the 200 a circle or a triangle; now 4 are (2 circles, 2 triangles)."""
    named = Counter(blob_shape(*np.nonzero(ragged_blob(IMAGE_SIZE, seed))) for seed in range(100))
    named += Counter(blob_shape(*np.nonzero(noisy_blob(IMAGE_SIZE, seed))) for seed in range(100))
    assert named["circle"] + named["triangle"] <= 6, named


def test_rough_discs_stay_circles() -> None:
    """A generator's circles have stray edge pixels: a disc with three one-pixel bumps and two
    one-pixel dents is a circle (97 of 100 at 32 px, where a bump on top can read as an apex;
    the old rule: 82), and every one at 64 px."""
    small = Counter(blob_shape(*np.nonzero(bumpy_disc(IMAGE_SIZE, seed))) for seed in range(100))
    assert small["circle"] >= 95, small
    assert all(blob_shape(*np.nonzero(bumpy_disc(64, seed))) == "circle" for seed in range(20))
