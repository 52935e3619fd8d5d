"""ShapesBench's pre-training data: near-miss captions and render banks."""

from __future__ import annotations

from diffrl.tasks.shapes.bank import near_misses, render_bank
from diffrl.tasks.shapes.prompts import split_prompts


def test_near_misses_differ_in_one_word_within_the_category() -> None:
    prompt = split_prompts("train")[0]
    misses = near_misses(prompt)
    assert misses and prompt not in misses
    for q in misses:
        assert q.category == prompt.category
        a, b = prompt.text.split(), q.text.split()
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1


def test_render_bank_is_seeded_and_shaped() -> None:
    prompts = split_prompts("train")[:3]
    bank = render_bank(prompts, per_prompt=2, seed=0, workers=1, caption_noise=0.5)
    again = render_bank(prompts, per_prompt=2, seed=0, workers=1, caption_noise=0.5)
    assert bank.dtype.is_floating_point is False and bank.shape[:2] == (3, 2)
    assert bank.shape[-1] == 3 and (bank == again).all()
    assert not (bank == render_bank(prompts, per_prompt=2, seed=1, workers=1)).all()
