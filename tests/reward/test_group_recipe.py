"""recipes/shapes_grpo_pref.yaml (Pref-GRPO win rates from a group scorer) trains two steps
through the real CLI at the smallest size: one prompt, a group of 2, 2 denoising steps."""

from __future__ import annotations

import json

from tiny_runs import tiny_run

from diffrl.cli import main


def test_the_group_scorer_recipe_trains_two_steps(tiny_checkpoint, tmp_path) -> None:
    small = ("data.prompts_per_step=1", "rollout.group_size=2", "rollout.num_steps=2",
             "data.eval_prompts=1", "actor.micro_batch=2")  # fmt: skip
    argv = tiny_run(tiny_checkpoint, tmp_path, 2, *small)
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
