"""Overrides for short end-to-end runs on the tiny random model (shared by controller tests)."""

from __future__ import annotations

from pathlib import Path


def tiny_run(checkpoint: Path, out_dir: Path, steps: int, *extra: str) -> list[str]:
    """The default recipe shrunk to seconds; ``extra`` overrides come last and win."""
    return [
        f"model.checkpoint={checkpoint}",
        f"run.steps={steps}",
        "data.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.eval_num_steps=2",
        "data.eval_samples_per_prompt=1",
        "probe.mode=off",
        f"run.out_dir={out_dir}",
        "run.tensorboard=false",
        # eager: compiling costs seconds per test (the compiled paths have their own tests,
        # and test_recipes runs the default recipe as it ships)
        "rollout.compile=false",
        "actor.compile=false",
        *extra,
    ]
