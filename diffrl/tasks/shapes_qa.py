"""ShapesQA: questions about rendered ShapesBench images, graded exactly; the task of an
autoregressive omni family (``models/families/qwen_omni.py``).

Each ShapesBench prompt of a split is rendered once (``tasks/shapes/render.py``, seeded), and
asked what its image alone answers:

    "<image> how many shapes are there ?"    -> one | two | three
    "<image> what colour is the circle ?"    -> red | green | blue | yellow   (one circle)
    "<image> what shape is the red one ?"    -> circle | square | triangle    (one red object)

The answer is read off the image by ShapesBench's verifier (``verify.detect``: colour
segmentation and shape tests, exact on renders), never stored beside the question, so the
``shapes_qa`` scorer grades any (question, image, answer) it is handed: the image rides in
the trajectory (``extra_fields["image"]``, the prompt's condition) with the answer's text
(``extra_fields["text"]``). A completion is right when its words are exactly the answer.

Held-out: the images of ShapesBench's eval prompts (compositions never seen in training).
Metrics: ``eval/overall`` (the share answered right) and one per question kind.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re

import numpy as np
import torch

from diffrl.errors import check_choice
from diffrl.models.family import IMAGE_MARKER
from diffrl.reward.scorer import ScoreResult
from diffrl.tasks.base import EvalResult, Prompt, TaskConfig, first_of_each_prompt
from diffrl.tasks.shapes.prompts import COLORS, SHAPES, ShapesPrompt, split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.tasks.shapes.verify import detect
from diffrl.types import Trajectory, bytes_to_text

SPLITS = {"train": "train", "test": "eval"}
NUMBERS = {1: "one", 2: "two", 3: "three"}
KINDS = ("count", "colour", "shape")  # in the order of the questions below
COUNT_Q = f"{IMAGE_MARKER} how many shapes are there ?"
COLOUR_Q = IMAGE_MARKER + " what colour is the {} ?"
SHAPE_Q = IMAGE_MARKER + " what shape is the {} one ?"
_PARSE = [
    ("count", re.compile(r"how many shapes are there \?$")),
    ("colour", re.compile(r"what colour is the (\w+) \?$")),
    ("shape", re.compile(r"what shape is the (\w+) one \?$")),
]


def answer(question: str, image: np.ndarray) -> str:
    """What ``image`` ((H, W, 3) uint8) answers to ``question``; "" when it does not (no
    object of that shape or colour, or several)."""
    kind, subject = parse(question)
    found = detect(np.ascontiguousarray(image))
    if kind == "count":
        return NUMBERS.get(len(found), "")
    if kind == "colour":
        match = [d.color for d in found if d.shape == subject]
    else:
        match = [d.shape for d in found if d.color == subject]
    return match[0] if len(match) == 1 else ""


def parse(question: str) -> tuple[str, str]:
    """(kind, its subject: a shape, a colour, or "") of a ShapesQA question."""
    for kind, pattern in _PARSE:
        m = pattern.search(question)
        if m:
            return kind, (m.group(1) if m.groups() else "")
    raise ValueError(f"not a ShapesQA question: {question!r}")


def questions(prompt: ShapesPrompt) -> list[str]:
    """Every question a render of ``prompt`` answers (the renderer draws exactly its objects,
    checked by the verifier): the count, the colour of each shape it holds once, the shape of
    each colour it holds once."""
    objects = [o for o in prompt.objects for _ in range(o.count)]
    out = [COUNT_Q]
    shapes = [o.shape for o in objects]
    colours = [o.color for o in objects]
    out += [COLOUR_Q.format(s) for s in SHAPES if shapes.count(s) == 1]
    out += [SHAPE_Q.format(c) for c in COLORS if colours.count(c) == 1]
    return out


@functools.cache
def items(split: str, size: int) -> tuple[tuple[str, np.ndarray], ...]:
    """The split's (question, image) items at ``size`` px, in a fixed shuffled order (so a
    prefix, ``data.eval_prompts``, holds every kind)."""
    out = []
    for p in split_prompts(SPLITS[split]):
        seed = int.from_bytes(hashlib.sha256(p.text.encode()).digest()[:4], "little")
        image = render(p, np.random.default_rng(seed), size)
        image.setflags(write=False)
        out += [(q, image) for q in questions(p)]
    order = np.random.default_rng(0).permutation(len(out))
    return tuple(out[i] for i in order)


def grade(texts: list[str], questions_: tuple[str, ...], images: np.ndarray) -> list[bool]:
    """Whether each answer's words are exactly what its image answers to its question."""
    return [
        " ".join(t.split()) == answer(q, img) != ""
        for t, q, img in zip(texts, questions_, images, strict=True)
    ]


class ShapesQATask:
    name = "shapes_qa"
    needs_conditions = True  # each prompt's image

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg

    def prompts(self, split: str) -> list[Prompt]:
        """One prompt per (question, image) item; ``image`` is the item's key (the task
        renders it in ``prompt_conditions``)."""
        n = len(items(split, 32))
        return [Prompt(items(split, 32)[i][0], image=f"{split}/{i}") for i in range(n)]

    def prompt_conditions(self, prompts: list[Prompt], geometry: dict) -> list[dict]:
        size = int(geometry["size"])
        out = []
        for p in prompts:
            split, index = p.image.split("/")
            question, image = items(split, size)[int(index)]
            if question != p.text:  # the item order is fixed: this is a bug, not a config
                raise RuntimeError(f"ShapesQA item {p.image} is {question!r}, not {p.text!r}")
            out.append({"image": np.array(image)})
        return out

    async def evaluate(self, traj: Trajectory, rewards=None) -> EvalResult:
        images = traj.extra_fields["image"].numpy()
        texts = bytes_to_text(traj.extra_fields["text"])
        right = await asyncio.to_thread(grade, texts, traj.prompts.texts, images)
        kinds = [parse(q)[0] for q in traj.prompts.texts]
        metrics = {"eval/overall": float(np.mean(right))}
        for kind in KINDS:
            mine = [r for r, k in zip(right, kinds, strict=True) if k == kind]
            if mine:
                metrics[f"eval/{kind}"] = float(np.mean(mine))
        rows = first_of_each_prompt(traj)
        captions = [
            f"{traj.prompts.texts[i].replace(IMAGE_MARKER, '').strip()} {texts[i]!r}" for i in rows
        ]
        return EvalResult(metrics, images[rows], captions, [right[i] for i in rows])

    def probe_data(self, n: int = 16):
        return None  # contract 1's probe is for diffusion families; an AR family has none


class ShapesQAScorer:
    """The ``shapes_qa`` scorer: 1 when the answer's words are exactly what the image answers
    to the question, else 0 (``mode=exact``); ``mode=first_word`` grades the first word only
    (a denser signal for a base that has not learnt to stop)."""

    needs = frozenset({"text", "image"})

    def __init__(self, mode: str = "exact") -> None:
        check_choice("mode", mode, ("exact", "first_word"))
        self.name, self.mode = "shapes_qa", mode

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    def score_sync(self, traj: Trajectory) -> ScoreResult:
        texts = bytes_to_text(traj.extra_fields["text"])
        if self.mode == "first_word":
            texts = [t.split()[0] if t.split() else "" for t in texts]
        right = grade(texts, traj.prompts.texts, traj.extra_fields["image"].numpy())
        scores = torch.tensor(right, dtype=torch.float32)
        ok = torch.ones(len(scores), dtype=torch.bool)
        return ScoreResult(scores, ok, {"accuracy": float(scores.mean())})


def build(cfg: TaskConfig) -> ShapesQATask:
    return ShapesQATask(cfg)
