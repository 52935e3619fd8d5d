"""ShapesBench's word-level tokenizer: the generic one (``models/words.py``) over the words of
the task's grammar.

The prompt language is a small closed grammar, so its sorted word set is an exact vocabulary:
no download, and out-of-grammar text fails loudly instead of mapping to an "unknown" token. The
tiny DiT family reads the same words from the shipped list (``assets/words/shapes.txt``) rather
than importing this task; ``tests/models/test_words.py`` checks the two agree id for id.
"""

from __future__ import annotations

import torch

from diffrl.models.family import hash_rows
from diffrl.models.words import WordTokenizer as _WordTokenizer
from diffrl.tasks.shapes.prompts import all_prompts


def prompt_words() -> tuple[str, ...]:
    """Every word the grammar can produce, sorted."""
    return tuple(sorted({word for prompt in all_prompts() for word in prompt.text.split()}))


class WordTokenizer(_WordTokenizer):
    """Maps ShapesBench texts to fixed-length id rows; "" is the CFG null prompt."""

    def __init__(self, max_len: int = 12) -> None:
        super().__init__(prompt_words(), max_len)


def hash_ids(ids: torch.Tensor) -> list[str]:
    """Per-row stable fingerprint of token ids (``diffrl.models.family.hash_rows``, the one
    the token-drift check uses)."""
    return list(hash_rows(ids))
