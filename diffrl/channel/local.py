"""In-process async channel (the embedded backend).

A bounded FIFO of records tagged with the policy version that produced them. Producers
``put`` (waiting while the channel is full: back-pressure); consumers ``get`` or iterate
(waiting while it is empty; unblocked by the next ``put`` or by ``close``). A consumer that
passes its current version gets ``StaleRecord`` for a record older than ``max_staleness``
versions, so an off-policy bound is enforced where records are consumed. The channel knows
nothing about algorithms.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


class ChannelClosed(Exception):
    """``get`` on a closed, drained channel."""


class StaleRecord(RuntimeError):
    """A record is older than the consumer's staleness bound."""


@dataclass(frozen=True)
class Envelope:
    record: Any
    version: int


_CLOSE = object()


def check_fresh(version: int, current_version: int | None, max_staleness: int | None) -> None:
    """Raise ``StaleRecord`` when a record of ``version`` is past the consumer's bound."""
    if max_staleness is None or current_version is None:
        return
    if current_version - version > max_staleness:
        raise StaleRecord(
            f"record from policy v{version} is {current_version - version} versions old "
            f"(max_staleness={max_staleness})"
        )


class Consumable:
    """``async for record in channel``: records until the channel is closed and drained."""

    async def get(self, current_version: int | None = None) -> Any:
        raise NotImplementedError

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.get()
            except ChannelClosed:
                return


class Channel(Consumable):
    def __init__(self, capacity: int = 0, max_staleness: int | None = None) -> None:
        self._q: asyncio.Queue = asyncio.Queue(maxsize=capacity)
        self.max_staleness = max_staleness
        self._closed = False

    async def put(self, record: Any, version: int) -> None:
        if self._closed:
            raise ChannelClosed("put on a closed channel")
        await self._q.put(Envelope(record, version))

    def close(self) -> None:
        """No more puts; consumers drain what is queued, then stop."""
        if not self._closed:
            self._closed = True
            if self._q.full():  # deliver the close after the queued records drain
                asyncio.get_running_loop().create_task(self._q.put(_CLOSE))
            else:
                self._q.put_nowait(_CLOSE)

    async def get(self, current_version: int | None = None) -> Any:
        item = await self._q.get()
        if item is _CLOSE:
            self._q.put_nowait(_CLOSE)  # let other consumers see the close too
            raise ChannelClosed("channel closed")
        check_fresh(item.version, current_version, self.max_staleness)
        return item.record

    async def put_many(self, records: list, version: int) -> None:
        """``put`` each record; with room for them all (an unbounded channel), a consumer
        sees them together."""
        for r in records:
            await self.put(r, version)

    async def get_ready(self, wait: bool = True, current_version: int | None = None) -> list:
        """Every record queued now (waiting for one first when ``wait``); ``ChannelClosed``
        once closed and drained."""
        out = [await self.get(current_version)] if wait else []
        while not self._q.empty():
            item = self._q.get_nowait()
            if item is _CLOSE:
                self._q.put_nowait(_CLOSE)
                if not out:
                    raise ChannelClosed("channel closed")
                break
            check_fresh(item.version, current_version, self.max_staleness)
            out.append(item.record)
        return out

    def qsize(self) -> int:
        return self._q.qsize()
