"""ShapesBench as a task: its splits, verifier-based held-out eval and the probe's ground truth."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from diffrl.tasks import Prompt, PromptSet, TaskConfig, build_task
from diffrl.tasks.shapes.prompts import CATEGORIES, parse_prompt, split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.types import Trajectory, images_to_uint8


@pytest.fixture(scope="module")
def task():
    return build_task(TaskConfig(task="shapes"))


def test_splits_are_shapesbench_train_and_eval(task) -> None:
    assert task.name == "shapes"
    assert task.prompts("train") == [Prompt(p.text) for p in split_prompts("train")]
    assert task.prompts("test") == [Prompt(p.text) for p in split_prompts("eval")]
    assert not {p.text for p in task.prompts("train")} & {p.text for p in task.prompts("test")}


def test_evaluate_scores_with_the_verifier_per_category(task, tiny_model) -> None:
    """Two samples per prompt: the first a ground-truth render (passes), the second blank
    (fails); the grid shows the first sample of each prompt with its verdict."""
    prompts = task.prompts("test")[:4]
    g, rng = 2, np.random.default_rng(0)
    batch = PromptSet(prompts, tiny_model.family.tokenize).all().repeat(g)
    images = np.stack(
        [
            render(parse_prompt(t), rng) if i % g == 0 else np.zeros((32, 32, 3), np.uint8)
            for i, t in enumerate(batch.texts)
        ]
    )
    n = len(batch)
    traj = Trajectory(
        prompts=batch,
        group=torch.arange(len(prompts)).repeat_interleave(g),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 3, 32, 32),
        extra_fields={"image": torch.from_numpy(images)},
    )
    result = asyncio.run(task.evaluate(traj, rewards=None))
    assert result.metrics["eval/overall"] == pytest.approx(0.5)
    cats = {parse_prompt(p.text).category for p in prompts}
    assert set(result.metrics) == {"eval/overall"} | {f"eval/{c}" for c in cats}
    assert all(c in CATEGORIES for c in cats)
    assert all(v == pytest.approx(0.5) for v in result.metrics.values())
    assert result.captions == [p.text for p in prompts]
    assert result.ok == [True] * 4
    np.testing.assert_array_equal(result.images, images[::g])


def test_probe_data_are_renders_of_train_prompts(task) -> None:
    data = task.probe_data(n=3)
    assert data.texts == [p.text for p in split_prompts("train")[:3]]
    assert data.pixels.shape == (3, 3, 32, 32)
    assert data.pixels.min() >= -1 and data.pixels.max() <= 1
    again = task.probe_data(n=3)  # fixed seed: the same ground truth every start-up
    torch.testing.assert_close(again.pixels, data.pixels)
    expected = render(split_prompts("train")[0], np.random.default_rng(0))
    np.testing.assert_array_equal(images_to_uint8(data.pixels[:1])[0].numpy(), expected)
