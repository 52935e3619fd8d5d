"""One step's streamed generation + scoring (diffrl.controller.step.rollout_and_score)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest
import torch

from diffrl.algorithms.advantage import tied_fraction
from diffrl.channel import Channel
from diffrl.controller.step import rollout_and_score
from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig, reward_summary
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.rollout.engine import RolloutConfig, RolloutEngine, sample_seeds
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.types import ScoredBatch


class ByGroup:
    """Scores each sample from a per-group table (NaN = missing); group ids are batch-wide."""

    needs = frozenset({"image"})

    def __init__(self, table) -> None:
        self.name, self.table = "test_ras_bygroup", table

    async def score(self, traj):
        scores = torch.tensor([self.table[int(g)][i % 2] for i, g in enumerate(traj.group)])
        return ScoreResult(scores, torch.isfinite(scores))


register_scorer("test_ras_bygroup")(ByGroup)


def make_parts(tiny_model, table, max_batch: int = 2):
    texts = [Prompt(p.text) for p in split_prompts("train")[:3]]
    prompts = PromptSet(texts, tiny_model.family.tokenize).all()
    rollout = RolloutEngine(
        tiny_model,
        RolloutConfig(group_size=2, num_steps=2, max_batch=max_batch),
        [],
        torch.device("cpu"),
    )
    pool = RewardPool(
        RewardConfig([ScorerConfig("test_ras_bygroup", required=False, params={"table": table})])
    )
    return types.SimpleNamespace(
        rollout=rollout,
        rewards=pool,
        prompts=types.SimpleNamespace(at=lambda step: prompts, first=0, observe=lambda *a: None),
        cfg=types.SimpleNamespace(run=types.SimpleNamespace(seed=2)),
    )


def test_streams_every_micro_batch_into_one_scored_batch(tiny_model) -> None:
    table = {0: [0.0, 1.0], 1: [0.25, 0.25], 2: [1.0, 1.0]}
    parts = make_parts(tiny_model, table, max_batch=2)  # 3 micro-batches of one group
    scored, metrics = asyncio.run(rollout_and_score(parts, step=5))
    assert len(scored) == 6
    assert scored.traj.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert scored.traj.seeds.tolist() == sample_seeds(2 * 1_000_003 + 5, 6).tolist()
    assert scored.rewards.tolist() == [0.0, 1.0, 0.25, 0.25, 1.0, 1.0]
    assert metrics["reward/mean"] == pytest.approx(3.5 / 6)
    # the same step in one micro-batch gives the same samples and rewards
    whole, m_whole = asyncio.run(rollout_and_score(make_parts(tiny_model, table, 64), 5))
    torch.testing.assert_close(whole.traj.x0, scored.traj.x0, rtol=0, atol=1e-5)
    assert m_whole["reward/mean"] == pytest.approx(metrics["reward/mean"])


def test_reward_mean_is_over_valid_samples_across_micro_batches(tiny_model) -> None:
    nan = float("nan")
    table = {0: [nan, nan], 1: [1.0, nan], 2: [0.5, 0.5]}
    parts = make_parts(tiny_model, table, max_batch=2)
    scored, metrics = asyncio.run(rollout_and_score(parts, step=0))
    assert scored.valid.tolist() == [False, False, True, False, True, True]
    expected = float(scored.rewards[scored.valid].mean())  # (1 + 0.5 + 0.5) / 3
    assert expected == pytest.approx(2 / 3)
    # one micro-batch for the whole step gets it right; streaming must not change the metric
    _, m_whole = asyncio.run(rollout_and_score(make_parts(tiny_model, table, 64), 0))
    assert m_whole["reward/mean"] == pytest.approx(expected)
    assert metrics["reward/mean"] == pytest.approx(expected)  # actual: 0.5


async def old_rollout_and_score(parts, step, on_scored):
    """The path before the per-sample edges: the rollout's micro-batches through one channel
    into the pool, a whole micro-batch per call, metrics sample-weighted per micro-batch."""
    channel = Channel(capacity=2)
    seed = parts.cfg.run.seed * 1_000_003 + step
    producer = asyncio.create_task(
        parts.rollout.stream(parts.prompts.at(step), seed=seed, channel=channel, iteration=step)
    )
    scored, extra = [], {}
    async for traj in channel:
        s, m = await parts.rewards.score(traj)
        scored.append(s)
        await on_scored(s)
        for k, v in m.items():
            extra.setdefault(k, []).append((v, len(s)))
    await producer
    batch = ScoredBatch.concat(scored)
    metrics = {k: sum(v * n for v, n in x) / sum(n for _, n in x) for k, x in extra.items()}
    metrics["reward/tied_groups"] = tied_fraction(batch.rewards, batch.traj.group, batch.valid)
    return batch, {**metrics, **reward_summary(batch)}


def test_per_sample_edges_give_the_old_paths_rows_and_metrics_bit_for_bit(tiny_model) -> None:
    """Every tensor of the scored batch, every micro-batch handed to ``on_scored`` (what
    ``run.stream_train`` trains) and every metric (the shapes scorer's accuracy, a mean per
    pool call, included) equal the one-call-per-micro-batch path's."""
    table = {0: [0.0, 1.0], 1: [0.25, float("nan")], 2: [1.0, 1.0]}
    parts = make_parts(tiny_model, table, max_batch=2)  # 3 micro-batches
    parts.rewards = RewardPool(
        RewardConfig(
            [
                ScorerConfig("test_ras_bygroup", required=False, params={"table": table}),
                ScorerConfig("shapes", params={"mode": "partial"}),
            ]
        )
    )
    runs = {}
    for name, fn in (("old", old_rollout_and_score), ("new", rollout_and_score)):
        handed = []

        async def on_scored(s, handed=handed):
            handed.append(s)

        runs[name] = asyncio.run(fn(parts, 3, on_scored)), handed
    (old, m_old), old_parts = runs["old"]
    (new, m_new), new_parts = runs["new"]
    assert len(new_parts) == len(old_parts) == 3
    for a, b in zip([old, *old_parts], [new, *new_parts], strict=True):
        assert_same(a, b)
    assert {k: v for k, v in m_new.items() if not k.startswith("perf/")} == m_old
    assert "reward/shapes/accuracy" in m_new and m_new["perf/score_calls"] == 3.0


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b
