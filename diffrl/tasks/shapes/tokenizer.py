"""Word-level tokenizer for ShapesBench prompts.

The prompt language is a small closed grammar, so a fixed word vocabulary built from it is
exact, needs no download, and makes any out-of-grammar text fail loudly instead of being
silently mapped to an "unknown" token. The vocabulary is derived deterministically (sorted), so
every process that builds a ``WordTokenizer`` gets identical ids; ``hash_ids`` lets callers
verify that (e.g. trainer vs. rollout workers) instead of assuming it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.models.family import hash_rows
from diffrl.tasks.shapes.prompts import all_prompts

PAD_TOKEN = "<pad>"
NULL_TOKEN = "<null>"
SPECIAL_TOKENS = (PAD_TOKEN, NULL_TOKEN)


def _prompt_words() -> list[str]:
    return sorted({word for prompt in all_prompts() for word in prompt.text.split()})


class WordTokenizer:
    """Maps ShapesBench texts to fixed-length id rows; "" is the CFG null prompt."""

    def __init__(self, max_len: int = 12) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.vocab: tuple[str, ...] = SPECIAL_TOKENS + tuple(_prompt_words())
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
                if token is None or word in SPECIAL_TOKENS:
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


def hash_ids(ids: torch.Tensor) -> list[str]:
    """Per-row stable fingerprint of token ids (``diffrl.models.family.hash_rows``, the one
    the token-drift check uses)."""
    return list(hash_rows(ids))
