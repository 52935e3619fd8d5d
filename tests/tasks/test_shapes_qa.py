"""ShapesQA: every item's answer is read off its image, the words are the tiny thinker's, the
held-out images are other compositions, and the grading is exact."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from diffrl.models.families.qwen_omni import word_vocabulary
from diffrl.tasks import TaskConfig, build_task
from diffrl.tasks.shapes_qa import KINDS, ShapesQAScorer, answer, items, parse
from diffrl.types import PromptBatch, Trajectory, hash_rows, text_to_bytes


def test_items_answer_from_their_images_in_the_thinkers_words() -> None:
    vocab = set(word_vocabulary())
    for split in ("train", "test"):
        its = items(split, 32)
        answers = [answer(q, img) for q, img in its]
        assert all(answers)  # every question is one its image answers
        assert {parse(q)[0] for q, _ in its} == set(KINDS)
        words = {w for q, _ in its for w in q.split()[1:]} | set(answers)
        assert words <= vocab, words - vocab
    train = {img.tobytes() for _, img in items("train", 32)}
    assert not train & {img.tobytes() for _, img in items("test", 32)}


def _traj(questions: list[str], images: np.ndarray, texts: list[str]) -> Trajectory:
    n = len(questions)
    ids = torch.zeros(n, 1, dtype=torch.int64)
    prompts = PromptBatch(tuple(questions), ids, hash_rows(ids), torch.arange(n))
    return Trajectory(
        prompts, torch.arange(n), torch.arange(n), torch.zeros(n, 2, dtype=torch.int64),
        extra_fields={"image": torch.from_numpy(images), "text": text_to_bytes(texts)},
    )  # fmt: skip


def test_grading_is_exact() -> None:
    its = items("test", 32)[:3]
    questions, images = [q for q, _ in its], np.stack([i for _, i in its])
    right = [answer(q, i) for q, i in its]
    wrong = [{"one": "two"}.get(a, "one") for a in right]
    rows = [*right, wrong[0], f"{right[1]} {right[1]}", f" {right[2]} "]
    traj = _traj(questions * 2, np.concatenate([images, images]), rows)
    result = asyncio.run(ShapesQAScorer().score(traj))
    assert result.scores.tolist() == [1, 1, 1, 0, 0, 1] and bool(result.valid.all())
    first = asyncio.run(ShapesQAScorer(mode="first_word").score(traj))
    assert first.scores.tolist() == [1, 1, 1, 0, 1, 1]


def test_the_task_serves_each_prompts_image() -> None:
    task = build_task(TaskConfig(task="shapes_qa"))
    prompts = task.prompts("test")[:4]
    conds = task.prompt_conditions(prompts, {"size": 32})
    for p, c, (q, img) in zip(prompts, conds, items("test", 32)[:4], strict=True):
        assert p.text == q and np.array_equal(c["image"], img)
    bad = [type(prompts[0])(prompts[1].text, image=prompts[0].image)]  # a key and another text
    with pytest.raises(RuntimeError, match="not"):
        task.prompt_conditions(bad, {"size": 32})
