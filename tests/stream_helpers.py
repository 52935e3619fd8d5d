"""A helper the rollout tests share (a plain module: pytest binds the name `conftest` to
whichever conftest.py it imported last, so tests past tests/reward/ cannot import from it)."""

from __future__ import annotations

import asyncio

from diffrl.channel import Channel


def stream_parts(engine, prompts, seed: int) -> list:
    """The trajectories ``engine.stream`` puts into its channel, in order."""

    async def collect():
        channel = Channel()
        task = asyncio.create_task(engine.stream(prompts, seed, channel))
        parts = [t async for t in channel]
        await task
        return parts

    return asyncio.run(collect())
