"""ShapesBench as a task: compositional prompts, an exact verifier, a renderer for ground truth.

Held-out accuracy is the verifier's, per category ("eval/counting", ...), with the overall
share of samples that pass as the headline ``eval/overall``. The renderer's images are the
probe's known-good samples.

The package: ``prompts.py`` (the grammar and split), ``render.py`` (ground truth),
``verify.py`` (the exact verifier), ``tokenizer.py`` (the tiny DiT's word vocabulary),
``scorer.py`` (the ``shapes`` scorer, registered by ``diffrl.tasks``), ``bank.py`` (the
pre-training data: ground-truth banks, near-miss captions). Its base models are pre-trained by
``diffrl/pretrain/shapes.py`` (the loop; its settings are ``pretrain/common.py``'s
``PretrainConfig``, shared with AVBench), and their network, the tiny DiT, is a model family
(``models/``), below the tasks.
"""

from __future__ import annotations

import numpy as np
import torch

from diffrl.tasks.base import EvalResult, ProbeData, Prompt, TaskConfig, first_of_each_prompt
from diffrl.tasks.shapes.prompts import parse_prompt, split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.tasks.shapes.verify import category_accuracy, score_batch
from diffrl.types import Trajectory, images_from_uint8

SPLITS = {"train": "train", "test": "eval"}


class ShapesTask:
    name = "shapes"

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg

    def prompts(self, split: str) -> list[Prompt]:
        return [Prompt(p.text) for p in split_prompts(SPLITS[split])]

    async def evaluate(self, traj: Trajectory, rewards=None) -> EvalResult:
        images = traj.extra_fields["image"].numpy()
        prompts = [parse_prompt(t) for t in traj.prompts.texts]
        verdicts = score_batch(images, prompts)
        metrics = {f"eval/{k}": float(v) for k, v in category_accuracy(verdicts, prompts).items()}
        rows = first_of_each_prompt(traj)
        return EvalResult(
            metrics,
            images[rows],
            [traj.prompts.texts[i] for i in rows],
            [bool(verdicts[i].overall) for i in rows],
        )

    def probe_data(self, n: int = 16, seed: int = 0) -> ProbeData:
        rng = np.random.default_rng(seed)
        prompts = split_prompts("train")[:n]
        pixels = images_from_uint8(torch.from_numpy(np.stack([render(p, rng) for p in prompts])))
        return ProbeData(pixels, [p.text for p in prompts])


def build(cfg: TaskConfig) -> ShapesTask:
    return ShapesTask(cfg)
