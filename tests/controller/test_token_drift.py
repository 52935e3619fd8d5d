"""Contract 3 through the real loop: a prompt whose ids change after the data stage tokenized
them (a re-tokenisation on the way, one id changed in the channel) stops the run at its first
step with ``ContractError`` naming token drift, the place and the rows; and each Ray host checks
what it receives against the hashes that travel with the record (``backends/ray.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from tiny_runs import tiny_run

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import ContractError
from diffrl.models.family import TokenBatch, hash_rows
from diffrl.reward.edges import PerSample
from diffrl.tasks.base import PromptSet
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.tokenizer import WordTokenizer
from diffrl.types import PromptBatch, TrainBatch, Trajectory

RECIPE = "recipes/shapes_nft.yaml"


def _one_id_changed(ids: torch.Tensor, row: int) -> torch.Tensor:
    out = ids.clone()
    out[row, 0] = out[row, 0] + 1  # as a tokenizer with another vocabulary would give
    return out


def _run(checkpoint: Path, out: Path) -> Path:
    over = tiny_run(checkpoint, out, 2, "rollout.num_steps=2", "run.eval_every=1")
    return asyncio.run(train(load_config(RECIPE, over)))


def test_an_id_changed_in_the_channel_stops_the_first_step(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trajectories reach the controller with one id of row 1 changed: the held-out eval
    (which trains nothing) passes, the first update refuses, nothing is trained."""
    put = PerSample.put  # the rollout -> reward edge, a micro-batch at a time

    async def drifting_put(self, record, version):
        if isinstance(record, Trajectory):
            ids = _one_id_changed(record.prompts.input_ids, 1)
            record = dataclasses.replace(
                record, prompts=dataclasses.replace(record.prompts, input_ids=ids)
            )
        await put(self, record, version)

    monkeypatch.setattr(PerSample, "put", drifting_put)
    with pytest.raises(ContractError, match=r"token drift at the actor: input_ids of rows \[1\]"):
        _run(tiny_checkpoint, tmp_path)
    (root,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert [r["step"] for r in read_metrics(root)] == [0]  # the step-0 eval only
    assert not list((root / "checkpoints").glob("step_*"))


def test_a_retokenised_prompt_stops_the_rollout(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data stage's batch is re-tokenised on its way to the rollout (its hashes kept):
    the rollout refuses before it samples anything."""
    batch = PromptSet.batch

    def retokenised(self, index) -> PromptBatch:
        b = batch(self, index)
        return dataclasses.replace(b, input_ids=_one_id_changed(b.input_ids, len(b) - 1))

    monkeypatch.setattr(PromptSet, "batch", retokenised)
    with pytest.raises(ContractError, match=r"token drift at the rollout engine: input_ids"):
        _run(tiny_checkpoint, tmp_path)


# --- the Ray hosts, called as Ray calls them (without a cluster: the check needs none) -----


class _Engine:
    """Stands in for a host's engine; a call reaching it means the host let the record in."""

    def __init__(self) -> None:
        self.calls = self.version = 0

    def train_step(self, batch):
        self.calls += 1
        return {}

    def train_part(self, part) -> None:
        self.calls += 1

    async def generate(self, prompts, seed, **kw):
        self.calls += 1
        return prompts


def _prompts() -> PromptBatch:
    """Three prompts with conditions, made as the data stage makes them (``PromptSet``)."""
    tok = WordTokenizer()

    def tokenize(texts: list[str]) -> TokenBatch:
        ids = tok.encode(texts)
        return TokenBatch(ids, ids != tok.pad_id, hash_rows(ids))

    cond = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))
    return PromptSet(split_prompts("train")[:3], tokenize, cond).all()


def _train_batch(p: PromptBatch) -> TrainBatch:
    n = len(p)
    return TrainBatch(
        input_ids=p.input_ids,
        ids_hash=p.ids_hash,
        cond=p.cond,
        cond_hash=p.cond_hash,
        x0=torch.zeros(n, 3, 4, 4),
        optimality=torch.ones(n),
        seeds=torch.arange(n),
    )


def test_each_ray_host_checks_what_it_receives() -> None:
    from diffrl.backends.ray import ActorHost, RolloutHost

    prompts = _prompts()
    rollout, engine = RolloutHost.__new__(RolloutHost), _Engine()
    rollout.engines = {"rollout": engine}
    frame = prompts.cond.clone()
    frame[2, 1] += 1.0  # the last keyframe of row 2
    for bad, what in (
        (
            dataclasses.replace(prompts, input_ids=_one_id_changed(prompts.input_ids, 0)),
            "input_ids",
        ),
        (dataclasses.replace(prompts, cond=frame), "cond"),
    ):
        with pytest.raises(ContractError, match=rf"the Ray rollout host \(pid \d+\): {what}"):
            asyncio.run(rollout.generate("rollout", bad, 0, {}))
    assert engine.calls == 0
    asyncio.run(rollout.generate("rollout", prompts, 0, {}))
    assert engine.calls == 1

    actor, engine = ActorHost.__new__(ActorHost), _Engine()
    actor.actor = engine
    batch = _train_batch(prompts)
    drifted = dataclasses.replace(batch, cond=torch.zeros_like(batch.cond))
    with pytest.raises(
        ContractError, match=r"the Ray actor host \(pid \d+\): cond .* rows \[0, 1, 2\]"
    ):
        actor.train_step(drifted)
    with pytest.raises(ContractError, match=r"the Ray actor host"):
        actor.train_part(drifted)
    assert engine.calls == 0
    actor.train_part(batch)
    assert engine.calls == 1
