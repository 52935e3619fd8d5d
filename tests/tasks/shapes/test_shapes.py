"""Tests for ShapesBench: grammar, splits, renderer and the verifier used as the RL reward."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from shapes_images import square_off_one_blob

from diffrl.tasks.shapes import prompts as shapes
from diffrl.tasks.shapes.prompts import (
    CATEGORIES,
    COLORS,
    IMAGE_SIZE,
    POSITIONS,
    SHAPES,
    ShapesPrompt,
    parse_prompt,
    split_prompts,
)
from diffrl.tasks.shapes.render import _draw, render
from diffrl.tasks.shapes.verify import category_accuracy, detect, score_batch, verify

SEEDS = range(4)


@pytest.fixture(scope="module")
def prompts() -> list[ShapesPrompt]:
    return shapes.all_prompts()


@pytest.fixture(scope="module")
def gt_images(prompts: list[ShapesPrompt]) -> list[tuple[ShapesPrompt, np.ndarray]]:
    """Every prompt rendered with 4 seeds (~1000 images)."""
    out = []
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        out += [(p, render(p, rng)) for p in prompts]
    return out


def _with_object(prompt: ShapesPrompt, **changes: object) -> ShapesPrompt:
    """The single-group prompt with its object's fields changed (text re-derived)."""
    obj = replace(prompt.objects[0], **changes)
    return next(p for p in shapes.all_prompts() if p.objects == (obj,))


# --------------------------------------------------------------------------- grammar / splits


def test_prompt_space_size_and_examples(prompts: list[ShapesPrompt]) -> None:
    counts = Counter(p.category for p in prompts)
    assert counts == {
        "single_object": 12,
        "counting": 24,
        "position": 60,
        "counting_position": 96,
        "color_attr": 72,
    }
    texts = {p.text for p in prompts}
    assert len(texts) == len(prompts) == 264
    for text in [
        "a red circle",
        "two red circles",
        "three blue squares",
        "a red circle on the left",
        "a yellow triangle in the center",
        "two red circles on the bottom",
        "a red circle and a blue square",
    ]:
        assert text in texts
    for text in ["two red circles in the center", "a red circle and a red square"]:
        assert text not in texts
    assert shapes.all_prompts() == prompts


def test_parse_prompt_round_trip(prompts: list[ShapesPrompt]) -> None:
    for p in prompts:
        assert parse_prompt(p.text) == p
    parsed = parse_prompt("three green triangles on the top")
    assert parsed.category == "counting_position"
    assert parsed.objects == (shapes.ObjectSpec(3, "green", "triangle", "top"),)


@pytest.mark.parametrize(
    "text",
    ["", "a purple circle", "A red circle", "a red circle.", "two red circle", "a red circles",
     "four red circles", "two red circles in the center", "a red circle and a red square",
     "a red circle and a blue circle", "a red circle  on the left"],
)  # fmt: skip
def test_parse_prompt_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="outside"):
        parse_prompt(text)


def test_splits(prompts: list[ShapesPrompt]) -> None:
    train, evals = split_prompts("train"), split_prompts("eval")
    train_texts, eval_texts = {p.text for p in train}, {p.text for p in evals}
    assert not train_texts & eval_texts
    assert train_texts | eval_texts == {p.text for p in prompts}
    assert len(train) + len(evals) == len(prompts)
    per_cat = Counter(p.category for p in evals)
    for category in CATEGORIES:
        total = sum(p.category == category for p in prompts)
        assert per_cat[category] >= 2
        assert per_cat[category] <= max(2, round(0.25 * total))
    assert 0.15 <= len(evals) / len(prompts) <= 0.25
    assert split_prompts("eval") == evals and split_prompts("train") == train
    # Mirrored two-object prompts describe the same scene, so they share a split.
    for p in evals:
        if p.category == "color_attr":
            first, second = p.text.split(" and ")
            assert f"{second} and {first}" in eval_texts


def test_split_rejects_bad_name() -> None:
    with pytest.raises(ValueError, match="train"):
        split_prompts("test")


# --------------------------------------------------------------------------- renderer


def test_render_properties(gt_images: list[tuple[ShapesPrompt, np.ndarray]]) -> None:
    palette = {(0, 0, 0), *COLORS.values()}
    for prompt, image in gt_images[:300]:
        assert image.dtype == np.uint8 and image.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
        colours = {tuple(int(v) for v in px) for px in np.unique(image.reshape(-1, 3), axis=0)}
        assert colours <= palette, "renderer must be hard-edged (palette + black only)"
        expected = sum(o.count for o in prompt.objects)
        assert len(detect(image)) == expected
    # Object size: bounding box side in [7, 10] (area bounds of the drawn masks).
    areas = [d.area for _, img in gt_images for d in detect(img)]
    assert min(areas) >= 24 and max(areas) <= 100


def test_render_deterministic_and_validates() -> None:
    p = parse_prompt("three yellow squares on the right")
    a = render(p, np.random.default_rng(7))
    b = render(p, np.random.default_rng(7))
    assert np.array_equal(a, b)
    with pytest.raises(TypeError):
        render(p, 7)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        render(p, np.random.default_rng(0), size=8)


@pytest.mark.parametrize("size", [24, 48, 64])
def test_render_other_sizes(size: int) -> None:
    rng = np.random.default_rng(0)
    for p in shapes.all_prompts()[::7]:
        image = render(p, rng, size=size)
        assert image.shape == (size, size, 3)
        assert verify(image, p).overall


def test_raw_placement_already_satisfies_verifier(prompts: list[ShapesPrompt]) -> None:
    """render() self-checks; the placement it wraps should rarely (never) need a retry."""
    rng = np.random.default_rng(123)
    ok = sum(verify(_draw(p, rng, IMAGE_SIZE), p).overall for p in prompts)
    assert ok / len(prompts) >= 0.99


# --------------------------------------------------------------------------- verifier


def test_verifier_accepts_ground_truth(gt_images: list[tuple[ShapesPrompt, np.ndarray]]) -> None:
    verdicts = [verify(img, p) for p, img in gt_images]
    rate = sum(v.overall for v in verdicts) / len(verdicts)
    print(f"verifier GT accuracy: {rate:.4f} over {len(verdicts)} images")
    assert rate >= 0.99
    for v in verdicts:
        assert set(v.constraints) == {"color", "count", "shape", "position"}


def test_verifier_robust_to_noise(gt_images: list[tuple[ShapesPrompt, np.ndarray]]) -> None:
    rng = np.random.default_rng(0)
    ok = 0
    for prompt, image in gt_images:
        noisy = image.astype(np.float64) + rng.normal(0.0, 15.0, image.shape)
        ok += verify(np.clip(noisy, 0, 255).astype(np.uint8), prompt).overall
    rate = ok / len(gt_images)
    print(f"verifier accuracy with N(0, 15) noise: {rate:.4f}")
    assert rate >= 0.95


def test_verifier_robust_to_mild_blur(gt_images: list[tuple[ShapesPrompt, np.ndarray]]) -> None:
    """Generated images are soft; a sigma=0.7 blur erodes triangle apexes but must still pass."""
    from scipy import ndimage

    ok = 0
    for prompt, image in gt_images[::2]:
        blurred = ndimage.gaussian_filter(image.astype(np.float64), sigma=(0.7, 0.7, 0))
        ok += verify(np.clip(blurred.round(), 0, 255).astype(np.uint8), prompt).overall
    rate = ok / len(gt_images[::2])
    print(f"verifier accuracy with sigma=0.7 blur: {rate:.4f}")
    assert rate >= 0.95


def test_verifier_catches_wrong_color(prompts: list[ShapesPrompt]) -> None:
    rng = np.random.default_rng(1)
    for p in (q for q in prompts if q.category in ("single_object", "counting")):
        image = render(p, rng)
        for color in COLORS:
            if color == p.objects[0].color:
                continue
            v = verify(image, _with_object(p, color=color))
            assert not v.overall and not v.constraints["color"] and not v.constraints["count"]


def test_verifier_catches_wrong_count() -> None:
    rng = np.random.default_rng(2)
    image = render(parse_prompt("two red circles"), rng)
    v = verify(image, parse_prompt("three red circles"))
    assert not v.overall and not v.constraints["count"]
    assert v.constraints["color"] and v.constraints["shape"]
    v = verify(image, parse_prompt("a red circle"))
    assert not v.overall and not v.constraints["count"]


def test_verifier_catches_wrong_shape(prompts: list[ShapesPrompt]) -> None:
    rng = np.random.default_rng(3)
    for p in (q for q in prompts if q.category in ("single_object", "counting", "position")):
        image = render(p, rng)
        for shape in SHAPES:
            if shape == p.objects[0].shape:
                continue
            v = verify(image, _with_object(p, shape=shape))
            assert not v.overall and not v.constraints["shape"], (p.text, shape)


def test_verifier_catches_wrong_position(prompts: list[ShapesPrompt]) -> None:
    rng = np.random.default_rng(4)
    opposite = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}
    for p in (q for q in prompts if q.category in ("position", "counting_position")):
        image = render(p, rng)
        pos = p.objects[0].position
        others = [opposite[pos], "center"] if pos in opposite else ["left", "right", "top"]
        for other in others:
            if other == "center" and p.objects[0].count > 1:
                continue
            v = verify(image, _with_object(p, position=other))
            assert not v.overall and not v.constraints["position"], (p.text, other)
    image = render(parse_prompt("a red circle on the left"), rng)
    assert not verify(image, parse_prompt("a red circle on the right")).constraints["position"]


def test_verifier_catches_extra_object() -> None:
    prompt = parse_prompt("a red circle on the right")
    image = render(prompt, np.random.default_rng(5))
    assert verify(image, prompt).overall
    image[0:4, 0:4] = COLORS["blue"]  # a 16 px blue blob far from the red circle
    v = verify(image, prompt)
    assert not v.overall and not v.constraints["count"]
    assert v.constraints["color"] and v.constraints["shape"] and v.constraints["position"]
    assert {d.color for d in v.detected} == {"red", "blue"}


def test_verifier_ignores_specks_and_rejects_empty(prompts: list[ShapesPrompt]) -> None:
    empty = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for p in prompts[:: len(prompts) // 20]:
        v = verify(empty, p)
        assert not v.overall and not v.constraints["color"] and v.detected == ()
    prompt = parse_prompt("a green square")
    image = render(prompt, np.random.default_rng(6))
    image[30:32, 30:32] = COLORS["yellow"]  # 4 px: below the noise floor
    assert verify(image, prompt).overall


def test_verifier_rejects_elongated_blob() -> None:
    image = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    image[10:13, 4:28] = COLORS["red"]
    v = verify(image, parse_prompt("a red square"))
    assert not v.overall and not v.constraints["shape"]
    assert v.detected[0].shape == "unknown"


def test_verifier_input_validation() -> None:
    p = parse_prompt("a red circle")
    with pytest.raises(TypeError, match="float"):
        verify(np.zeros((32, 32, 3), dtype=np.float32), p)
    with pytest.raises(ValueError, match=r"\(32, 32\)"):
        verify(np.zeros((32, 32), dtype=np.uint8), p)
    with pytest.raises(TypeError):
        verify([[0, 0, 0]], p)  # type: ignore[arg-type]


def test_position_regions_match_spec() -> None:
    assert shapes.in_region("left", 11.9, 5, 32, 32) and not shapes.in_region("left", 12, 5, 32, 32)
    assert shapes.in_region("right", 20.1, 5, 32, 32)
    assert not shapes.in_region("right", 20, 5, 32, 32)
    assert shapes.in_region("center", 12, 20, 32, 32)
    assert not shapes.in_region("center", 11.9, 16, 32, 32)
    assert shapes.in_region("bottom", 3, 20.5, 32, 32) and shapes.in_region("top", 3, 11, 32, 32)
    assert set(POSITIONS) == {"left", "right", "top", "bottom", "center"}


def test_score_batch_and_category_accuracy(prompts: list[ShapesPrompt]) -> None:
    rng = np.random.default_rng(8)
    chosen = prompts[::11]
    images = np.stack([render(p, rng) for p in chosen])
    # Blank out the first half: those must fail, the rest pass.
    half = len(chosen) // 2
    images[:half] = 0
    verdicts = score_batch(images, chosen)
    assert [v.overall for v in verdicts] == [False] * half + [True] * (len(chosen) - half)
    acc = category_accuracy(verdicts, chosen)
    assert acc["overall"] == pytest.approx((len(chosen) - half) / len(chosen))
    for category in {p.category for p in chosen}:
        members = [v for v, p in zip(verdicts, chosen, strict=True) if p.category == category]
        assert acc[category] == pytest.approx(sum(v.overall for v in members) / len(members))
    assert set(acc) == {p.category for p in chosen} | {"overall"}
    with pytest.raises(ValueError):
        score_batch(images, chosen[:-1])
    with pytest.raises(ValueError):
        score_batch(images[0], chosen[:1])
    with pytest.raises(ValueError):
        category_accuracy(verdicts, chosen[:-1])


def test_verifier_fractions_count_each_check() -> None:
    """`fractions` is 1.0 exactly where a constraint holds, and counts the checks that pass."""
    rng = np.random.default_rng(6)
    prompt = parse_prompt("three red circles")
    image = render(prompt, rng)
    v = verify(image, prompt)
    assert v.overall and v.fractions == {"color": 1.0, "count": 1.0, "shape": 1.0, "position": 1.0}
    square_off_one_blob(image, "red")  # that blob becomes a square, the other two stay right
    v = verify(image, prompt)
    assert not v.constraints["shape"] and v.fractions["shape"] == pytest.approx(2 / 3)
    assert v.constraints["count"] and v.fractions["count"] == 1.0
    # a stray blue blob breaks "no other colours", one of count's two checks for one group
    image[0:4, 0:4] = COLORS["blue"]
    v = verify(image, prompt)
    assert not v.constraints["count"] and v.fractions["count"] == 0.5
    for name, holds in v.constraints.items():
        assert holds == (v.fractions[name] == 1.0)
