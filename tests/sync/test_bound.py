"""The bound-module gate (diffrl/sync/bound.py): every declared LoRA target binds modules in
the actor and in the rollout copy, the same ones, of the same shapes and dtypes; anything else
stops the run at start-up naming the target, the module and the family."""

from __future__ import annotations

import copy

import pytest
import torch
from sync_faults import TINY_FAMILY_PRESETS
from tiny_runs import tiny_run

import diffrl.build as build_mod
from diffrl.actor.engine import ActorConfig, ActorEngine
from diffrl.algorithms.diffusion_nft import NFTConfig
from diffrl.algorithms.registry import get_algorithm
from diffrl.build import build, expanded_targets
from diffrl.config import load_config
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.sync.bound import BoundModuleError, check_bound

RECIPE = "recipes/shapes_nft.yaml"
CPU = torch.device("cpu")
FAMILY_PRESETS = [("tiny_dit", ""), *TINY_FAMILY_PRESETS]


def _sides(base, targets):
    """The rollout copy (serving layout applied) and the actor over ``base``, as build makes
    them."""
    rollout = RolloutEngine(base, RolloutConfig(), expanded_targets(base, targets), CPU)
    actor = ActorEngine(
        base, ActorConfig(), targets, get_algorithm("diffusion_nft"), NFTConfig(), CPU
    )
    return actor, rollout


@pytest.mark.parametrize("family, preset", FAMILY_PRESETS)
def test_every_family_binds_every_target_in_actor_and_rollout(family, preset) -> None:
    from diffrl.models.registry import ModelConfig, load_model

    if family != "tiny_dit":
        pytest.importorskip("diffusers")
    torch.manual_seed(0)
    base = load_model(ModelConfig(family=family, preset=preset))
    targets = list(base.family.lora_targets)
    actor, rollout = _sides(base, targets)
    report = check_bound(targets, base.family.name, actor.bound, rollout.bound)
    # the count is on the modules the rollout receives, before its serving layout fuses them
    assert report.bound == report.declared == len(rollout.target.expected) > 0
    assert sum(report.per_target.values()) >= report.bound  # a module may match two suffixes
    assert all(n > 0 for n in report.per_target.values())
    assert report.line().startswith(f"LoRA on {report.bound} of {report.bound} target modules")
    print(f"{family}: {report.line()}")
    # a module the rollout copy lacks, or holds in another shape or dtype, is named
    first = sorted(rollout.bound)[0]
    fewer = {k: v for k, v in rollout.bound.items() if k != first}
    with pytest.raises(BoundModuleError, match=f"{first} is in the actor's adapter but not"):
        check_bound(targets, base.family.name, actor.bound, fewer)
    (out, cols), dtype = rollout.bound[first]
    for other in (((out, cols + 1), dtype), ((out, cols), torch.bfloat16)):
        with pytest.raises(BoundModuleError, match=f"LoRA module {first} .*{family}"):
            check_bound(targets, base.family.name, actor.bound, {**rollout.bound, first: other})


def test_a_target_that_binds_nothing_raises(tiny_model) -> None:
    targets = list(tiny_model.family.lora_targets)
    with pytest.raises(BoundModuleError, match=r"'attn\.nope' binds no module .*family tiny_dit"):
        expanded_targets(tiny_model, [*targets, "attn.nope"])
    with pytest.raises(BoundModuleError, match=r"\['attn\.nope'\] bind no module .*tiny_dit"):
        expanded_targets(tiny_model, ["attn.nope"])
    # the actor alone: its adapter binds a suffix the rollout copy's check never saw
    actor, rollout = _sides(copy.deepcopy(tiny_model), targets)
    with pytest.raises(BoundModuleError, match="'attn.nope' binds no module of the actor"):
        check_bound([*targets, "attn.nope"], "tiny_dit", actor.bound, rollout.bound)


def test_build_refuses_a_run_bound_to_nothing(tiny_checkpoint, tmp_path) -> None:
    """actor.lora.targets naming a module nothing has stops the run at start-up."""
    over = tiny_run(tiny_checkpoint, tmp_path, 1, "actor.lora.targets=[attn.to_nothing]")
    with pytest.raises(BoundModuleError, match=r"attn\.to_nothing.*family tiny_dit"):
        build(load_config(RECIPE, over))


def test_build_refuses_a_rollout_that_receives_other_targets(
    tiny_checkpoint, tmp_path, monkeypatch
) -> None:
    """The rollout copy given one module fewer than the actor trains (a changed target list on
    one side) stops the run at start-up, naming the module; the normal build passes and
    counts."""
    cfg = load_config(RECIPE, tiny_run(tiny_checkpoint, tmp_path, 1))
    parts = build(cfg)
    assert parts.bound is not None and parts.bound.bound == parts.bound.declared > 0
    asyncio_close(parts)
    real = build_mod.expanded_targets
    dropped: list[str] = []

    def fewer(model, targets):
        names = real(model, targets)
        dropped.append(names[-1])
        return names[:-1]

    monkeypatch.setattr(build_mod, "expanded_targets", fewer)
    with pytest.raises(BoundModuleError, match="is in the actor's adapter but not") as e:
        build(cfg)
    assert dropped[0] in str(e.value)


def asyncio_close(parts) -> None:
    import asyncio

    asyncio.run(parts.aclose())
