"""Word vocabularies shipped as data, and the word-level tokenizer the built-in models use.

A built-in task's prompts come from a small closed grammar, so a fixed word list is an exact
vocabulary: it needs no download, and text outside the grammar fails loudly instead of mapping
to an "unknown" token. The lists live in ``diffrl/assets/words/<name>.txt``, one word a line,
sorted: a model reads the words as data and never imports the task that produced them
(``tests/models/test_words.py`` checks each file against its task's grammar). Ids are the
special tokens first, then the words in file order, so every process gets the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

WORDS_DIR = Path(__file__).resolve().parents[1] / "assets" / "words"
PAD_TOKEN = "<pad>"
NULL_TOKEN = "<null>"


@cache
def read_words(name: str) -> tuple[str, ...]:
    """The word list ``name`` ("shapes", "avbench"), as shipped."""
    path = WORDS_DIR / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in WORDS_DIR.glob("*.txt"))
        raise ValueError(f"no word list {name!r} at {path}; known: {known}")
    return tuple(path.read_text().split())


class WordTokenizer:
    """Fixed-length id rows over a word list: ``<pad>`` is 0, ``<null>`` (the CFG null prompt,
    what "" encodes to) is 1, then the words in order."""

    def __init__(self, words: Sequence[str], max_len: int = 12) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.specials = (PAD_TOKEN, NULL_TOKEN)
        self.vocab: tuple[str, ...] = self.specials + tuple(words)
        self._ids = {token: i for i, token in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        """Number of ids, i.e. the size the text-embedding table must have."""
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        """Id used for right padding (0); models should mask it out."""
        return self._ids[PAD_TOKEN]

    @property
    def null_id(self) -> int:
        """Id of the unconditional prompt used for classifier-free guidance (1)."""
        return self._ids[NULL_TOKEN]

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Encode texts to a (B, max_len) int64 tensor, right-padded with ``pad_id``.

        An empty (or all-whitespace) text becomes a single ``<null>`` token so the
        unconditional branch of CFG has a real token to attend to.
        """
        if isinstance(texts, str):
            raise TypeError("encode expects a list of texts, got a single str")
        out = torch.full((len(texts), self.max_len), self.pad_id, dtype=torch.long)
        for row, text in enumerate(texts):
            words = text.split()
            if not words:
                out[row, 0] = self.null_id
                continue
            if len(words) > self.max_len:
                raise ValueError(
                    f"text has {len(words)} words but max_len is {self.max_len}: {text!r}"
                )
            for col, word in enumerate(words):
                token = self._ids.get(word)
                if token is None or word in self.specials:
                    raise ValueError(f"unknown word {word!r} in text {text!r}")
                out[row, col] = token
        return out

    def decode(self, ids: torch.Tensor | Sequence[Sequence[int]]) -> list[str]:
        """Turn id rows back into texts (padding dropped, ``<null>`` -> ""); for display."""
        rows = torch.as_tensor(ids, dtype=torch.long)
        if rows.ndim == 1:
            rows = rows[None]
        if rows.ndim != 2:
            raise ValueError(f"ids must have shape (B, L) or (L,), got {tuple(rows.shape)}")
        texts = []
        for row in rows.tolist():
            words = []
            for token in row:
                if not 0 <= token < self.vocab_size:
                    raise ValueError(
                        f"id {token} is outside the vocabulary (0..{self.vocab_size - 1})"
                    )
                if token not in (self.pad_id, self.null_id):
                    words.append(self.vocab[token])
            texts.append(" ".join(words))
        return texts
