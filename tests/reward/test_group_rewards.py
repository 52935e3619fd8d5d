"""Groupwise rewards: group scorers called once per whole group (and never with part of one,
in the pool or on the streaming edges), their failures failing their group only; Pref-GRPO's
win rates from a pointwise judge; GDPO aggregation against the formula written out here."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from diffrl.channel import Channel
from diffrl.config import load_config
from diffrl.errors import ConfigError, DiffrlError
from diffrl.reward.edges import PerSample, collect, score_ready
from diffrl.reward.pool import RewardConfig, RewardFailure, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.reward.scorers import build_scorer
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.types import PromptBatch, Trajectory


def traj_of(groups: list[int], seeds: list[int] | None = None) -> Trajectory:
    """Rows with these group ids (prompt "p<g>"), seeds numbering the rows."""
    n = len(groups)
    prompts = PromptBatch(
        texts=tuple(f"p{g}" for g in groups),
        input_ids=torch.zeros(n, 1, dtype=torch.long),
        ids_hash=tuple("h" for _ in range(n)),
        prompt_ids=torch.tensor(groups),
    )
    return Trajectory(
        prompts=prompts,
        group=torch.tensor(groups),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n))),
        x0=torch.zeros(n, 2),
        sigmas=torch.linspace(1, 0, 3),
        extra_fields={"image": torch.zeros(n, 2, 2, 3, dtype=torch.uint8)},
    )


class BySeed:
    """A per-sample scorer: score = table[seed] (NaN = missing)."""

    needs = frozenset({"image"})

    def __init__(self, table: dict[int, float], name: str = "test_group_seed") -> None:
        self.table, self.name = table, name

    async def score(self, traj: Trajectory) -> ScoreResult:
        s = torch.tensor([self.table[int(i)] for i in traj.seeds], dtype=torch.float32)
        return ScoreResult(s, torch.isfinite(s), {"n": float(len(s))})


class GroupRank:
    """A group scorer: each sample's seed rank within its group / G; records each call's
    seeds; a group holding a seed in ``fail`` raises."""

    needs = frozenset({"image"})
    groupwise = True

    def __init__(self, fail=()) -> None:
        self.name, self.fail, self.calls = "test_group_rank", set(fail), []

    async def score_group(self, traj: Trajectory) -> ScoreResult:
        seeds = traj.seeds.tolist()
        self.calls.append(seeds)
        await asyncio.sleep(0)
        if self.fail & set(seeds):
            raise ConnectionError("judge unreachable")
        s = traj.seeds.argsort().argsort().float() / len(seeds)
        return ScoreResult(s, torch.ones(len(s), dtype=torch.bool), {"size": float(len(s))})


register_scorer("test_group_seed")(lambda table, name="test_group_seed": BySeed(table, name))
register_scorer("test_group_rank")(lambda scorer: scorer)


def pool(*entries: ScorerConfig, aggregate: str = "sum") -> RewardPool:
    return RewardPool(RewardConfig(list(entries), aggregate=aggregate))


def test_a_group_scorer_sees_each_whole_group_once_beside_per_sample_scorers() -> None:
    rank = GroupRank()
    p = pool(
        ScorerConfig("test_group_rank", weight=2.0, params={"scorer": rank}),
        ScorerConfig("test_group_seed", weight=0.5, params={"table": {i: i for i in range(6)}}),
    )
    assert p.groupwise
    scored, metrics = asyncio.run(p.score(traj_of([7, 7, 7, 9, 9, 9], [2, 0, 1, 5, 3, 4])))
    assert sorted(rank.calls) == [[2, 0, 1], [5, 3, 4]]  # one call per group, all its rows
    ranks = torch.tensor([2, 0, 1, 2, 0, 1]) / 3
    want = 2.0 * ranks + 0.5 * torch.tensor([2.0, 0, 1, 5, 3, 4])
    assert torch.allclose(scored.rewards, want) and scored.valid.all()
    assert metrics["reward/test_group_rank/size"] == 3.0
    assert metrics["reward/test_group_rank/failed_groups"] == 0.0
    assert not pool(ScorerConfig("test_group_seed", params={"table": {}})).groupwise


def test_a_failing_group_scorer_fails_its_group_only_or_the_run_when_required() -> None:
    traj = traj_of([0, 0, 1, 1])
    entry = ScorerConfig("test_group_rank", required=False, params={"scorer": GroupRank({3})})
    scored, metrics = asyncio.run(pool(entry).score(traj))
    assert scored.valid.tolist() == [True, True, False, False]
    assert scored.rewards[:2].tolist() == [0.0, 0.5] and scored.rewards[2:].isnan().all()
    assert metrics["reward/test_group_rank/failed_groups"] == 0.5
    required = ScorerConfig("test_group_rank", params={"scorer": GroupRank({3})})
    with pytest.raises(RewardFailure, match="group 1 \\(2 samples of 'p1'\\): judge unreachable"):
        asyncio.run(pool(required).score(traj))
    every = ScorerConfig("test_group_rank", required=False, params={"scorer": GroupRank({0, 3})})
    scored, metrics = asyncio.run(pool(every).score(traj))
    assert not scored.valid.any() and metrics["reward/test_group_rank/failed"] == 1.0


def streamed(p: RewardPool, parts: list[list[list[int]]], cap: int = 0):
    """score_ready + collect over micro-batches whose rows arrive in the given bursts (each a
    list of row indices of that micro-batch; rows 2i, 2i+1 are a group): the collected."""

    async def go():
        samples, out = Channel(), Channel()
        per = PerSample(Channel())
        recorded = []
        for k, bursts in enumerate(parts):
            rows = sorted(itertools.chain(*bursts))
            traj = traj_of([10 * k + r // 2 for r in rows], [100 * k + r for r in rows])
            await per.put(traj, 0)
            recorded.append(await per.out.get_ready(wait=False))
        scorer = asyncio.create_task(score_ready(samples, out, p, cap))
        collector = asyncio.create_task(collect(out))
        for k, bursts in enumerate(parts):
            for burst in bursts:
                await samples.put_many([recorded[k][r] for r in burst], 0)
                await asyncio.sleep(0.01)
        samples.close()
        await scorer
        return await collector

    return asyncio.run(asyncio.wait_for(go(), 10))


def test_edges_hand_a_group_scorer_whole_groups_as_they_complete() -> None:
    rank = GroupRank()
    p = pool(ScorerConfig("test_group_rank", params={"scorer": rank}))
    # micro-batch 0: rows 0, 2 arrive first (no group whole), then 1 (group 0 whole), then 3
    got = streamed(p, [[[0, 2], [1], [3]], [[0, 1, 2, 3]]])
    assert rank.calls == [[0, 1], [2, 3], [100, 101], [102, 103]]  # never part of a group
    assert [(c[0], c[3]) for c in sorted(got.calls)] == [(0, 2), (0, 2), (1, 4)]  # pool calls
    assert [len(part) for part in got.parts] == [4, 4]
    # a cap below a group still takes the whole group; above it, as many groups as fit
    got = streamed(p, [[[0, 1, 2, 3, 4, 5]]], cap=1)
    assert [c[3] for c in sorted(got.calls)] == [2, 2, 2]
    got = streamed(p, [[[0, 1, 2, 3, 4, 5]]], cap=5)
    assert [c[3] for c in sorted(got.calls)] == [4, 2]


def gdpo_reference(scores: np.ndarray, weights, groups, valid) -> np.ndarray:
    """GDPO (arXiv:2601.05242) written out: per reward k and group g, over the group's valid
    samples, A = (s - mean) / (unbiased std + 1e-4) (0 for a group of one); R = sum_k w_k A_k."""
    out = np.zeros(len(groups))
    for g in set(groups):
        rows = [i for i in range(len(groups)) if groups[i] == g and valid[i]]
        for k, w in enumerate(weights):
            col = np.array([scores[i, k] for i in rows])
            if len(col) < 2:
                continue
            std = col.std(ddof=1)
            for i in rows:
                out[i] += w * (scores[i, k] - col.mean()) / (std + 1e-4)
    return out


def test_gdpo_aggregation_matches_the_formula_and_sum_stays_the_default() -> None:
    a = {0: 1.0, 1: 0.0, 2: 1.0, 3: 3.0, 4: 3.0, 5: 2.0, 6: 0.3, 7: float("nan")}
    b = {0: 0.5, 1: 0.9, 2: 0.1, 3: 7.0, 4: 9.0, 5: 8.0, 6: 0.2, 7: 0.4}
    groups = [4, 4, 4, 2, 2, 2, 6, 6]  # group 6: one valid sample left -> 0
    entries = [
        ScorerConfig("test_group_seed", weight=1.0, required=False, params={"table": a}),
        ScorerConfig("test_group_seed", 0.25, label="b", params={"table": b, "name": "b"}),
    ]
    traj = traj_of(groups)
    got, _ = asyncio.run(pool(*entries, aggregate="gdpo").score(traj))
    valid = [True] * 7 + [False]
    s = np.array([[a[i], b[i]] for i in range(8)])
    want = gdpo_reference(s, [1.0, 0.25], groups, valid)
    assert got.valid.tolist() == valid
    np.testing.assert_allclose(got.rewards[:7].numpy(), want[:7], rtol=1e-6, atol=1e-6)
    assert got.rewards[6] == 0.0 and got.rewards[7].isnan()
    assert got.per_scorer["b"].tolist() == pytest.approx([b[i] for i in range(8)])  # raw
    # the default is the weighted sum, bit for bit
    summed, _ = asyncio.run(pool(*entries).score(traj))
    assert RewardConfig().aggregate == "sum"
    ta, tb = torch.tensor(s[:7], dtype=torch.float32).T
    assert torch.equal(summed.rewards[:7], torch.zeros(7) + 1.0 * ta + 0.25 * tb)
    with pytest.raises(ConfigError, match="'reward.aggregate' = 'mean': must be one of"):
        load_config(None, ["reward.aggregate=mean"])
    with pytest.raises(DiffrlError, match="modality 'video'"):
        pool(
            ScorerConfig("test_group_seed", modality="video", params={"table": a}), aggregate="gdpo"
        )


def test_pairwise_rank_gives_pref_grpo_win_rates_from_a_pointwise_judge() -> None:
    table = {0: 0.2, 1: 0.9, 2: 0.2, 3: 0.5, 4: float("nan")}
    s = build_scorer(
        "pairwise_rank", {"judge": "test_group_seed", "judge_params": {"table": table}}
    )
    res = asyncio.run(s.score_group(traj_of([0] * 5)))
    # w_i = 1/(n-1) sum_{j != i} [s_i > s_j] + 0.5 [s_i = s_j], over the 4 judged samples
    assert res.scores[:4].tolist() == pytest.approx([0.5 / 3, 1.0, 0.5 / 3, 2 / 3])
    assert res.valid.tolist() == [True] * 4 + [False] and res.metrics == {"judge/n": 5.0}
    assert asyncio.run(s.score_group(traj_of([0], [1]))).scores.tolist() == [0.5]
    with pytest.raises(ValueError, match="params.judge"):
        build_scorer("pairwise_rank", {})


def test_pairwise_rank_with_the_shapes_verifier_prefers_the_right_image() -> None:
    spec = split_prompts("train")[0]
    right = render(spec, np.random.default_rng(0))
    wrong = np.zeros_like(right)  # a blank image: below 1 under partial
    traj = traj_of([0, 0, 0]).with_fields(image=torch.from_numpy(np.stack([wrong, right, wrong])))
    traj = replace(traj, prompts=replace(traj.prompts, texts=(spec.text,) * 3))
    s = build_scorer("pairwise_rank", {"judge": "shapes", "judge_params": {"mode": "partial"}})
    res = asyncio.run(s.score_group(traj))
    assert res.scores.tolist() == [0.25, 1.0, 0.25] and res.metrics[
        "judge/accuracy"
    ] == pytest.approx(1 / 3)


def test_serve_reward_refuses_a_group_scorer_in_one_line(capsys) -> None:
    from diffrl.cli import main

    argv = ["serve-reward", "--scorer", "pairwise_rank", "--scorer-param", "judge=shapes"]
    assert main([*argv, "--port", "1"]) == 2
    assert "a group scorer is not served over HTTP" in capsys.readouterr().err
