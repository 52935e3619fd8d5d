"""The scorer pool: runs every scorer concurrently on a trajectory and combines them.

Combined reward = sum_k weight_k * score_k over valid samples (``reward.aggregate=sum``), or
GDPO's sum of group-normalised scores (``gdpo``, reward/aggregate.py). A ``required`` scorer
that raises stops training with its error; an optional one that raises (or returns NaN) marks
its samples missing (``valid=False``) so they are excluded from advantages, never scored 0.

A group scorer (``GroupScorer``) is called once per group of the trajectory (all G samples of
one prompt), the groups concurrently; one that fails fails its group: a required one stops
training naming the group's prompt, an optional one marks that group's samples missing. The
pool is ``groupwise`` when it has a group scorer or aggregates with gdpo: it must then be
handed whole groups (reward/edges.py cuts its pool calls at group boundaries).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from diffrl.errors import DiffrlError, check, check_choice
from diffrl.reward.aggregate import AGGREGATES, gdpo_combine
from diffrl.reward.scorer import (
    REWARD_MODALITIES,
    GroupScorer,
    Scorer,
    ScoreResult,
    check_fields,
    is_group_scorer,
    missing_fields,
    producers_of,
)
from diffrl.reward.scorers import build_scorer
from diffrl.types import MODALITIES, ScoredBatch, Trajectory, select_rows

log = logging.getLogger(__name__)


# the largest |weight| a scorer may have: combined rewards are float32 (max ~3.4e38), so a weight
# this size still leaves scores up to ~1e32 finite, and no real mix of rewards needs more
MAX_WEIGHT = 1e6


@dataclass(frozen=True)
class ScorerConfig:
    name: str = "shapes"
    weight: float = 1.0
    required: bool = True  # failure stops training; else its samples are marked missing
    params: dict[str, Any] = field(default_factory=dict)  # passed to the scorer's constructor
    label: str = ""  # name in metrics/logs; set it to use one scorer type twice (two servers)
    # what the score grades, for algorithm.modality_credit: video | audio | joint (both, shared
    # by both) | auto (the scorer's own split where it returns one, as AVBench's verifiers do,
    # else the scorer's ``modality`` attribute, else joint). Read only under modality credit
    modality: str = "auto"

    @property
    def key(self) -> str:
        return self.label or self.name

    def validate(self) -> None:
        check(bool(self.name), "name", self.name, "a registered scorer name")
        check_choice("modality", self.modality, ("auto", *REWARD_MODALITIES))
        check(
            math.isfinite(self.weight) and abs(self.weight) <= MAX_WEIGHT,
            "weight",
            self.weight,
            f"must be a finite number with |weight| <= {MAX_WEIGHT:g} (an infinite or huge "
            "weight turns every combined reward into inf or NaN: nothing is trained)",
        )


@dataclass(frozen=True)
class RewardConfig:
    scorers: list[ScorerConfig] = field(default_factory=lambda: [ScorerConfig()])
    # an optional scorer that fails for every sample this many RL steps running stops the run
    # (a dead reward server would otherwise let it "succeed" while training on nothing)
    max_dead_steps: int = 3
    # rows per pool call (reward/edges.py): the ready rows of one rollout micro-batch, at most
    # this many (0 = all of them); a cap below the micro-batch starts scoring on its first rows
    max_batch: int = 0
    # how the scorers' scores become one reward: sum (sum_k weight_k * score_k) or gdpo (each
    # score normalised within its group first, then weighted and summed: reward/aggregate.py)
    aggregate: str = "sum"

    def validate(self) -> None:
        check_choice("aggregate", self.aggregate, AGGREGATES)
        check(len(self.scorers) > 0, "scorers", self.scorers, "at least one scorer")
        check(
            any(s.weight != 0 for s in self.scorers),
            "scorers",
            [f"{s.key}: weight {s.weight:g}" for s in self.scorers],
            "at least one scorer needs a non-zero weight (with all at 0 every reward is 0 and "
            "nothing is trained)",
        )
        check(self.max_dead_steps >= 1, "max_dead_steps", self.max_dead_steps, "must be >= 1")
        check(self.max_batch >= 0, "max_batch", self.max_batch, "must be >= 0 (0 = no cap)")
        names = [s.key for s in self.scorers]
        check(
            len(set(names)) == len(names),
            "scorers",
            names,
            "scorer names must be unique (give repeated scorers a distinct 'label')",
        )


class RewardFailure(DiffrlError):
    """A required scorer failed; training stops with this error."""


class RewardPool:
    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.scorers: list[tuple[ScorerConfig, Scorer | GroupScorer]] = []
        for i, sc in enumerate(cfg.scorers):
            try:
                self.scorers.append((sc, build_scorer(sc.name, sc.params)))
            except (KeyError, ValueError, OSError) as e:  # OSError: a local weights path
                raise DiffrlError(f"reward.scorers[{i}] ({sc.key}): {e}") from None
            declared = getattr(self.scorers[-1][1], "modality", "joint")
            if declared not in REWARD_MODALITIES:
                raise DiffrlError(
                    f"reward.scorers: scorer {sc.key!r} declares modality {declared!r}; a "
                    f"scorer's modality attribute is one of {list(REWARD_MODALITIES)}"
                )
            if cfg.aggregate == "gdpo" and sc.modality not in ("auto", "joint"):
                raise DiffrlError(
                    f"reward.scorers: scorer {sc.key!r} has modality {sc.modality!r}, but "
                    "reward.aggregate=gdpo normalises each score as a whole (joint); use "
                    "aggregate=sum for per-modality credit"
                )
        self.dead_steps = {sc.key: 0 for sc in cfg.scorers}  # consecutive all-missing steps
        # whole groups per call: a group scorer needs all its group's samples, and gdpo the
        # group's statistics (edges.score_ready reads this)
        self.groupwise = cfg.aggregate == "gdpo" or any(is_group_scorer(s) for _, s in self.scorers)

    def observe_step(self, scored: ScoredBatch) -> None:
        """After each RL step's scoring: count, per scorer, the steps running in which it gave
        no valid score at all, and stop the run once one reaches ``max_dead_steps``."""
        for key, scores in scored.per_scorer.items():
            dead = not bool(torch.isfinite(scores).any())
            self.dead_steps[key] = self.dead_steps[key] + 1 if dead else 0
            if self.dead_steps[key] >= self.cfg.max_dead_steps:
                raise RewardFailure(
                    f"optional scorer {key!r} failed for every sample {self.dead_steps[key]} "
                    "steps running (reward.max_dead_steps): nothing is being trained; fix the "
                    "scorer (or its server) and resume from the last checkpoint"
                )

    def check_inputs(self, produced: set[str]) -> None:
        """Start-up check: every scorer's declared inputs are produced by the rollout."""
        for _, scorer in self.scorers:
            missing = missing_fields(scorer.needs, produced)
            if missing:
                raise DiffrlError(
                    f"scorer {scorer.name!r} needs {missing}, which the rollout does not "
                    f"produce ({producers_of(missing)}, for a model family that outputs it; "
                    f"this run's family produces {sorted(produced)})"
                )

    async def _run(self, sc: ScorerConfig, scorer: Scorer | GroupScorer, traj: Trajectory):
        if is_group_scorer(scorer):
            return await self._run_groups(sc, scorer, traj)  # type: ignore[arg-type]
        try:
            check_fields(scorer, traj)
            result = await scorer.score(traj)  # type: ignore[union-attr]
            if result.scores.shape != (len(traj),):
                raise ValueError(
                    f"returned {tuple(result.scores.shape)} scores for {len(traj)} samples"
                )
            return result
        except Exception as e:
            return self._failed(sc, e)

    def _failed(self, sc: ScorerConfig, e: Exception) -> Exception:
        """A scorer's error: a required one's stops training, an optional one's is returned
        (its samples are marked missing)."""
        if sc.required:
            raise RewardFailure(f"required scorer {sc.key!r} failed: {e}") from e
        log.warning("optional scorer %r failed, its samples are marked missing: %s", sc.key, e)
        return e

    async def _run_groups(
        self, sc: ScorerConfig, scorer: GroupScorer, traj: Trajectory
    ) -> ScoreResult | Exception:
        """``scorer`` on each group of ``traj`` (concurrently), joined back into (B,) rows. A
        group whose call fails, or returns the wrong shape, is missing (a required scorer
        stops training, naming the group); when every group fails the scorer has failed."""
        try:
            check_fields(scorer, traj)
        except KeyError as e:
            return self._failed(sc, e)
        ids = list(dict.fromkeys(traj.group.tolist()))  # groups in row order
        rows = [torch.nonzero(traj.group == g).flatten() for g in ids]

        async def one(idx: Tensor) -> ScoreResult:
            result = await scorer.score_group(select_rows(traj, idx))
            if result.scores.shape != (len(idx),):
                raise ValueError(
                    f"returned {tuple(result.scores.shape)} scores for a group of {len(idx)}"
                )
            return result

        results = await asyncio.gather(*(one(idx) for idx in rows), return_exceptions=True)
        n = len(traj)
        scores, valid = torch.full((n,), float("nan")), torch.zeros(n, dtype=torch.bool)
        scored = torch.zeros(n, dtype=torch.bool)  # rows whose group's call returned
        sums: dict[str, float] = {}
        failed: list[str] = []
        for g, idx, res in zip(ids, rows, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res  # cancellation, KeyboardInterrupt: not the scorer's failure
                prompt = traj.prompts.texts[int(idx[0])]
                why = f"group {g} ({len(idx)} samples of {prompt!r}): {res}"
                if sc.required:
                    raise RewardFailure(
                        f"required group scorer {sc.key!r} failed on {why}"
                    ) from res
                failed.append(why)
                continue
            scores[idx], scored[idx] = res.scores.float(), True
            valid[idx] = res.valid
            for k, v in res.metrics.items():  # group metrics, weighted by the group's rows
                sums[k] = sums.get(k, 0.0) + v * len(idx)
        if failed and len(failed) == len(ids):
            return self._failed(sc, RuntimeError(f"every group failed; the first, {failed[0]}"))
        for why in failed[:3]:
            log.warning("optional group scorer %r: its samples are marked missing: %s", sc.key, why)
        done = int(scored.sum()) or 1  # the weight of the returned groups' metrics
        metrics = {k: v / done for k, v in sums.items()}
        metrics["failed_groups"] = len(failed) / max(len(ids), 1)
        return ScoreResult(scores, valid & torch.isfinite(scores), metrics)

    async def score(self, traj: Trajectory) -> tuple[ScoredBatch, dict[str, float]]:
        """Consumes one trajectory; waits for every scorer; returns rewards and metrics."""
        results = await asyncio.gather(*(self._run(sc, s, traj) for sc, s in self.scorers))
        n = len(traj)
        total = torch.zeros(n)
        valid = torch.ones(n, dtype=torch.bool)
        per_scorer, metrics = {}, {}
        by_modality = {m: torch.zeros(n) for m in REWARD_MODALITIES}
        for (sc, scorer), res in zip(self.scorers, results, strict=True):
            overflow = ""  # for the error: a score the cast (or the weight) made inf
            if isinstance(res, Exception):
                scores, ok = torch.full((n,), float("nan")), torch.zeros(n, dtype=torch.bool)
                metrics[f"reward/{sc.key}/failed"] = 1.0
            else:
                # finite as the float32 reward it becomes, weighted: a float64 score of 1e300
                # is finite until it is summed into ``total``, and then inf
                ok = res.valid & finite_as(res.scores, total.dtype, sc.weight)
                overflow = _overflow(res.scores, res.valid & ~ok, sc.weight, total.dtype)
                scores = torch.where(ok, res.scores, torch.full_like(res.scores, float("nan")))
                for k, v in res.metrics.items():
                    metrics[f"reward/{sc.key}/{k}"] = v
            if sc.required and not bool(ok.all()):
                raise RewardFailure(
                    f"required scorer {sc.key!r} returned {int((~ok).sum())} missing/NaN "
                    f"scores{overflow}"
                )
            per_scorer[sc.key] = scores
            valid &= ok
            total += sc.weight * torch.nan_to_num(scores, nan=0.0)  # masked by `valid` below
            if not isinstance(res, Exception):
                for modality, part in modality_parts(sc, res, scorer).items():
                    by_modality[modality] += sc.weight * torch.nan_to_num(part * ok, nan=0.0)
        if self.cfg.aggregate == "gdpo":
            total = self._gdpo(traj, per_scorer, results, valid)
            by_modality = {m: torch.zeros(n) for m in REWARD_MODALITIES}
            by_modality["joint"] = total.clone()
        over = valid & ~torch.isfinite(total)
        if over.any():  # each weighted score fits float32, their sum does not
            raise RewardFailure(
                f"the weighted sum of the scores overflows float32 for {int(over.sum())} "
                "samples; lower the scorers' weights (reward.scorers[*].weight)"
            )
        total = torch.where(valid, total, torch.full_like(total, float("nan")))
        nan = torch.full_like(total, float("nan"))
        by_modality = {m: torch.where(valid, r, nan) for m, r in by_modality.items()}
        scored = ScoredBatch(traj, total, per_scorer, valid, by_modality)
        return scored, {**metrics, **reward_summary(scored)}

    def _gdpo(self, traj: Trajectory, per_scorer, results, valid: Tensor) -> Tensor:
        """(B,) float32 GDPO reward: each scorer's scores normalised in their groups (over
        the samples valid for every scorer), weighted and summed. The call must hold whole
        groups (``groupwise``: reward/edges.py cuts calls at group boundaries)."""
        for (sc, _), res in zip(self.scorers, results, strict=True):
            if isinstance(res, ScoreResult) and res.parts:
                raise RewardFailure(
                    f"scorer {sc.key!r} splits its score by modality, which "
                    "reward.aggregate=gdpo cannot carry (it normalises each score as a whole); "
                    "use reward.aggregate=sum"
                )
        keys = [sc.key for sc, _ in self.scorers]
        scores = torch.stack([per_scorer[k] for k in keys], dim=1)  # (B, K), NaN where missing
        weights = torch.tensor([sc.weight for sc, _ in self.scorers], dtype=torch.float64)
        return gdpo_combine(scores, weights, traj.group, valid).float()


def modality_parts(sc: ScorerConfig, result: ScoreResult, scorer: object) -> dict[str, Tensor]:
    """modality -> (B,) unweighted part of one scorer's scores: all of it under the entry's
    modality; under ``auto`` the result's own split (``ScoreResult.parts``), else all of it
    under the scorer's declared ``modality`` attribute (e.g. "audio" for audio-text), else
    joint."""
    if sc.modality != "auto":
        return {sc.modality: result.scores}
    if result.parts:
        return dict(result.parts)
    return {getattr(scorer, "modality", "joint"): result.scores}


def finite_as(scores: Tensor, dtype: torch.dtype, weight: float) -> Tensor:
    """(B,) bool: each score, and each score times ``weight``, is finite in ``dtype`` (the
    combined reward's): what the reward pool sums, not the scorer's own precision."""
    return torch.isfinite(scores.to(dtype)) & torch.isfinite((weight * scores).to(dtype))


def _overflow(scores: Tensor, bad: Tensor, weight: float, dtype: torch.dtype) -> str:
    """' (1e+300 x weight 1 is not finite in float32)': the first of the scorer's valid scores
    refused (``bad``) that is finite as the scorer gave it; '' when there is none."""
    over = bad & torch.isfinite(scores)
    if not over.any():
        return ""
    first = float(scores[over][0])
    return f" ({first:g} x weight {weight:g} is not finite in {str(dtype).removeprefix('torch.')})"


async def close_pool(pool: RewardPool) -> None:
    """Release scorers' resources (HTTP connection pools, models) at the end of a run."""
    for _, scorer in pool.scorers:
        close = getattr(scorer, "close", None)
        if close is not None:
            result = close()
            if asyncio.iscoroutine(result):
                await result


def reward_summary(scored: ScoredBatch) -> dict[str, float]:
    """Means over valid samples, from the tensors (so micro-batches can be joined first)."""
    out = {}
    for name, scores in scored.per_scorer.items():
        ok = torch.isfinite(scores)
        if ok.any():
            out[f"reward/{name}/mean"] = float(scores[ok].double().mean())  # fp32 overflows
        out[f"reward/{name}/valid_frac"] = float(ok.float().mean())
    if scored.valid.any():
        out["reward/mean"] = float(scored.rewards[scored.valid].double().mean())
        by = scored.modality_rewards
        if any(bool(by[m][scored.valid].ne(0).any()) for m in MODALITIES if m in by):
            for m, part in by.items():  # declared per modality: each one's share of reward/mean
                out[f"reward/modality/{m}/mean"] = float(part[scored.valid].double().mean())
    return out
