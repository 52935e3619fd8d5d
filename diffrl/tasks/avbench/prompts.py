"""AVBench's prompt grammar and its held-out split.

A prompt composes three attributes of one clip: the ball's colour, how many times it bounces
(each bounce is a floor contact) and the pitch band of the beep heard at each contact:

    "a <colour> ball bounces <once|twice|three times>, <low|mid|high> beeps"

4 colours x 3 counts x 3 pitch bands = 36 prompts. The test split holds out whole
combinations: every pair of attribute values (colour with count, colour with pitch, count
with pitch) still appears in at least two training prompts, so the held-out prompts test
composition, not unseen words.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from dataclasses import dataclass

COLORS: dict[str, tuple[int, int, int]] = {  # the same palette as ShapesBench
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
}
BOUNCES = (1, 2, 3)
PITCHES: dict[str, float] = {"low": 300.0, "mid": 800.0, "high": 2000.0}  # beep frequency, Hz
SPLITS = ("train", "test")

_COUNT_WORDS = {1: "once", 2: "twice", 3: "three times"}
_TEST_PROMPTS = 8  # of 36 (~22%)
_MIN_TRAIN_PER_PAIR = 2  # every attribute-value pair keeps at least this many train prompts


@dataclass(frozen=True)
class AVPrompt:
    """A prompt text with its parsed meaning."""

    text: str
    color: str  # a key of COLORS
    bounces: int  # 1..3 floor contacts, one beep each
    pitch: str  # a key of PITCHES

    @property
    def frequency(self) -> float:
        return PITCHES[self.pitch]


def make_prompt(color: str, bounces: int, pitch: str) -> AVPrompt:
    if color not in COLORS or bounces not in BOUNCES or pitch not in PITCHES:
        raise ValueError(
            f"no AVBench prompt for ({color!r}, {bounces!r}, {pitch!r}); colours "
            f"{list(COLORS)}, bounces {list(BOUNCES)}, pitches {list(PITCHES)}"
        )
    text = f"a {color} ball bounces {_COUNT_WORDS[bounces]}, {pitch} beeps"
    return AVPrompt(text, color, bounces, pitch)


@functools.lru_cache(maxsize=1)
def _all() -> tuple[AVPrompt, ...]:
    return tuple(make_prompt(c, n, p) for c, n, p in itertools.product(COLORS, BOUNCES, PITCHES))


def all_prompts() -> list[AVPrompt]:
    """Every prompt of the grammar in a fixed order (36)."""
    return list(_all())


def _pairs(p: AVPrompt) -> tuple[tuple, ...]:
    return (("cn", p.color, p.bounces), ("cp", p.color, p.pitch), ("np", p.bounces, p.pitch))


@functools.lru_cache(maxsize=1)
def _test_texts() -> frozenset[str]:
    """Greedy over a hash order (stable across Python versions and machines): hold a prompt
    out unless that would leave one of its attribute pairs with too few training prompts."""
    train_count: dict[tuple, int] = {}
    for p in _all():
        for key in _pairs(p):
            train_count[key] = train_count.get(key, 0) + 1
    order = sorted(_all(), key=lambda p: hashlib.sha256(p.text.encode()).hexdigest())
    held: set[str] = set()
    for p in order:
        if len(held) == _TEST_PROMPTS:
            break
        if all(train_count[k] > _MIN_TRAIN_PER_PAIR for k in _pairs(p)):
            held.add(p.text)
            for k in _pairs(p):
                train_count[k] -= 1
    return frozenset(held)


def split_prompts(split: str) -> list[AVPrompt]:
    """The deterministic train/test split (28/8); no combination is in both."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    held, want_test = _test_texts(), split == "test"
    return [p for p in _all() if (p.text in held) == want_test]


@functools.lru_cache(maxsize=1)
def _index() -> dict[str, AVPrompt]:
    return {p.text: p for p in _all()}


def parse_prompt(text: str) -> AVPrompt:
    """The structured prompt for a text of the grammar (a finite grammar: a lookup)."""
    try:
        return _index()[text]
    except (KeyError, TypeError):
        raise ValueError(f"prompt is outside the AVBench grammar: {text!r}") from None


def vocabulary() -> tuple[str, ...]:
    """Every word of every AVBench prompt (lowercase, punctuation split off), sorted."""
    words = {w for p in all_prompts() for w in p.text.replace(",", " , ").split()}
    return tuple(sorted(words))
