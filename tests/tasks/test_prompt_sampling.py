"""Spread sampling of training prompts: weighted by the reward spread of earlier steps,
deterministic in the step, exactly resumable, and refused where it cannot be exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffrl.config import load_config
from diffrl.errors import ConfigError
from diffrl.models.family import TokenBatch, hash_rows
from diffrl.tasks import Prompt, PromptSet, PromptSource, SpreadSampler, TaskConfig, prompt_source

N, PER_STEP, G = 20, 4, 4


def tokenize(texts: list[str]) -> TokenBatch:
    ids = torch.tensor([[1 + int(t.split()[-1])] for t in texts])
    return TokenBatch(ids, ids != 0, hash_rows(ids))


def prompt_set() -> PromptSet:
    return PromptSet([Prompt(f"prompt {i}") for i in range(N)], tokenize)


def spread_source(seed: int = 0) -> PromptSource:
    return prompt_source(
        prompt_set(), TaskConfig(prompts_per_step=PER_STEP, sampling="spread"), seed
    )


def rewards_for(ids: torch.Tensor) -> torch.Tensor:
    """Prompts 0-9 always pass (no spread); 10-19 pass half the time."""
    r = torch.ones(len(ids))
    hard = ids >= 10
    r[hard] = torch.arange(len(ids))[hard].remainder(2).float()
    return r


def step_rows(source: PromptSource, step: int):
    ids = source.at(step).prompt_ids.repeat_interleave(G)  # (B,) a group per prompt
    return ids, rewards_for(ids), torch.ones(len(ids), dtype=torch.bool)


def drive(source: PromptSource, steps: range) -> list[list[int]]:
    """The sync loop's order: draw step k, score it, observe it."""
    drawn = []
    for k in steps:
        ids, r, ok = step_rows(source, k)
        drawn.append(source.at(k).prompt_ids.tolist())
        source.observe(k, ids, r, ok)
    return drawn


def test_uniform_is_the_default_and_spread_is_validated() -> None:
    assert TaskConfig().sampling == "uniform"
    assert prompt_source(prompt_set(), TaskConfig(), 0).sampler is None
    with pytest.raises(ConfigError, match="sampling"):
        load_config(None, ["data.sampling=greedy"])
    with pytest.raises(ConfigError, match="sampling_floor"):
        load_config(None, ["data.sampling=spread", "data.sampling_floor=0"])


def test_spread_prompts_are_drawn_more_often_and_none_is_starved() -> None:
    sampler = SpreadSampler(N, floor=0.2)
    ids = torch.arange(N).repeat_interleave(G)
    sampler.observe(0, ids, rewards_for(ids), torch.ones(len(ids), dtype=torch.bool))
    p = sampler.probabilities(1)
    assert p.sum() == pytest.approx(1.0)
    assert np.allclose(p[:10], 0.2 / N)  # no spread: only the uniform floor
    assert np.allclose(p[10:], 0.8 / 10 + 0.2 / N)
    source = spread_source()
    drawn = np.concatenate(drive(source, range(60)))
    hard = (drawn >= 10).mean()
    assert hard > 0.75, hard  # uniform would draw about 0.5
    assert len(set(drawn.tolist())) == N  # every prompt still comes up


def test_unseen_prompts_count_as_the_most_spread_out_and_invalid_rows_are_ignored() -> None:
    sampler = SpreadSampler(4, floor=0.5)
    ids = torch.tensor([0, 0, 1, 1, 2])
    ok = torch.tensor([True, True, True, True, False])
    sampler.observe(0, ids, torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0]), ok)
    p = sampler.probabilities(1)
    # prompt 0: spread 0.5; prompt 1: 0; prompts 2 (one invalid row) and 3 unseen: 0.5 each
    assert p == pytest.approx([1 / 6 + 1 / 8, 1 / 8, 1 / 6 + 1 / 8, 1 / 6 + 1 / 8])


def test_a_draw_depends_on_earlier_steps_only() -> None:
    """The prefetch samples step k+1 while update k runs; its rewards may be observed before or
    after the draw of step k+1 (and before step k+2's): the draws must not care."""
    a, b = spread_source(), spread_source()
    drive(a, range(3))
    drive(b, range(3))
    ids, r, ok = step_rows(b, 3)
    b.observe(3, ids, r, ok)  # step 3's rewards already in, step 3's draw asked again
    assert b.at(3).prompt_ids.tolist() == a.at(3).prompt_ids.tolist()
    assert drive(a, range(3, 10))[1:] == drive(b, range(4, 10))


def test_resumed_draws_equal_the_uninterrupted_ones() -> None:
    straight = spread_source()
    drawn = drive(straight, range(12))
    first = spread_source()
    drive(first, range(5))
    ids, r, ok = step_rows(first, 5)
    first.observe(5, ids, r, ok)  # the prefetched step 5, scored before the checkpoint at 5
    state = first.state_dict(5)
    resumed = spread_source()
    resumed.load_state_dict(state, 5)
    assert drive(resumed, range(5, 12)) == drawn[5:]
    fresh = spread_source()  # without the state the later draws differ: the test can fail
    fresh.load_state_dict({}, 5)
    assert drive(fresh, range(5, 12)) != drawn[5:]


def test_a_late_observation_and_a_foreign_state_are_errors() -> None:
    source = spread_source()
    drive(source, range(3))
    source.at(5)
    ids, r, ok = step_rows(source, 4)
    with pytest.raises(RuntimeError, match="run.mode=sync"):
        source.observe(4, ids, r, ok)
    with pytest.raises(ValueError, match="training prompts"):
        source.load_state_dict({"spread": [0.0], "seen": [True]}, 3)


def test_spread_sampling_is_refused_where_it_cannot_be_exact() -> None:
    with pytest.raises(ConfigError, match="run.mode=sync"):  # at load time, before any work
        load_config(None, ["data.sampling=spread", "run.mode=async"])
    cfg = load_config(None, ["data.sampling=spread"])
    with pytest.raises(ConfigError, match="data-parallel"):
        cfg.data.check_loop(cfg.run.mode, dp_size=2)
    cfg.data.check_loop(cfg.run.mode)
    cfg = load_config(None, ["run.mode=async"])
    cfg.data.check_loop(cfg.run.mode, dp_size=2)
