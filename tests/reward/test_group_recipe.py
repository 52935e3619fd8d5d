"""recipes/shapes_grpo_pref.yaml (Pref-GRPO win rates from a group scorer) trains two steps
through the real CLI at the smallest size: one prompt, a group of 2, 2 denoising steps; and
with a second reward under GDPO aggregation."""

from __future__ import annotations

import json

import pytest
from tiny_runs import tiny_run

from diffrl.cli import main

SMALL = ("data.prompts_per_step=1", "rollout.group_size=2", "rollout.num_steps=2",
         "data.eval_prompts=1", "actor.micro_batch=2")  # fmt: skip
GDPO = (
    "reward.aggregate=gdpo",
    "algorithm.global_std=true",
    "reward.scorers=[{name: pairwise_rank, params: {judge: shapes, judge_params: {mode: graded}}},"
    " {name: shapes, label: strict, weight: 0.5, params: {mode: overall}}]",
)


@pytest.mark.parametrize("extra", [(), GDPO], ids=["win_rates", "gdpo"])
def test_the_group_scorer_recipe_trains_two_steps(extra, tiny_checkpoint, tmp_path) -> None:
    argv = tiny_run(tiny_checkpoint, tmp_path, 2, *SMALL, *extra)
    assert main(["train", "recipes/shapes_grpo_pref.yaml", *argv]) == 0
    lines = (tmp_path / "shapes_grpo_pref" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        # win rates within a group always average 1/2; the judge's own accuracy rides along
        assert r["reward/pairwise_rank/mean"] == 0.5
        assert 0.0 <= r["reward/pairwise_rank/judge/accuracy"] <= 1.0
        assert r["reward/pairwise_rank/failed_groups"] == 0.0
        assert "actor/loss" in r
        if extra:  # each reward normalised in its group: the combined reward averages 0
            assert abs(r["reward/mean"]) < 1e-6 and "reward/strict/mean" in r
