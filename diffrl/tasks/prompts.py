"""A prompt-dataset task for real models: a directory of train and test prompts.

Layout (the one flow_grpo and Flow-Factory users keep)::

    my_prompts/
      train.txt | train.jsonl
      test.txt  | test.jsonl

A .txt file holds one prompt per line; a .jsonl file one object per line,
``{"prompt": ..., "negative_prompt": ..., "image": ...}`` (only "prompt" is required). Rewards come
from the configured scorers; held-out eval reports each scorer's mean on the test split
(``eval/<scorer>``) and the weighted reward's mean as ``eval/overall``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from diffrl.errors import ConfigError
from diffrl.tasks.base import EvalResult, Prompt, TaskConfig, first_of_each_prompt
from diffrl.types import Trajectory

BUILTIN = Path(__file__).resolve().parents[1] / "assets" / "prompts"
FIELDS = {"prompt", "negative_prompt", "image", "frames"}


def dataset_dir(spec: str) -> Path:
    path = BUILTIN / spec.removeprefix("builtin:") if spec.startswith("builtin:") else Path(spec)
    if not path.is_dir():
        raise ConfigError(
            f"config key 'data.dataset' = {spec!r}: no directory at {path}; expected a "
            "directory holding train.txt or train.jsonl, and test.txt or test.jsonl"
        )
    return path


def read_split(root: Path, split: str) -> list[Prompt]:
    txt, jsonl = root / f"{split}.txt", root / f"{split}.jsonl"
    if txt.exists() and jsonl.exists():
        raise ConfigError(f"{root}: both {txt.name} and {jsonl.name} exist; keep one")
    if txt.exists():
        prompts = [Prompt(ln.strip()) for ln in txt.read_text().splitlines() if ln.strip()]
    elif jsonl.exists():
        prompts = [_from_json(jsonl, i, ln) for i, ln in _lines(jsonl)]
    else:
        raise ConfigError(f"{root}: missing {split}.txt or {split}.jsonl")
    if not prompts:
        raise ConfigError(f"{root}: the {split} split holds no prompts")
    return prompts


def _lines(path: Path):
    for i, ln in enumerate(path.read_text().splitlines(), 1):
        if ln.strip():
            yield i, ln


def _from_json(path: Path, line: int, text: str) -> Prompt:
    where = f"{path}:{line}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise ConfigError(f'{where}: each line must be an object with a non-empty "prompt"')
    unknown = sorted(set(row) - FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown fields {unknown}; allowed: {sorted(FIELDS)}")
    frames = row.get("frames", [])
    return Prompt(
        row["prompt"],
        str(row.get("negative_prompt", "")),
        str(row.get("image", "")),
        tuple(frames) if isinstance(frames, list) else (str(frames),),
    )


class PromptsTask:
    name = "prompts"
    # the progress bar's name for eval/overall: here the weighted reward's mean, no accuracy
    headline = "eval_reward"

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.root = dataset_dir(cfg.dataset)
        self.splits = {s: read_split(self.root, s) for s in ("train", "test")}

    def prompts(self, split: str) -> list[Prompt]:
        return self.splits[split]

    async def evaluate(self, traj: Trajectory, rewards) -> EvalResult:
        scored, _ = await rewards.score(traj)
        metrics = {
            f"eval/{name}": float(np.nanmean(v.numpy())) if (~v.isnan()).any() else float("nan")
            for name, v in scored.per_scorer.items()
        }
        valid = scored.rewards[scored.valid]
        metrics["eval/overall"] = float(valid.mean()) if len(valid) else float("nan")
        rows = first_of_each_prompt(traj)
        images = traj.extra_fields["image"].numpy()[rows]
        captions = [
            f"{traj.prompts.texts[i]} ({float(scored.rewards[i]):.3f})"
            if scored.valid[i]
            else traj.prompts.texts[i]
            for i in rows
        ]
        return EvalResult(metrics, images, captions, [None] * len(rows))

    def probe_data(self, n: int = 16):
        return None  # no ground-truth images: the probe is skipped, and says so


def build(cfg: TaskConfig) -> PromptsTask:
    return PromptsTask(cfg)
