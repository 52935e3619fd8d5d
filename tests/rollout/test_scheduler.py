"""Request-level continuous batching: the same latents as unbatched generation, step-level
admission into a running bucket, buckets per shape, streaming hand-back, max-wait, bad input."""

from __future__ import annotations

import pytest
import torch

from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.rollout.samplers import sigma_schedule
from diffrl.rollout.scheduler import ContinuousBatcher, Request, tokens
from diffrl.tasks.shapes.prompts import split_prompts

CPU = torch.device("cpu")


def engine(model, **kw) -> RolloutEngine:
    return RolloutEngine(model, RolloutConfig(**kw), [], CPU)


def requests(model, steps: list[int], g: int = 2) -> list[Request]:
    texts = [p.text for p in split_prompts("train")[: len(steps)]]
    ids = model.family.tokenize(texts).input_ids
    shape = tuple(model.family.latent_shape())
    return [Request(ids[k], torch.arange(g) + 100 * k, shape, n) for k, n in enumerate(steps)]


def unbatched(eng: RolloutEngine, req: Request) -> torch.Tensor:
    """The rollout engine's own ODE path for one request (its seeds, its step count)."""
    sigmas = sigma_schedule(req.num_steps, eng.cfg.shift)
    mask = torch.zeros(req.num_steps, dtype=torch.bool)
    ids = req.input_ids.expand(len(req.seeds), -1)
    x0, _, _, _ = eng._sample(ids, req.seeds, sigmas, mask, len(req.seeds))
    return x0


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_same_latents_as_unbatched_generation(tiny_model, cfg_scale) -> None:
    eng = engine(tiny_model, cfg_scale=cfg_scale, shift=2.0)
    reqs = requests(tiny_model, [4, 10, 6, 10, 3], g=3)
    per_request = tokens(reqs[0].shape) * 3
    batcher = eng.batcher(token_budget=3 * per_request)  # three requests run side by side
    for r in reqs:
        batcher.submit(r)
    got = {f.request.rid: f for f in batcher.run()}
    assert sorted(got) == [r.rid for r in reqs]
    for r in reqs:
        # fp32 on CPU: batched and unbatched matmuls differ by float rounding only
        torch.testing.assert_close(got[r.rid].x0, unbatched(eng, r), rtol=0, atol=1e-5)
        assert got[r.rid].media["image"].shape == (3, 32, 32, 3)
    assert batcher.forwards < sum(r.num_steps for r in reqs)  # it did batch


def test_step_level_admission_and_streaming_order(tiny_model) -> None:
    eng = engine(tiny_model)
    long, short1, short2 = requests(tiny_model, [10, 2, 2], g=1)
    batcher = eng.batcher(token_budget=2 * tokens(long.shape))  # room for two at a time
    for r in (long, short1, short2):
        batcher.submit(r)
    order, forwards_at = [], {}
    while not batcher.idle:
        for f in batcher.step():
            order.append(f.request.rid)
            forwards_at[f.request.rid] = batcher.forwards
    # short2 waited for short1's slot, joined `long` mid-way, and both shorts finished first
    assert order == [short1.rid, short2.rid, long.rid]
    assert forwards_at == {short1.rid: 2, short2.rid: 4, long.rid: 10}
    assert batcher.forwards == 10  # against 14 one request at a time


def fake_velocity(calls: list):
    def velocity(x, sigma, ids):
        calls.append(tuple(x.shape))
        return x * 0.5 + sigma.view(-1, *([1] * (x.ndim - 1)))

    return velocity


def test_buckets_by_shape_and_a_request_over_budget_runs_alone() -> None:
    calls: list = []
    b = ContinuousBatcher(fake_velocity(calls), CPU, token_budget=64)
    ids = torch.zeros(3, dtype=torch.long)
    small, big = (1, 4, 4), (1, 16, 16)  # 16 and 256 positions
    for k, shape in enumerate([small, big, small, small]):
        b.submit(Request(ids, torch.tensor([k]), shape, 2))
    done = list(b.run())
    assert sorted(f.request.rid for f in done) == [0, 1, 2, 3]
    assert {s for s in calls} == {(3, 1, 4, 4), (1, 1, 16, 16)}  # never mixed shapes
    assert all(f.x0.shape[1:] == f.request.shape for f in done)


def test_max_wait_holds_a_partial_bucket_for_a_full_one() -> None:
    now = [0.0]
    calls: list = []
    b = ContinuousBatcher(
        fake_velocity(calls), CPU, token_budget=32, max_wait_s=5.0, clock=lambda: now[0]
    )
    ids = torch.zeros(3, dtype=torch.long)
    b.submit(Request(ids, torch.tensor([0]), (1, 4, 4), 3))  # partial bucket: 16 of 32
    b.submit(Request(ids, torch.tensor([1]), (1, 2, 8), 3))  # another shape, full at 2 requests
    b.submit(Request(ids, torch.tensor([2]), (1, 2, 8), 3))
    b.submit(Request(ids, torch.tensor([3]), (1, 2, 8), 3))  # waits for room: the bucket is full
    b.step()
    assert calls[-1] == (2, 1, 2, 8)  # the full bucket went before the older, partial one
    now[0] = 6.0  # the oldest request has now waited past max_wait
    b.step()
    assert calls[-1] == (1, 1, 4, 4)


def test_bad_requests_are_refused() -> None:
    b = ContinuousBatcher(fake_velocity([]), CPU, token_budget=16)
    ids = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="seeds"):
        b.submit(Request(ids, torch.tensor([], dtype=torch.long), (1, 4, 4), 2))
    with pytest.raises(ValueError, match="num_steps"):
        b.submit(Request(ids, torch.tensor([0]), (1, 4, 4), 0))
    with pytest.raises(ValueError, match=r"\(L,\)"):
        b.submit(Request(ids[None], torch.tensor([0]), (1, 4, 4), 2))
    b.submit(Request(ids, torch.tensor([0]), (1, 4, 4), 2, rid=7))
    with pytest.raises(ValueError, match="in flight"):
        b.submit(Request(ids, torch.tensor([1]), (1, 4, 4), 2, rid=7))
    with pytest.raises(ValueError, match="token_budget"):
        ContinuousBatcher(fake_velocity([]), CPU, token_budget=0)
    with pytest.raises(ValueError, match="null_ids"):
        ContinuousBatcher(fake_velocity([]), CPU, token_budget=8, cfg_scale=2.0)
