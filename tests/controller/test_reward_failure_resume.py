"""A required scorer dying mid-run stops training with a clear error, and nothing is lost:
the checkpoints written before the failure resume the run."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_runs import tiny_run

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.reward.pool import RewardFailure
from diffrl.reward.scorer import ScoreResult, register_scorer

CALLS = {"n": 0}


@register_scorer("dies_after_two_calls")
class DiesAfterTwo:
    """Stands in for a reward server that goes away after serving two steps."""

    needs = frozenset({"image"})

    def __init__(self) -> None:
        self.name = "dies_after_two_calls"

    async def score(self, traj):
        CALLS["n"] += 1
        if CALLS["n"] > 2:
            raise ConnectionError("reward server at 127.0.0.1:9 refused the connection")
        g = torch.Generator().manual_seed(CALLS["n"])
        return ScoreResult(torch.rand(len(traj), generator=g), torch.ones(len(traj), dtype=bool))


def config(tiny_checkpoint, out_dir, scorer: str, steps: int, *more: str):
    extra = [
        f"reward.scorers=[{{name: {scorer}}}]",
        "run.save_every=1",
        "rollout.num_steps=2",
        "run.eval_every=100",
        *more,
    ]
    return load_config("recipes/shapes_nft.yaml", tiny_run(tiny_checkpoint, out_dir, steps, *extra))


def test_required_scorer_failure_stops_and_resume_continues(tiny_checkpoint, tmp_path):
    CALLS["n"] = 0
    with pytest.raises(RewardFailure, match="refused the connection"):
        asyncio.run(train(config(tiny_checkpoint, tmp_path, "dies_after_two_calls", 5)))
    ckpts = tmp_path / "shapes_nft" / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000002"  # both good steps were saved
    # the server is back (here: the local verifier); the same run continues from step 2
    # (its scorer's name changes here: a changed training key, allowed explicitly)
    asyncio.run(train(config(tiny_checkpoint, tmp_path, "shapes", 4, "run.allow_changes=true")))
    rows = read_metrics(tmp_path / "shapes_nft")
    trained = [r["step"] for r in rows if "actor/loss" in r]
    assert trained == [1, 2, 3, 4]  # no step lost, none repeated
    assert "reward/dies_after_two_calls/mean" in rows[1] and "reward/shapes/mean" in rows[-1]


@register_scorer("always_fails")
class AlwaysFails:
    """An optional scorer whose server answers every request with an error."""

    needs = frozenset({"image"})

    def __init__(self) -> None:
        self.name = "always_fails"

    async def score(self, traj):
        raise ConnectionError("reward server at 127.0.0.1:9 refused the connection")


def test_optional_scorer_dead_for_n_steps_stops_the_run(tiny_checkpoint, tmp_path):
    """Before: every sample missing, actor/skipped_empty = 1 at every step, exit 0."""
    cfg = load_config(
        "recipes/shapes_nft.yaml",
        tiny_run(
            tiny_checkpoint,
            tmp_path,
            6,
            "reward.scorers=[{name: always_fails, required: false}]",
            "reward.max_dead_steps=2",
            "rollout.num_steps=2",
            "run.eval_every=100",
        ),
    )
    with pytest.raises(RewardFailure, match="'always_fails' failed for every sample 2 steps"):
        asyncio.run(train(cfg))
    rows = read_metrics(tmp_path / "shapes_nft")
    assert [r["step"] for r in rows if "actor/skipped_empty" in r] == [1]  # stopped at step 2
