"""The shipped word lists are the task grammars' words, and the tokenizer over them gives the
ids the data stage's ShapesBench tokenizer gives (so runs reproduce digit for digit)."""

from __future__ import annotations

import pytest
import torch

from diffrl.models.words import WORDS_DIR, WordTokenizer, read_words
from diffrl.tasks.avbench.prompts import vocabulary
from diffrl.tasks.shapes.prompts import all_prompts
from diffrl.tasks.shapes.tokenizer import WordTokenizer as ShapesTokenizer


def test_shapes_words_are_the_grammars() -> None:
    assert read_words("shapes") == tuple(sorted({w for p in all_prompts() for w in p.text.split()}))


def test_avbench_words_are_the_grammars() -> None:
    assert read_words("avbench") == vocabulary()


def test_every_list_is_sorted_and_unique() -> None:
    names = sorted(p.stem for p in WORDS_DIR.glob("*.txt"))
    assert names == ["avbench", "shapes"]
    for name in names:
        words = read_words(name)
        assert list(words) == sorted(set(words)), name


def test_ids_match_the_shapes_tokenizer() -> None:
    texts = [p.text for p in all_prompts()[:64]] + [""]
    ours, theirs = WordTokenizer(read_words("shapes"), 12), ShapesTokenizer(12)
    assert ours.vocab == theirs.vocab
    assert torch.equal(ours.encode(texts), theirs.encode(texts))
    assert ours.decode(ours.encode(texts)) == [*texts[:-1], ""]


def test_unknown_list_and_word() -> None:
    with pytest.raises(ValueError, match="no word list"):
        read_words("nope")
    with pytest.raises(ValueError, match="unknown word"):
        WordTokenizer(read_words("shapes")).encode(["a purple elephant"])
