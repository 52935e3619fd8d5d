"""The ``Task`` protocol and the data stage every task shares.

A task owns its prompts (train and held-out splits, each prompt's conditions), its held-out
evaluator and the ground truth the time-convention probe needs. It never samples or trains: the
controller hands its evaluator a trajectory that the evaluator engine sampled.

The data stage tokenizes each split once, with the family's tokenizer (contract 3):
``PromptSet`` holds the ids, ``PromptSource`` serves each step's prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from diffrl.errors import ConfigError, check, check_choice
from diffrl.types import PromptBatch, Trajectory, hash_cond_rows


@dataclass(frozen=True)
class TaskConfig:
    task: str = "shapes"  # a registered task: shapes (ShapesBench) | prompts (a dataset dir)
    # prompts task: a directory holding train.txt|train.jsonl and test.txt|test.jsonl;
    # "builtin:<name>" is one shipped inside diffrl (diffrl/assets/prompts/<name>)
    dataset: str = "builtin:everyday"
    prompts_per_step: int = 16  # distinct prompts per RL step (each sampled G times)
    eval_samples_per_prompt: int = 2  # held-out eval: samples per eval prompt
    eval_seed: int = 1234  # fixed eval noise, so every eval sees the same initial noise
    eval_prompts: int = 0  # held-out prompts evaluated; 0 = the whole split
    # how each step's training prompts are drawn: "uniform" (every prompt alike), or "spread":
    # in proportion to how much the prompt's rewards differed within its recent groups, so
    # fewer rollouts go to prompts whose samples all pass or all fail (a group of equal rewards
    # has no advantage to learn from); the sync loop with one data-parallel rank only
    sampling: str = "uniform"
    sampling_floor: float = 0.2  # spread: this share of each draw stays uniform over all prompts

    def validate(self) -> None:
        check(bool(self.task), "task", self.task, "a registered task name")
        check(self.prompts_per_step >= 1, "prompts_per_step", self.prompts_per_step, ">= 1")
        check(
            self.eval_samples_per_prompt >= 1,
            "eval_samples_per_prompt",
            self.eval_samples_per_prompt,
            "must be >= 1",
        )
        check(self.eval_prompts >= 0, "eval_prompts", self.eval_prompts, "must be >= 0")
        check_choice("sampling", self.sampling, ("uniform", "spread"))
        check(0 < self.sampling_floor <= 1, "sampling_floor", self.sampling_floor, "in (0, 1]")

    def check_loop(self, mode: str, dp_size: int = 1) -> None:
        """``sampling=spread`` draws step k's prompts from the rewards of the steps before it,
        so each step must be scored before the next one's prompts are drawn, in one process:
        the async loop draws ahead of its scores, and data-parallel ranks would each see only
        their share of the rewards and draw differently."""
        if self.sampling == "uniform":
            return
        if mode != "sync":
            raise ConfigError(
                f"config key 'data.sampling' = {self.sampling!r}: needs run.mode=sync (the "
                "async loop draws prompts before the steps before them are scored); use "
                "data.sampling=uniform"
            )
        if dp_size > 1:
            raise ConfigError(
                f"config key 'data.sampling' = {self.sampling!r}: needs one data-parallel "
                f"rank (each of the {dp_size} would see only its share of the rewards); use "
                "data.sampling=uniform"
            )


@dataclass(frozen=True)
class Prompt:
    """One prompt and its conditions (absent conditions are empty)."""

    text: str
    negative_prompt: str = ""
    image: str = ""  # a reference image path (edit / image-to-X tasks)
    frames: tuple[str, ...] = ()  # first/last frame paths (FL2VA-style tasks)


@dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]  # "eval/overall" (the headline) plus "eval/<name>"
    images: np.ndarray  # (N, H, W, 3) uint8: one sample per held-out prompt, for the grid
    captions: list[str]  # (N,)
    ok: list[bool | None] = field(default_factory=list)  # (N,) pass/fail border; None = none
    # video+audio tasks: the same N rows as clips, {"video": (N, T, H, W, 3) uint8, "audio":
    # (N, S) float32 in [-1, 1], "fps": (N,), "sample_rate": (N,)}; None for image tasks
    clips: dict[str, np.ndarray] | None = None


@dataclass(frozen=True)
class ProbeData:
    pixels: Tensor | None  # (n, 3, H, W) in [-1, 1]: known-good samples for the prompts below
    texts: list[str]
    # video+audio tasks: known-good clips instead, (n, T, H, W, 3) uint8 and (n, samples) float,
    # for families with ``encode_clip`` (the probe then runs in the joint latent space)
    video: Tensor | None = None
    audio: Tensor | None = None


@runtime_checkable
class Task(Protocol):
    name: str

    def prompts(self, split: str) -> list[Prompt]: ...  # split: "train" | "test"

    async def evaluate(self, traj: Trajectory, rewards) -> EvalResult: ...

    def probe_data(self, n: int = 16) -> ProbeData | None: ...


@runtime_checkable
class ConditionedTask(Task, Protocol):
    """A task whose prompts may carry conditions beyond the text (FL2VA's first and last
    frames); ``needs_conditions`` says whether this instance's do."""

    needs_conditions: bool

    def prompt_conditions(self, prompts: list[Prompt], geometry: dict) -> list[dict] | None: ...


class PromptSet:
    """A fixed list of prompts with their token ids computed once (the only tokenization)."""

    def __init__(self, prompts: list[Prompt], tokenize, cond: Tensor | None = None) -> None:
        """``cond``: (N, ...) per-prompt conditions beyond the text, encoded once here beside
        the tokens (FL2VA keyframe latents; ``diffrl.build.prompt_set``)."""
        if not prompts:
            raise ValueError("a prompt set needs at least one prompt")
        self.prompts = prompts
        self.texts = tuple(p.text for p in prompts)
        tokens = tokenize(list(self.texts))
        self.input_ids, self.hashes = tokens.input_ids, tuple(tokens.hashes)  # (N, L), (N,)
        if cond is not None and cond.shape[0] != len(prompts):
            raise ValueError(f"{cond.shape[0]} conditions for {len(prompts)} prompts")
        self.cond = cond
        # hashed once, here beside the ids' hashes: every engine that receives a row re-hashes
        # it against these (contract 3)
        self.cond_hashes = None if cond is None else hash_cond_rows(cond)  # (N,)

    def __len__(self) -> int:
        return len(self.prompts)

    def batch(self, index) -> PromptBatch:
        idx = torch.as_tensor(np.asarray(index), dtype=torch.int64)
        rows = idx.tolist()
        return PromptBatch(
            texts=tuple(self.texts[i] for i in rows),
            input_ids=self.input_ids[idx],
            ids_hash=tuple(self.hashes[i] for i in rows),
            prompt_ids=idx,
            cond=None if self.cond is None else self.cond[idx],
            cond_hash=None if self.cond is None else tuple(self.cond_hashes[i] for i in rows),
        )

    def all(self) -> PromptBatch:
        return self.batch(list(range(len(self))))


class PromptSource:
    """Training prompts for step k depend only on (seed, k) and, with ``spread`` sampling, on
    the rewards of steps before k; a checkpoint holds those, so a resumed run sees exactly the
    prompts the interrupted one would have."""

    def __init__(
        self,
        prompt_set: PromptSet,
        per_step: int,
        seed: int,
        part: tuple[int, int] = (0, 1),
        sampler: SpreadSampler | None = None,
    ) -> None:
        """``part`` = (k, n): this source yields the k-th of n equal slices of each step's
        prompts (a data-parallel rank's share; ``per_step`` must be a multiple of n).
        ``sampler``: weights the draw by what earlier steps' rewards said (None: uniform)."""
        self.set, self.per_step, self.seed = prompt_set, per_step, seed
        self.part, self.sampler = part, sampler
        if per_step % part[1]:
            raise ValueError(f"{per_step} prompts per step do not split into {part[1]} slices")

    @property
    def first(self) -> int:
        """Where this source's slice starts among each step's prompts (0: all of them)."""
        k, parts = self.part
        return k * (self.per_step // parts)

    def at(self, step: int) -> PromptBatch:
        rng = np.random.default_rng([self.seed, step])
        n = len(self.set)
        p = None if self.sampler is None else self.sampler.probabilities(step)
        idx = rng.choice(n, size=self.per_step, replace=self.per_step > n, p=p)
        share = self.per_step // self.part[1]
        return self.set.batch(idx[self.first : self.first + share])

    def observe(self, step: int, prompt_ids: Tensor, rewards: Tensor, valid: Tensor) -> None:
        """Step ``step``'s scored rows (B,) each: what ``spread`` sampling learns from."""
        if self.sampler is not None:
            self.sampler.observe(step, prompt_ids, rewards, valid)

    def state_dict(self, step: int) -> dict:
        """What the draws of steps >= ``step`` depend on (JSON-able; {} for uniform)."""
        return {} if self.sampler is None else self.sampler.state_dict(step)

    def load_state_dict(self, state: dict, step: int) -> None:
        """``state`` from ``state_dict(step)``; {} (a checkpoint of a uniform run) starts the
        spread estimates afresh at ``step``."""
        if self.sampler is not None:
            self.sampler.load_state_dict(state, step)


class SpreadSampler:
    """Draws prompts in proportion to the spread (population std) of their rewards within a
    group, an estimate kept per prompt as an EMA over its visits (decay ``DECAY``): a prompt
    every sample passes, or every sample fails, gives group-normalised advantages of zero and
    so spends its rollouts on nothing. A prompt never visited counts as the most spread-out one
    seen (so each is tried early), and ``floor`` of every draw stays uniform (so none is
    starved: a solved prompt that regresses is found again).

    Determinism: ``observe(k)`` only queues step k's spreads; the draw of step s applies the
    queued steps < s, in step order. So the draw of step s depends on steps < s alone, whether
    or not step s's rollout was started early (the sync loop's prefetch), and ``state_dict(s)``
    is exactly what a resumed run needs to repeat every later draw."""

    DECAY = 0.5  # weight of a prompt's previous estimate at each new visit

    def __init__(self, n: int, floor: float) -> None:
        self.floor = floor
        self.spread = np.zeros(n)  # (N,) EMA of each prompt's within-group reward std
        self.seen = np.zeros(n, dtype=bool)  # (N,)
        self.applied = 0  # the estimates hold every observed step < applied
        self.pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # step -> (ids, spreads)

    def observe(self, step: int, prompt_ids: Tensor, rewards: Tensor, valid: Tensor) -> None:
        if step < self.applied:
            raise RuntimeError(
                f"rewards of step {step} arrived after the draw of step {self.applied} used "
                "the steps before it: spread sampling needs each step scored before the next "
                "step's prompts are drawn (run.mode=sync)"
            )
        ids, r, ok = prompt_ids.cpu().numpy(), rewards.double().cpu().numpy(), valid.cpu().numpy()
        keys, spreads = [], []
        for pid in np.unique(ids):
            mine = r[(ids == pid) & ok]
            if len(mine) >= 2:  # one valid sample says nothing about the spread
                keys.append(pid)
                spreads.append(float(mine.std()))
        self.pending[step] = (np.asarray(keys, dtype=np.int64), np.asarray(spreads))

    def _apply_before(self, step: int) -> None:
        for k in sorted(s for s in self.pending if s < step):
            ids, spreads = self.pending.pop(k)
            old = np.where(self.seen[ids], self.spread[ids], spreads)
            self.spread[ids] = self.DECAY * old + (1 - self.DECAY) * spreads
            self.seen[ids] = True
        self.applied = max(self.applied, step)

    def probabilities(self, step: int) -> np.ndarray:
        """(N,) the draw's distribution for step ``step``."""
        self._apply_before(step)
        n = len(self.spread)
        best = self.spread[self.seen].max() if self.seen.any() else 1.0
        w = np.where(self.seen, self.spread, best)
        if w.sum() <= 0:  # nothing has spread yet: uniform
            return np.full(n, 1.0 / n)
        p = (1 - self.floor) * w / w.sum() + self.floor / n
        return p / p.sum()

    def state_dict(self, step: int) -> dict:
        self._apply_before(step)
        return {"spread": self.spread.tolist(), "seen": self.seen.tolist()}

    def load_state_dict(self, state: dict, step: int) -> None:
        n = len(self.spread)
        self.applied, self.pending = step, {}
        if not state:
            return
        if len(state.get("spread", ())) != n or len(state.get("seen", ())) != n:
            raise ValueError(
                f"the checkpoint's prompt-sampling state is not for this run's {n} training "
                "prompts (another dataset?); resume with the run's own data or run.resume=false"
            )
        self.spread = np.asarray(state["spread"], dtype=float)
        self.seen = np.asarray(state["seen"], dtype=bool)


def prompt_source(
    prompt_set: PromptSet, cfg: TaskConfig, seed: int, part: tuple[int, int] = (0, 1)
) -> PromptSource:
    """The training prompts' source for ``data.sampling``."""
    sampler = None
    if cfg.sampling == "spread":
        sampler = SpreadSampler(len(prompt_set), cfg.sampling_floor)
    return PromptSource(prompt_set, cfg.prompts_per_step, seed, part, sampler)


def first_of_each_prompt(traj: Trajectory) -> np.ndarray:
    """Row indices of the first sample of every prompt (the eval grid shows one each)."""
    ids = traj.prompts.prompt_ids.tolist()
    seen, rows = set(), []
    for row, pid in enumerate(ids):
        if pid not in seen:
            seen.add(pid)
            rows.append(row)
    return np.asarray(rows, dtype=np.int64)
