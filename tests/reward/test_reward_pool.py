"""The reward pool: weighted scorers; failures are loud (required) or marked missing
(optional), never silently scored 0."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from shapes_images import square_off_one_blob

from diffrl.errors import DiffrlError
from diffrl.reward.pool import RewardConfig, RewardFailure, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult, finite_result, register_scorer
from diffrl.reward.scorers import build_scorer, registered_scorers
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import parse_prompt, split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.types import Trajectory

N = 4


class FixedScorer:
    """Returns fixed scores (NaN = missing)."""

    needs = frozenset({"image"})

    def __init__(self, name: str, values, valid=None) -> None:
        self.name, self.values, self.valid = name, values, valid

    async def score(self, traj: Trajectory) -> ScoreResult:
        scores = torch.tensor(self.values, dtype=torch.float32)
        if self.valid is not None:
            return ScoreResult(scores, torch.tensor(self.valid), {"extra": 7.0})
        return finite_result(scores)


@register_scorer("test_pool_fixed")
def _fixed(values=(1.0, 2.0, 3.0, 4.0), valid=None, name="test_pool_fixed"):
    return FixedScorer(name, list(values), valid)


@register_scorer("test_pool_fixed_b")
def _fixed_b(values=(10.0, 20.0, 30.0, 40.0)):
    return FixedScorer("test_pool_fixed_b", list(values))


class Boom:
    name, needs = "test_pool_boom", frozenset()

    async def score(self, traj):
        raise RuntimeError("scorer service down")


register_scorer("test_pool_boom")(Boom)


class NeedsVideo(FixedScorer):
    needs = frozenset({"image", "video"})


@register_scorer("test_pool_video")
def _video():
    return NeedsVideo("test_pool_video", [1.0] * N)


@register_scorer("test_pool_badshape")
def _badshape():
    return FixedScorer("test_pool_badshape", [1.0, 2.0])


def make_traj(n: int = N, fields=("image",)) -> Trajectory:
    ps = PromptSet([Prompt(p.text) for p in split_prompts("train")[:n]], _tokenize)
    extra = {"image": torch.zeros(n, 32, 32, 3, dtype=torch.uint8)}
    return Trajectory(
        prompts=ps.all(),
        group=torch.zeros(n, dtype=torch.long),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 3, 32, 32),
        sigmas=torch.linspace(1, 0, 3),
        policy_version=0,
        extra_fields={k: v for k, v in extra.items() if k in fields},
    )


def _tokenize(texts):
    from diffrl.models.families.tiny_dit import TinyDiTFamily
    from diffrl.models.tiny_dit import TinyDiTConfig

    return TinyDiTFamily(TinyDiTConfig()).tokenize(texts)


def pool(*scorers: ScorerConfig) -> RewardPool:
    return RewardPool(RewardConfig(scorers=list(scorers)))


def score(p: RewardPool, traj: Trajectory | None = None):
    return asyncio.run(p.score(traj or make_traj()))


def test_weighted_sum_of_two_scorers() -> None:
    p = pool(
        ScorerConfig("test_pool_fixed", weight=0.5), ScorerConfig("test_pool_fixed_b", weight=2.0)
    )
    batch, metrics = score(p)
    assert batch.rewards.tolist() == pytest.approx([20.5, 41.0, 61.5, 82.0])
    assert batch.valid.all()
    assert batch.per_scorer["test_pool_fixed"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert batch.per_scorer["test_pool_fixed_b"].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert metrics["reward/mean"] == pytest.approx(51.25)
    assert metrics["reward/test_pool_fixed/mean"] == pytest.approx(2.5)
    assert metrics["reward/test_pool_fixed_b/valid_frac"] == 1.0


def test_optional_scorer_raising_marks_samples_missing() -> None:
    p = pool(
        ScorerConfig("test_pool_fixed", weight=1.0),
        ScorerConfig("test_pool_boom", weight=1.0, required=False),
    )
    batch, metrics = score(p)
    assert not batch.valid.any()
    assert torch.isnan(batch.rewards).all()  # NaN, never 0
    assert torch.isnan(batch.per_scorer["test_pool_boom"]).all()
    assert batch.per_scorer["test_pool_fixed"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert metrics["reward/test_pool_boom/failed"] == 1.0
    assert metrics["reward/test_pool_boom/valid_frac"] == 0.0
    assert "reward/mean" not in metrics


def test_optional_nan_and_invalid_scores_only_mark_those_samples() -> None:
    p = pool(
        ScorerConfig("test_pool_fixed", weight=1.0),
        ScorerConfig(
            "test_pool_fixed_b",
            weight=1.0,
            required=False,
            params={"values": [10.0, float("nan"), 30.0, float("inf")]},
        ),
    )
    batch, metrics = score(p)
    assert batch.valid.tolist() == [True, False, True, False]
    assert batch.rewards[0].item() == 11.0 and batch.rewards[2].item() == 33.0
    assert torch.isnan(batch.rewards[[1, 3]]).all()
    assert metrics["reward/mean"] == pytest.approx(22.0)
    assert metrics["reward/test_pool_fixed_b/valid_frac"] == 0.5
    assert metrics["reward/test_pool_fixed_b/mean"] == pytest.approx(20.0)
    # a scorer's own valid mask is honoured too, and its metrics are namespaced
    p2 = pool(
        ScorerConfig("test_pool_fixed", required=False, params={"valid": [True, True, False, True]})
    )
    batch2, metrics2 = score(p2)
    assert batch2.valid.tolist() == [True, True, False, True]
    assert torch.isnan(batch2.per_scorer["test_pool_fixed"][2])
    assert metrics2["reward/test_pool_fixed/extra"] == 7.0


def test_required_scorer_raising_stops() -> None:
    p = pool(ScorerConfig("test_pool_fixed"), ScorerConfig("test_pool_boom", required=True))
    with pytest.raises(RewardFailure, match="test_pool_boom.*scorer service down"):
        score(p)


def test_required_scorer_nan_stops() -> None:
    p = pool(ScorerConfig("test_pool_fixed", params={"values": [1.0, float("nan"), 3.0, 4.0]}))
    with pytest.raises(RewardFailure, match="1 missing/NaN"):
        score(p)


def test_required_scorer_wrong_count_stops() -> None:
    with pytest.raises(RewardFailure, match=r"returned \(2,\) scores for 4 samples"):
        score(pool(ScorerConfig("test_pool_badshape")))


def test_missing_extra_field_is_named() -> None:
    with pytest.raises(RewardFailure) as e:
        score(pool(ScorerConfig("test_pool_video")))
    assert "'video'" in str(e.value) and "omni" in str(e.value)
    batch, metrics = score(
        pool(ScorerConfig("test_pool_fixed"), ScorerConfig("test_pool_video", required=False))
    )
    assert metrics["reward/test_pool_video/failed"] == 1.0 and not batch.valid.any()
    with pytest.raises(RewardFailure, match="'image'"):
        score(pool(ScorerConfig("test_pool_fixed")), make_traj(fields=()))


def test_check_inputs_at_start_up() -> None:
    p = pool(ScorerConfig("test_pool_fixed"), ScorerConfig("test_pool_video"))
    with pytest.raises(DiffrlError, match=r"test_pool_video.*\['video'\]"):
        p.check_inputs({"image"})
    p.check_inputs({"image", "video"})  # fine once produced
    with pytest.raises(DiffrlError, match=r"\['image'\]"):
        pool(ScorerConfig("test_pool_fixed")).check_inputs(set())


def test_unknown_scorer_and_bad_params() -> None:
    with pytest.raises(DiffrlError, match="unknown scorer 'test_pool_nope'"):
        pool(ScorerConfig("test_pool_nope"))
    with pytest.raises(DiffrlError, match="bad params for scorer 'test_pool_fixed_b'"):
        pool(ScorerConfig("test_pool_fixed_b", params={"nonsense": 1}))
    with pytest.raises(DiffrlError, match="mode"):
        pool(ScorerConfig("shapes", params={"mode": "strictest"}))
    assert {"shapes", "test_pool_fixed"} <= set(registered_scorers())


def test_scorers_run_concurrently() -> None:
    """Two scorers that each wait for the other: this completes only if they run together."""
    events: dict[str, asyncio.Event] = {}

    class Handshake:
        needs = frozenset()

        def __init__(self, me: str, other: str) -> None:
            self.name, self.me, self.other = me, me, other

        async def score(self, traj):
            events.setdefault(self.me, asyncio.Event()).set()
            await events.setdefault(self.other, asyncio.Event()).wait()
            return finite_result(torch.ones(len(traj)))

    register_scorer("test_pool_hs_a")(lambda: Handshake("test_pool_hs_a", "test_pool_hs_b"))
    register_scorer("test_pool_hs_b")(lambda: Handshake("test_pool_hs_b", "test_pool_hs_a"))
    p = pool(ScorerConfig("test_pool_hs_a"), ScorerConfig("test_pool_hs_b"))

    async def go():
        return await asyncio.wait_for(p.score(make_traj()), timeout=5)

    batch, _ = asyncio.run(go())
    assert batch.rewards.tolist() == [2.0] * N


def test_builtin_shapes_scorer_on_ground_truth() -> None:
    prompts = split_prompts("train")[:3]
    rng = np.random.default_rng(0)
    truth = np.stack([render(p, rng) for p in prompts])
    traj = make_traj(3).with_fields(image=torch.from_numpy(truth))
    scorer = build_scorer("shapes", {"mode": "overall"})
    result = asyncio.run(scorer.score(traj))
    assert result.scores.tolist() == [1.0, 1.0, 1.0]
    assert result.metrics["accuracy"] == 1.0
    blank = asyncio.run(build_scorer("shapes", {"mode": "partial"}).score(make_traj(3)))
    assert (blank.scores < 1.0).all() and (blank.scores >= 0).all()


def test_shapes_scorer_graded_credits_part_of_a_constraint() -> None:
    """On a render with one of three circles squared off, partial gives shape no credit and
    graded gives it 2/3; both agree on the fully right image (1.0)."""
    prompt = parse_prompt("three red circles")
    good = render(prompt, np.random.default_rng(6))
    bad = good.copy()
    square_off_one_blob(bad, "red")
    ps = PromptSet([Prompt(prompt.text)] * 2, _tokenize)
    traj = replace(make_traj(2), prompts=ps.all()).with_fields(
        image=torch.from_numpy(np.stack([good, bad]))
    )
    partial = asyncio.run(build_scorer("shapes", {"mode": "partial"}).score(traj)).scores
    graded = asyncio.run(build_scorer("shapes", {"mode": "graded"}).score(traj)).scores
    assert partial[0] == graded[0] == 1.0
    assert partial[1] == pytest.approx(0.5 * 3 / 4)  # overall fails, three of four constraints hold
    assert graded[1] == pytest.approx(0.5 * (3 + 2 / 3) / 4)
