"""rollout.overlap_decode: a micro-batch's media decoded in a second worker while the next one
denoises give the same trajectories, in the same order, as decoding in line; a decode that
fails fails the stream, which still closes its channel."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from stream_helpers import stream_parts

from diffrl.channel import Channel
from diffrl.models.registry import ModelConfig, load_model
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import Prompt, PromptSet

TEXTS = ["a red circle", "a blue square", "a green star", "two yellow dots", "one big cross"]


def engines():
    model = load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
    cfg = RolloutConfig(group_size=2, num_steps=2, max_batch=4)
    cpu = torch.device("cpu")
    plain = RolloutEngine(model, cfg, [], cpu)
    overlapped = RolloutEngine(model, replace(cfg, overlap_decode=True), [], cpu)
    prompts = PromptSet([Prompt(t) for t in TEXTS], model.family.tokenize).all()
    return plain, overlapped, prompts


def test_overlapped_decode_streams_the_same_trajectories_in_order():
    plain, overlapped, prompts = engines()
    a, b = stream_parts(plain, prompts, 3), stream_parts(overlapped, prompts, 3)
    assert len(a) == len(b) == 3  # 5 prompts, 2 per micro-batch
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.group, y.group) and torch.equal(x.x0, y.x0)
        assert x.extra_fields.keys() == y.extra_fields.keys() == {"image"}
        assert torch.equal(x.extra_fields["image"], y.extra_fields["image"])


def test_a_failed_decode_fails_the_stream_and_closes_the_channel(monkeypatch):
    _, overlapped, prompts = engines()
    calls = []
    real = overlapped.family.decode

    def decode(x0):
        calls.append(len(x0))
        if len(calls) == 2:
            raise RuntimeError("vae out of memory")
        return real(x0)

    monkeypatch.setattr(overlapped.family, "decode", decode)
    channel = Channel()

    async def run():
        producer = asyncio.create_task(overlapped.stream(prompts, 3, channel))
        got = [t async for t in channel]
        with pytest.raises(RuntimeError, match="vae out of memory"):
            await producer
        return got

    got = asyncio.run(run())
    assert len(got) == 1  # the first micro-batch arrived; the channel was closed after
