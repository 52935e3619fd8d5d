"""Tests for the ShapesBench word tokenizer and the token-drift hash."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from diffrl.tasks.shapes.prompts import all_prompts
from diffrl.tasks.shapes.tokenizer import WordTokenizer, hash_ids


@pytest.fixture(scope="module")
def tok() -> WordTokenizer:
    return WordTokenizer()


def test_vocab_layout(tok: WordTokenizer) -> None:
    assert tok.pad_id == 0 and tok.null_id == 1
    assert tok.vocab[:2] == ("<pad>", "<null>")
    words = list(tok.vocab[2:])
    assert words == sorted(words) and len(set(words)) == len(words)
    expected = {w for p in all_prompts() for w in p.text.split()}
    assert set(words) == expected
    assert {"a", "two", "three", "circles", "center", "and", "yellow"} <= expected
    assert tok.vocab_size == len(tok.vocab) == 2 + len(expected)
    assert WordTokenizer().vocab == tok.vocab  # deterministic across instances


def test_round_trip_all_prompts(tok: WordTokenizer) -> None:
    texts = [p.text for p in all_prompts()]
    ids = tok.encode(texts)
    assert ids.dtype == torch.long and ids.shape == (len(texts), 12)
    assert tok.decode(ids) == texts
    assert tok.decode(ids[0]) == texts[:1]  # a single row is accepted too


def test_padding(tok: WordTokenizer) -> None:
    ids = tok.encode(["a red circle", "two blue squares on the left"])
    assert ids[0, :3].ne(tok.pad_id).all() and ids[0, 3:].eq(tok.pad_id).all()
    assert ids[1, :6].ne(tok.pad_id).all() and ids[1, 6:].eq(tok.pad_id).all()
    assert tok.vocab[int(ids[0, 1])] == "red"
    short = WordTokenizer(max_len=7).encode(["a red circle and a blue square"])
    assert short.shape == (1, 7) and short.ne(0).all()


def test_empty_string_is_null(tok: WordTokenizer) -> None:
    ids = tok.encode(["", "a red circle", "   "])
    assert ids[0].tolist() == [tok.null_id] + [tok.pad_id] * 11
    assert ids[2].tolist() == ids[0].tolist()
    assert tok.decode(ids) == ["", "a red circle", ""]
    assert tok.encode([]).shape == (0, 12)


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("a purple circle", "purple"),
        ("a Red circle", "Red"),
        ("a red circle.", "circle."),
        ("<null>", "<null>"),
        ("a <pad> circle", "<pad>"),
    ],
)
def test_unknown_word(tok: WordTokenizer, text: str, bad: str) -> None:
    with pytest.raises(ValueError) as err:
        tok.encode(["a red circle", text])
    assert repr(bad) in str(err.value) and repr(text) in str(err.value)


def test_too_long(tok: WordTokenizer) -> None:
    with pytest.raises(ValueError, match="13 words.*max_len is 12"):
        tok.encode([" ".join(["red"] * 13)])
    with pytest.raises(ValueError, match="max_len"):
        WordTokenizer(max_len=0)


def test_input_validation(tok: WordTokenizer) -> None:
    with pytest.raises(TypeError):
        tok.encode("a red circle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode(torch.tensor([[tok.vocab_size]]))


def test_hash_ids_stable_and_discriminative(tok: WordTokenizer) -> None:
    texts = [p.text for p in all_prompts()] + [""]
    ids = tok.encode(texts)
    hashes = hash_ids(ids)
    assert len(hashes) == len(texts) and len(set(hashes)) == len(texts)
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in hashes)
    # Same ids -> same hash regardless of dtype, layout or a fresh tokenizer instance.
    assert hash_ids(WordTokenizer().encode(texts)) == hashes
    assert hash_ids(ids.to(torch.int32)) == hashes
    assert hash_ids(ids.t().contiguous().t()) == hashes
    # Pinned value: changes to vocabulary order or max_len must show up as drift here.
    row = tok.encode(["a red circle"])
    assert row[0, :4].tolist() == [2, 13, 7, 0]
    digest = hashlib.sha256(struct.pack("<12q", 2, 13, 7, *[0] * 9)).hexdigest()[:16]
    assert hash_ids(row) == [digest] == ["f942091c15475f69"]
    # Any changed id changes the hash.
    flipped = ids[:1].clone()
    flipped[0, -1] = 1
    assert hash_ids(flipped) != hashes[:1]


def test_hash_ids_validation() -> None:
    with pytest.raises(ValueError):
        hash_ids(torch.zeros(12, dtype=torch.long))
    with pytest.raises(TypeError):
        hash_ids(torch.zeros(1, 12))
    with pytest.raises(TypeError):
        hash_ids([[0, 1]])  # type: ignore[arg-type]
