"""No silent no-op (issue 41, finding 4): a group of one is refused with the config for every
algorithm, and a run whose updates change nothing stops after ``run.max_dead_steps`` of them
(the real-CLI case is in ``test_resume_faults.py``, on a resumed run)."""

from __future__ import annotations

import pytest

from diffrl.algorithms.registry import get_algorithm, registered_algorithms
from diffrl.config import load_config
from diffrl.controller.dead_steps import DeadSteps, NoProgress, dead_cause
from diffrl.errors import ConfigError

RECIPES = {
    "diffusion_nft": "recipes/shapes_nft.yaml",
    "flow_grpo": "recipes/shapes_grpo.yaml",
    "diffusion_dpo": "recipes/shapes_dpo.yaml",
    "grpo_guard": "recipes/shapes_grpo_guard.yaml",
    "flow_dppo": "recipes/shapes_dppo.yaml",
    "awm": "recipes/shapes_awm.yaml",
    "dgpo": "recipes/shapes_dgpo.yaml",
    "opd": "recipes/shapes_opd.yaml",
    "omni_ppo": "recipes/omni_shapes_ppo.yaml",
}


@pytest.mark.parametrize("algorithm", registered_algorithms())
def test_every_algorithm_refuses_a_group_of_one(algorithm) -> None:
    recipe = RECIPES[algorithm]  # a new algorithm: add its recipe here, and decide
    if not get_algorithm(algorithm).needs_groups:  # distillation: each sample alone
        assert load_config(recipe, ["rollout.group_size=1"]).rollout.group_size == 1
        return
    with pytest.raises(ConfigError, match=f"'rollout.group_size' = 1: {algorithm} needs at least"):
        # (mirrored noise needs an even group, and would refuse 1 for its own reason)
        load_config(recipe, ["rollout.antithetic_noise=false", "rollout.group_size=1"])
    assert load_config(recipe, ["rollout.group_size=2"]).rollout.group_size == 2


LIVE = {"actor/grad_norm": 0.3, "reward/tied_groups": 0.5}
DEAD = {
    "zero gradient": ({"actor/grad_norm": 0.0, "reward/tied_groups": 1.0}, "exactly 0"),
    "non-finite": ({"actor/loss": float("nan"), "actor/skipped_nonfinite": 1.0}, "NaN/inf"),
    "no rows": ({"actor/skipped_empty": 1.0}, "no sample was left to train on"),
    "inf gradient": ({"actor/grad_norm": float("inf")}, "NaN/inf"),
}


@pytest.mark.parametrize("case", DEAD)
def test_a_dead_update_is_named(case) -> None:
    metrics, why = DEAD[case]
    assert why in dead_cause(metrics)
    assert dead_cause(LIVE) is None
    assert dead_cause({"actor/loss": 0.1}) is None  # an engine that reports no norm: not judged
    # minibatches: the step's norm is their mean, live when any of them moved the weights
    assert dead_cause({"actor/grad_norm": 0.05, "actor/skipped_nonfinite": 0.5}) is None


def test_dead_steps_running_stop_the_run_and_a_live_one_resets_the_count() -> None:
    dead = DeadSteps(3)
    zero = DEAD["zero gradient"][0]
    for step, metrics in enumerate([zero, zero, LIVE, zero, zero], start=1):
        dead.observe(step, metrics)  # never 3 running
    with pytest.raises(NoProgress, match=r"steps 4\.\.6 trained nothing \(run.max_dead_steps=3\)"):
        dead.observe(6, DEAD["no rows"][0])
    off = DeadSteps(0)
    for step in range(1, 50):
        off.observe(step, zero)


def test_max_dead_steps_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_dead_steps"):
        load_config(RECIPES["diffusion_nft"], ["run.max_dead_steps=-1"])
    assert load_config(RECIPES["diffusion_nft"]).run.max_dead_steps == 5
