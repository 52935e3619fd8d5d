"""The rollout -> reward -> actor edges per sample (``diffrl.reward.edges``) on fake
micro-batches: the collector hands a micro-batch as soon as its rows are scored, in rollout
order; pool calls never mix micro-batches; a failing scorer or rollout fails the step (no
hang); a stream cut mid-micro-batch is an error."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffrl.channel import Channel
from diffrl.reward.edges import (
    PerSample,
    Sample,
    ScoredSample,
    StreamCut,
    collect,
    run_local,
    score_ready,
)
from diffrl.reward.pool import RewardConfig, RewardFailure, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.types import PromptBatch, ScoredBatch, Trajectory, select_rows

G = 2  # samples per group


def micro_batch(k: int, groups: int = 2) -> Trajectory:
    """Micro-batch ``k``: ``groups`` whole groups of G rows; seeds number the rows."""
    n = groups * G
    prompts = PromptBatch(
        texts=tuple(f"p{k}.{i // G}" for i in range(n)),
        input_ids=torch.full((n, 3), k),
        ids_hash=tuple("h" for _ in range(n)),
        prompt_ids=torch.arange(n) // G,
    )
    return Trajectory(
        prompts=prompts,
        group=torch.arange(n) // G + k * groups,
        seeds=torch.arange(n) + 100 * k,
        x0=torch.randn(n, 2, generator=torch.Generator().manual_seed(k)),
        sigmas=torch.linspace(1, 0, 3),
        extra_fields={"image": torch.zeros(n, 2, 2, 3, dtype=torch.uint8)},
    )


class Gated:
    """Scores a row by its seed; a call holding a seed in ``hold`` waits for ``release``.
    Records each call's seeds; raises on a seed in ``fail``."""

    needs = frozenset({"image"})

    def __init__(self, hold=(), fail=()) -> None:
        self.name, self.hold, self.fail = "test_edges_gated", set(hold), set(fail)
        self.release = asyncio.Event()
        self.calls: list[list[int]] = []

    async def score(self, traj):
        seeds = traj.seeds.tolist()
        self.calls.append(seeds)
        if self.hold & set(seeds):
            await self.release.wait()
        if self.fail & set(seeds):
            raise ValueError(f"cannot score seed {sorted(self.fail & set(seeds))}")
        scores = traj.seeds.float() / 10
        return ScoreResult(scores, torch.isfinite(scores), {"calls": float(len(seeds))})


register_scorer("test_edges_gated")(lambda scorer: scorer)


def pool_of(scorer: Gated, required: bool = True) -> RewardPool:
    cfg = ScorerConfig("test_edges_gated", required=required, params={"scorer": scorer})
    return RewardPool(RewardConfig([cfg]))


def rollout_of(n_parts: int, gaps: float = 0.0):
    async def stream(channel) -> None:
        try:
            for k in range(n_parts):
                await channel.put(micro_batch(k), 0)
                await asyncio.sleep(gaps)
        finally:
            channel.close()

    return stream


def run(coro, timeout: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_micro_batch_is_handed_once_its_groups_are_scored_not_after_the_step():
    scorer = Gated(hold={101})  # micro-batch 1's call waits until released
    handed: list[list[int]] = []

    async def go():
        async def on_part(part: ScoredBatch) -> None:
            handed.append(part.traj.seeds.tolist())

        job = asyncio.create_task(run_local(rollout_of(3), pool_of(scorer), on_part))
        for _ in range(200):
            if len(scorer.calls) == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        # micro-batch 0 is trained on while 1 is being scored and 2 waits: not after the step
        assert handed == [[0, 1, 2, 3]] and not job.done()
        scorer.release.set()
        return await job

    got = run(go())
    assert handed == [[0, 1, 2, 3], [100, 101, 102, 103], [200, 201, 202, 203]]
    # one pool call per micro-batch, in order; the rows are the micro-batches' own
    assert scorer.calls == handed
    for k, part in enumerate(got.parts):
        assert torch.equal(part.traj.x0, micro_batch(k).x0)
        assert torch.equal(part.traj.group, micro_batch(k).group)
        assert torch.equal(part.rewards, micro_batch(k).seeds.float() / 10)
    assert got.metrics()["reward/test_edges_gated/calls"] == 4.0
    assert got.metrics()["perf/score_calls"] == 3.0


def test_a_cap_splits_a_micro_batch_and_its_first_rows_score_before_its_last():
    scorer = Gated(hold={3})
    handed: list[int] = []

    async def go():
        async def on_part(part: ScoredBatch) -> None:
            handed.append(len(part))

        job = asyncio.create_task(run_local(rollout_of(2), pool_of(scorer), on_part, cap=3))
        while len(scorer.calls) < 2:
            await asyncio.sleep(0.01)
        assert handed == []  # rows 0-2 scored, row 3 held: micro-batch 0 is not whole yet
        scorer.release.set()
        return await job

    got = run(go())
    assert scorer.calls == [[0, 1, 2], [3], [100, 101, 102], [103]]
    assert handed == [4, 4]
    # sample-weighted over the calls: (3*3 + 1*1) / 4 per micro-batch
    assert got.metrics()["reward/test_edges_gated/calls"] == pytest.approx(2.5)


def test_the_collector_waits_for_whole_micro_batches_in_rollout_order():
    def scored(k: int, row: int) -> ScoredSample:
        traj = micro_batch(k)
        one = ScoredBatch(traj, traj.seeds.float(), {"s": traj.seeds.float()}, traj.seeds >= 0)
        return ScoredSample(select_rows(one, torch.tensor([row])), k, row, len(traj), 0.0)

    async def go():
        ch, handed = Channel(), []

        async def on_part(part):
            handed.append(part.traj.seeds.tolist())

        task = asyncio.create_task(collect(ch, on_part))
        for r in (3, 1, 0, 2):  # micro-batch 1 complete, out of row order
            await ch.put(scored(1, r), 0)
        await asyncio.sleep(0.02)
        assert handed == []  # 0 comes first
        await ch.put_many([scored(0, r) for r in range(4)], 0)
        await asyncio.sleep(0.02)
        assert handed == [[0, 1, 2, 3], [100, 101, 102, 103]]
        await ch.put(scored(2, 0), 0)
        ch.close()
        with pytest.raises(StreamCut, match="micro-batch 2 at 1 of 4 rows"):
            await task

    run(go())


def test_per_sample_records_are_the_rows_of_their_micro_batch():
    async def go():
        ch = Channel()
        out = PerSample(ch)
        await out.put(micro_batch(0), 0)
        await out.put(micro_batch(1), 0)
        out.close()
        return await ch.get_ready()

    samples = run(go())
    assert [(s.part, s.row, s.rows) for s in samples] == [
        (k, r, 4) for k in (0, 1) for r in range(4)
    ]
    assert all(isinstance(s, Sample) and len(s.traj) == 1 for s in samples)
    joined = Trajectory.concat([s.traj for s in samples[4:]])
    assert torch.equal(joined.x0, micro_batch(1).x0)
    assert torch.equal(joined.prompts.input_ids, micro_batch(1).prompts.input_ids)
    assert joined.prompts.texts == micro_batch(1).prompts.texts


def test_a_required_scorer_failing_on_one_sample_fails_the_step_cleanly():
    scorer = Gated(fail={102})
    with pytest.raises(RewardFailure, match=r"cannot score seed \[102\]"):
        run(run_local(rollout_of(3), pool_of(scorer)))
    # an optional scorer marks that call's rows missing and the step goes on
    got = run(run_local(rollout_of(3), pool_of(Gated(fail={102}), required=False)))
    assert [p.valid.tolist() for p in got.parts] == [[True] * 4, [False] * 4, [True] * 4]


def test_a_failing_rollout_fails_the_step_with_its_own_error():
    async def stream(channel):
        try:
            await channel.put(micro_batch(0), 0)
            raise RuntimeError("the sampler broke")
        finally:
            channel.close()

    with pytest.raises(RuntimeError, match="the sampler broke"):
        run(run_local(stream, pool_of(Gated())))


def test_score_ready_closes_its_output_when_the_scorer_fails():
    async def go():
        samples, out = Channel(), Channel()
        await PerSample(samples).put(micro_batch(0), 0)
        with pytest.raises(RewardFailure):
            await score_ready(samples, out, pool_of(Gated(fail={1})))
        with pytest.raises(Exception, match="closed"):
            await out.get()

    run(go())


def test_a_negative_pool_call_cap_is_a_config_error():
    from diffrl.config import load_config
    from diffrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"reward\.max_batch.*-1.*>= 0"):
        load_config(None, ["reward.max_batch=-1"])
    assert load_config(None, ["reward.max_batch=3"]).reward.max_batch == 3
