"""rollout.engine=scheduler: the training rollout through request-level continuous batching
gives the micro-batch engine's trajectories (latents, per-step log-probs, SDE mask, step
versions, seeds, groups, media), on the tiny DiT and on SD3's tiny configuration, ODE and
FlowGRPO's SDE with its variants; each prompt's group is handed on as it finishes; a tiny
FlowGRPO run trains through it with the same numbers.

Tolerance: when the token budget holds the micro-batch engine's micro-batch (the default:
max_batch samples), every forward takes the same rows as its micro-batch, so the trajectories
are bitwise equal. With another budget the forwards batch other rows: fp32 matmul rounding,
atol 1e-5 on latents and log-probs (their magnitude is ~1)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from sd3_tiny import sd3_tiny
from stream_helpers import stream_parts
from tiny_runs import tiny_run

from diffrl.channel import Channel
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import FieldError
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.types import Trajectory

CPU = torch.device("cpu")
TEXTS = [p.text for p in split_prompts("train")[:5]]
FIELDS = ("x0", "latents", "log_probs", "sde_mask", "step_versions", "seeds", "group", "sigmas")


def pair(model, **kw) -> tuple[RolloutEngine, RolloutEngine]:
    cfg = RolloutConfig(**{"group_size": 2, "num_steps": 3, "max_batch": 4, **kw})
    batch = RolloutEngine(model, cfg, [], CPU)
    sched = RolloutEngine(model, dataclasses.replace(cfg, engine="scheduler"), [], CPU)
    return batch, sched


def prompts_of(model):
    return PromptSet([Prompt(t) for t in TEXTS], model.family.tokenize).all()


def gen(eng: RolloutEngine, prompts, seed: int = 5) -> Trajectory:
    return asyncio.run(eng.generate(prompts, seed, iteration=1))


def assert_same(a: Trajectory, b: Trajectory, atol: float = 0.0) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            torch.testing.assert_close(y, x, rtol=0, atol=atol, msg=name)
    assert a.policy_version == b.policy_version and a.step_spec == b.step_spec
    assert a.prompts.ids_hash == b.prompts.ids_hash and torch.equal(
        a.prompts.input_ids, b.prompts.input_ids
    )
    assert a.extra_fields.keys() == b.extra_fields.keys()
    if not atol:
        for k in a.extra_fields:
            assert torch.equal(a.extra_fields[k], b.extra_fields[k]), k


SDE = {"sampler": "sde", "keep_latents": True, "noise_level": 0.8}
CASES = {
    "ode-bf16": {"ode_dtype": "bfloat16", "keep_latents": True},
    "flow_grpo-cfg": {**SDE, "cfg_scale": 2.0},
    # Flow-GRPO-Fast's window with a bf16 ODE tail, CPS steps, mirrored noise in pairs
    "window-cps-antithetic": {
        **SDE, "num_steps": 4, "sde_window": 2, "sde_window_mode": "random", "sde_step": "cps",
        "noise_level": 0.5, "antithetic_noise": True, "ode_dtype": "bfloat16",
    },
    # BranchGRPO-style tree: one initial noise per group, shared SDE noise in halves
    "tree": {**SDE, "group_size": 4, "max_batch": 8, "shared_init_noise": True,
             "tree_noise": True, "sde_window": 2},
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_same_trajectories_as_the_micro_batch_engine_tiny_dit(tiny_model, case) -> None:
    batch, sched = pair(tiny_model, **CASES[case])
    prompts = prompts_of(tiny_model)
    a, b = gen(batch, prompts), gen(sched, prompts)
    assert_same(a, b)
    if CASES[case].get("sampler") == "sde":
        assert b.sde_mask.any() and (b.log_probs[:, b.sde_mask] != 0).all()


@pytest.mark.parametrize("sampler", ["ode", "sde"])
def test_same_trajectories_as_the_micro_batch_engine_sd3(sampler) -> None:
    model = sd3_tiny()
    batch, sched = pair(model, sampler=sampler, keep_latents=True, num_steps=2)
    prompts = prompts_of(model)
    assert_same(gen(batch, prompts), gen(sched, prompts))


def test_another_budget_batches_other_rows_within_fp32_rounding(tiny_model) -> None:
    batch, sched = pair(tiny_model, **SDE)
    sched = RolloutEngine(
        tiny_model, dataclasses.replace(sched.cfg, token_budget=3 * 2 * 32 * 32), [], CPU
    )  # three groups side by side where the micro-batch engine runs two
    prompts = prompts_of(tiny_model)
    assert_same(gen(batch, prompts), gen(sched, prompts), atol=1e-5)


def test_packed_forwards_give_the_same_trajectories_within_fp32_rounding(tiny_model) -> None:
    batch, _ = pair(tiny_model, **SDE)
    cfg = dataclasses.replace(batch.cfg, engine="scheduler", packed=True, compile=False)
    packed = RolloutEngine(tiny_model, cfg, [], CPU)
    prompts = prompts_of(tiny_model)
    assert_same(gen(batch, prompts), gen(packed, prompts), atol=1e-5)


def test_groups_are_handed_on_as_they_finish_with_the_offered_versions(tiny_model) -> None:
    """Each group goes on the channel right after the forward that finishes it (those that
    finish together as one part: the micro-batch engine's parts, with its budget); a weight
    update applied between two forwards shows in the steps that follow it, as there."""
    engines = pair(tiny_model, **SDE)
    for eng in engines:
        calls = [0]

        def bump(eng=eng, calls=calls) -> None:  # the update lands before the 5th forward
            calls[0] += 1
            eng.version = 1 if calls[0] >= 5 else 0

        eng._apply_offered = bump  # type: ignore[method-assign]
    sched, made = engines[1], []
    real = sched.batcher
    sched.batcher = lambda *a, **kw: made.append(real(*a, **kw)) or made[-1]  # type: ignore[method-assign]

    class Seen(Channel):
        """Records, for each part put, the scheduler's forwards so far."""

        at: list[int] = []

        async def put(self, item, version=0):
            self.at.append(made[0].forwards)
            await super().put(item, version)

    channel = Seen()

    async def collect():
        task = asyncio.create_task(sched.stream(prompts_of(tiny_model), 5, channel))
        parts = [t async for t in channel]
        await task
        return parts

    parts = asyncio.run(collect())
    assert Seen.at == [3, 6, 9]  # each part right after its third step, not at the end
    batch_parts = stream_parts(engines[0], prompts_of(tiny_model), 5)
    assert [p.group.tolist() for p in parts] == [p.group.tolist() for p in batch_parts]
    assert [p.group.tolist() for p in parts] == [[0, 0, 1, 1], [2, 2, 3, 3], [4, 4]]
    # the second part (groups 2, 3) takes step 1 under version 0 and its later steps under 1
    assert parts[1].step_versions[0].tolist() == [0, 1, 1]
    assert_same(Trajectory.concat(batch_parts), Trajectory.concat(parts))


def test_overlap_decode_is_refused_with_the_scheduler() -> None:
    with pytest.raises(FieldError, match="overlap_decode"):
        RolloutConfig(engine="scheduler", overlap_decode=True).validate()


def test_a_flow_grpo_run_trains_through_the_scheduler(tiny_checkpoint, tmp_path) -> None:
    rows = {}
    for engine in ("batch", "scheduler"):
        over = tiny_run(
            tiny_checkpoint, tmp_path / engine, 1, "rollout.num_steps=3", "rollout.max_batch=8",
            f"rollout.engine={engine}",
        )  # fmt: skip
        rows[engine] = read_metrics(
            asyncio.run(train(load_config("recipes/shapes_grpo.yaml", over)))
        )
    a, b = rows["batch"][1], rows["scheduler"][1]
    for key in [k for k in a if k.startswith(("reward/", "actor/loss", "actor/grad_norm"))]:
        assert b[key] == a[key], key
