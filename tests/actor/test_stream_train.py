"""``run.stream_train`` (the actor's begin_stream / train_part / end_stream, and
``controller.sync.StreamedUpdate``): parts fed in the batched update's order give its update bit
for bit; a filtered-out row rescales to the mean over the rows that came; a tiny run streams
and learns; the layouts it cannot run are refused before any work."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from tiny_runs import tiny_run

from diffrl.build import build
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.engines import ActorEngineProtocol
from diffrl.errors import ConfigError

RECIPE = "recipes/shapes_nft.yaml"
PARTIAL = "reward.scorers=[{name: shapes, weight: 1.0, required: true, params: {mode: partial}}]"


def two_actors(tiny_model, actor_factory):
    out = []
    for _ in range(2):
        torch.manual_seed(0)  # the same LoRA init
        actor = actor_factory(copy.deepcopy(tiny_model), micro_batch=2)
        actor.gen.manual_seed(7)
        out.append(actor)
    return out


def test_parts_in_the_batched_order_are_the_batched_update(
    tiny_model, actor_factory, train_batch_factory
):
    batch = train_batch_factory(6)
    whole, streamed = two_actors(tiny_model, actor_factory)
    assert isinstance(streamed, ActorEngineProtocol)
    m_whole = whole.train_step(batch)
    # the same rows, in the order train_step's shuffle puts them, cut at a micro-batch edge
    order = batch.select(torch.randperm(6, generator=streamed.gen))
    streamed.begin_stream(6)
    streamed.train_part(order.select(torch.arange(0, 4)))
    streamed.train_part(order.select(torch.arange(4, 6)))
    m_stream = streamed.end_stream()
    assert m_stream == m_whole
    for a, b in zip(whole.params, streamed.params, strict=True):
        assert torch.equal(a, b)
    assert whole.version == streamed.version == 1


def test_rows_filtered_out_rescale_to_the_mean_of_those_that_came(
    tiny_model, actor_factory, train_batch_factory
):
    """Expected 8, 6 arrive (a group filtered): the step is the mean over the 6, as the
    batched update of those 6 takes it."""
    batch = train_batch_factory(6)
    whole, streamed = two_actors(tiny_model, actor_factory)
    whole.train_step(batch)
    order = batch.select(torch.randperm(6, generator=streamed.gen))
    streamed.begin_stream(8)
    streamed.train_part(order.select(torch.arange(0, 2)))
    streamed.train_part(order.select(torch.arange(0)))  # an empty part: nothing to do
    streamed.train_part(order.select(torch.arange(2, 6)))
    streamed.end_stream()
    # the (clipped) gradients the step took; rescaling rounds differently. Not the weights:
    # Adam's first step is about lr x sign(grad), so a rounding-sized gradient can flip one
    for a, b in zip(whole.params, streamed.params, strict=True):
        floor = 1e-6 * float(a.grad.abs().max())
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=floor)
    streamed.begin_stream(8)
    assert streamed.end_stream() == {"actor/skipped_empty": 1.0}
    assert streamed.version == 1


def test_a_tiny_run_streams_its_update(tiny_checkpoint, tmp_path):
    """4 micro-batches per step: the update trains while the rollout samples. Step 1's samples
    come from the untrained policy in both modes (the same rows); the update then moves."""
    rows = {}
    for mode in ("batched", "streamed"):
        over = tiny_run(
            tiny_checkpoint, tmp_path / mode, 3, "rollout.num_steps=2", "actor.lr=1e-2",
            "data.prompts_per_step=4", "rollout.max_batch=4", PARTIAL,
            f"run.stream_train={mode == 'streamed'}",
        )  # fmt: skip
        rows[mode] = read_metrics(asyncio.run(train(load_config(RECIPE, over))))
    b, s = rows["batched"], rows["streamed"]
    assert [r["step"] for r in s] == [0, 1, 2, 3]
    for key in [k for k in b[1] if k.startswith("reward/")]:
        assert s[1][key] == b[1][key], key
    assert all(s[i]["actor/grad_norm"] > 0 for i in (1, 2, 3))
    assert s[1]["actor/loss"] == pytest.approx(b[1]["actor/loss"], rel=0.5)  # same scale


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["run.mode=async"], r"'run.mode' = 'async': run.stream_train streams the sync"),
        (["actor.minibatches=2"], r"'actor.minibatches' = 2: run.stream_train takes one"),
        (["algorithm.global_std=true"], r"'algorithm.global_std' = True: .*whole batch"),
    ],
)
def test_what_streaming_cannot_run_is_refused(tiny_checkpoint, tmp_path, extra, says):
    over = tiny_run(tiny_checkpoint, tmp_path, 1, "run.stream_train=true", *extra)
    with pytest.raises(ConfigError, match=says):
        build(load_config(RECIPE, over))
