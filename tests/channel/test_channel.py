"""The in-process channel: FIFO, close-after-drain, back-pressure, staleness bound."""

from __future__ import annotations

import asyncio

import pytest

from diffrl.channel import Channel, ChannelClosed, StaleRecord


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=5))


def test_fifo_order() -> None:
    async def go():
        ch = Channel()
        for i in range(5):
            await ch.put(f"r{i}", version=i)
        assert ch.qsize() == 5
        return [await ch.get() for _ in range(5)]

    assert run(go()) == ["r0", "r1", "r2", "r3", "r4"]


def test_close_ends_iteration_after_draining() -> None:
    async def go():
        ch = Channel()
        for i in range(3):
            await ch.put(i, 0)
        ch.close()
        got = [r async for r in ch]
        with pytest.raises(ChannelClosed):
            await ch.get()  # still closed for a later consumer
        with pytest.raises(ChannelClosed):
            await ch.put(99, 0)
        ch.close()  # idempotent
        return got

    assert run(go()) == [0, 1, 2]


def test_close_on_a_full_channel_still_delivers_everything() -> None:
    async def go():
        ch = Channel(capacity=2)
        await ch.put("a", 0)
        await ch.put("b", 0)
        ch.close()
        return [r async for r in ch]

    assert run(go()) == ["a", "b"]


def test_close_unblocks_a_waiting_consumer() -> None:
    async def go():
        ch = Channel()
        consumer = asyncio.create_task(ch.get())
        await asyncio.sleep(0.01)
        assert not consumer.done()
        ch.close()
        with pytest.raises(ChannelClosed):
            await consumer

    run(go())


def test_back_pressure_with_capacity_one() -> None:
    async def go():
        ch = Channel(capacity=1)
        log: list[str] = []

        async def producer():
            for i in range(3):
                await ch.put(i, 0)
                log.append(f"put{i}")
            ch.close()

        task = asyncio.create_task(producer())
        await asyncio.sleep(0.01)
        assert log == ["put0"]  # the second put waits for room
        assert ch.qsize() == 1
        got = []
        async for r in ch:
            got.append(r)
            log.append(f"got{r}")
            await asyncio.sleep(0.001)
        await task
        return got, log

    got, log = run(go())
    assert got == [0, 1, 2]
    # never more than one record ahead of the consumer
    assert log.index("put1") > log.index("got0") and log.index("put2") > log.index("got1")


def test_stale_record() -> None:
    async def go():
        ch = Channel(max_staleness=1)
        for v in (5, 5, 4, 3):
            await ch.put(f"v{v}", v)
        assert await ch.get(current_version=6) == "v5"  # gap 1: fine
        assert await ch.get() == "v5"  # no version given: no check
        with pytest.raises(StaleRecord, match="2 versions old"):
            await ch.get(current_version=6)  # gap 2 > 1
        assert await ch.get(current_version=3) == "v3"

    run(go())


def test_no_staleness_bound_by_default() -> None:
    async def go():
        ch = Channel()
        await ch.put("ancient", 0)
        return await ch.get(current_version=10_000)

    assert run(go()) == "ancient"
