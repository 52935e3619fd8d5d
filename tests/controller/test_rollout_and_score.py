"""One step's streamed generation + scoring (diffrl.controller.step.rollout_and_score)."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from diffrl.controller.step import rollout_and_score
from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.rollout.engine import RolloutConfig, RolloutEngine, sample_seeds
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts


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
