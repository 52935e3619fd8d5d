"""The data stage: prompt sets, tokenized once, served as ``PromptBatch`` records."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffrl.data.shapes import ShapesPrompt, split_prompts
from diffrl.data.tokenizer import WordTokenizer, hash_ids
from diffrl.errors import check, check_choice
from diffrl.types import PromptBatch


@dataclass(frozen=True)
class DataConfig:
    task: str = "shapes"  # built-in task (ShapesBench)
    prompts_per_step: int = 16  # distinct prompts per RL step (each sampled G times)
    eval_samples_per_prompt: int = 2  # held-out eval: samples per eval prompt
    eval_seed: int = 1234  # fixed eval noise, so every eval sees the same initial noise

    def validate(self) -> None:
        check_choice("task", self.task, ("shapes",))
        check(self.prompts_per_step >= 1, "prompts_per_step", self.prompts_per_step, "must be >= 1")
        check(
            self.eval_samples_per_prompt >= 1,
            "eval_samples_per_prompt",
            self.eval_samples_per_prompt,
            "must be >= 1",
        )


class PromptSet:
    """A fixed list of prompts with their token ids computed once."""

    def __init__(self, prompts: list[ShapesPrompt], tokenizer: WordTokenizer) -> None:
        self.prompts = prompts
        self.texts = tuple(p.text for p in prompts)
        self.input_ids = tokenizer.encode(list(self.texts))  # (N, L), the only tokenization
        self.hashes = tuple(hash_ids(self.input_ids))

    def __len__(self) -> int:
        return len(self.prompts)

    def batch(self, index: list[int] | np.ndarray) -> PromptBatch:
        idx = torch.as_tensor(np.asarray(index), dtype=torch.int64)
        return PromptBatch(
            texts=tuple(self.texts[i] for i in idx.tolist()),
            input_ids=self.input_ids[idx],
            ids_hash=tuple(self.hashes[i] for i in idx),
            prompt_ids=idx,
        )

    def all(self) -> PromptBatch:
        return self.batch(list(range(len(self))))


class PromptSource:
    """Training prompts for step k depend only on (seed, k), so a resumed run sees exactly
    the prompts the interrupted one would have."""

    def __init__(self, prompt_set: PromptSet, per_step: int, seed: int) -> None:
        self.set, self.per_step, self.seed = prompt_set, per_step, seed

    def at(self, step: int) -> PromptBatch:
        rng = np.random.default_rng([self.seed, step])
        n = len(self.set)
        idx = rng.choice(n, size=self.per_step, replace=self.per_step > n)
        return self.set.batch(idx)


def build_data(cfg: DataConfig, seed: int) -> tuple[WordTokenizer, PromptSource, PromptSet]:
    tok = WordTokenizer()
    train = PromptSet(split_prompts("train"), tok)
    evals = PromptSet(split_prompts("eval"), tok)
    return tok, PromptSource(train, cfg.prompts_per_step, seed), evals
