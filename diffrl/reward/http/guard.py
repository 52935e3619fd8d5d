"""What stands between a socket and the reward app: the connection protocol, the log filter and
the batch gate (the server's first and last defences; server.py holds the checks between).

- ``GuardedH11Protocol`` (via ``uvicorn_config``): read deadlines and a connection cap on every
  socket, before any request reaches the app or its auth;
- ``quiet_repetitive_logs``: a rate limit on the log lines a hostile client can cause;
- ``BatchGate`` with ``wait_for_disconnect``: one batch decoded and scored at a time, and work
  whose client has gone skipped or cancelled.

``GuardedH11Protocol`` subclasses uvicorn's h11 protocol and reads its internals (``conn``,
``cycle``, ``transport``, ``connections``, ``on_response_complete``): the serve extra bounds the
uvicorn version to the ones it was tested on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import h11
import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
T = TypeVar("T")


# --- connections: deadlines and a cap ---------------------------------------------------------


@dataclass(frozen=True)
class ConnectionLimits:
    """What an unauthenticated socket may cost the server: auth is checked only once a request
    head has arrived, so these bound everything before it."""

    header_timeout_s: float = 10.0  # a complete request head within this of the socket going idle
    body_timeout_s: float = 60.0  # the whole body within this of its head (64 MB at >1 MB/s)
    keep_alive_s: float = 5.0  # an idle keep-alive socket is closed after this (uvicorn's)
    max_connections: int = 64  # open sockets; a new one past this closes the oldest idle one
    max_head_bytes: int = 16 << 10  # request line + headers (h11; 400 beyond)

    def __post_init__(self) -> None:
        timeouts = (self.header_timeout_s, self.body_timeout_s, self.keep_alive_s)
        if not all(0 < t < math.inf for t in timeouts):  # NaN fails too
            raise ValueError(f"{self}: timeouts must be finite and > 0")
        if self.max_connections < 1 or self.max_head_bytes < 1024:
            raise ValueError(f"{self}: max_connections >= 1 and max_head_bytes >= 1024")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a connection cap.

    uvicorn itself times out only idle keep-alive sockets: a socket that sends nothing, half a
    request head, or one body byte a minute stays open forever, all before auth. Each socket is
    in one phase, decided from h11's view of the client after every event:
      head -- waiting for a complete request head: closed ``header_timeout_s`` after entering
              (a 408 if part of a head arrived, else silently);
      body -- head received, body incomplete: closed ``body_timeout_s`` after the head (408
              unless a response was already sent, e.g. a 401 before the body);
      app  -- the request is complete and with the app: no deadline here (scoring takes as long
              as it takes; a client that leaves cancels it, see ``BatchGate``).
    A socket opened past ``max_connections`` closes the oldest one in the head phase, so idle
    sockets cannot lock out a client; if every socket has a request in progress it gets 503.
    uvicorn's own ``limit_concurrency`` is not used: it counts idle sockets too, so they would
    turn every real request into a 503, which is the lock-out this class exists to prevent.
    """

    limits = ConnectionLimits()  # replaced per server by ``guarded_protocol``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # "head", "body", or None (with the app / closing)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase_since = 0.0  # loop time the phase began; the oldest idle socket goes first
        self._head_started = False  # some bytes of the current head arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        if self._admit():
            self._track()

    def data_received(self, data: bytes) -> None:
        if self._phase == "head":
            self._head_started = True
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def _track(self) -> None:
        if self.transport.is_closing():
            self._set_phase(None)
        elif self.conn.their_state is h11.IDLE:
            self._set_phase("head")
        elif self.conn.their_state is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # a phase keeps the deadline it started with
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase, self._phase_since = phase, self.loop.time()
        if phase == "head":
            self._head_started = False
            self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._expire)
        elif phase == "body":
            self._deadline = self.loop.call_later(self.limits.body_timeout_s, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        phase = self._phase
        if phase == "head":
            what, partial = "no complete request head", self._head_started
        else:
            what = "no complete request body"
            partial = self.cycle is not None and not self.cycle.response_started
        log.info("closing %s: %s within the deadline", _peer(self.client), what)
        # Raw bytes, not h11: h11 cannot answer a request it has not seen, and the app's task
        # (body phase) sees the closed connection as a disconnect and sends nothing more.
        self._close(b"408 Request Timeout", f"{what} within the deadline\n" if partial else None)

    def _admit(self) -> bool:
        """Make room for this socket under ``max_connections``; False if it was refused."""
        live = [c for c in self.connections if not _closing(c)]
        if len(live) <= self.limits.max_connections:
            return True
        idle = [c for c in live if isinstance(c, GuardedH11Protocol) and c._phase == "head"]
        if idle:
            oldest = min(idle, key=lambda c: c._phase_since)
            log.warning("%d connections open: closing the oldest idle one", len(live))
            oldest._close(b"408 Request Timeout", None)
            return True
        log.warning("%d connections open, each with a request: refusing one", len(live))
        self._close(b"503 Service Unavailable", "too many connections; retry shortly\n")
        return False

    def _close(self, status: bytes, body: str | None) -> None:
        if body is not None and not self.transport.is_closing():
            data = body.encode()
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data)
            )
        self._set_phase(None)
        self.transport.close()


def _closing(protocol: object) -> bool:
    transport = getattr(protocol, "transport", None)
    return transport is None or transport.is_closing()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per socket, carrying this server's limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_config(app: Any, limits: ConnectionLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings for the reward server. The protocol is always h11 (uvicorn's "auto"
    would pick httptools when installed, which the deadlines above do not cover)."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        ws="none",
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  (a float works)
        h11_max_incomplete_event_size=limits.max_head_bytes,
        server_header=False,
        **kwargs,
    )


# --- logging: repeated lines are counted, not written -----------------------------------------


class QuietRepeats(logging.Filter):
    """Lets through at most ``burst`` records of one kind per ``period_s``; the first record after
    a quiet spell says how many were dropped. A kind is (logger, message template), so a flood
    of one warning cannot fill the disk (an idle-socket flood once wrote 56 MB in 10 s) while
    other messages still get through. Access lines are also keyed by status, so a flood of
    401s does not hide the 200s."""

    def __init__(self, burst: int = 10, period_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.period_s = burst, period_s
        # kind -> [window start, records in it, records dropped]
        self._seen: dict[tuple[Any, ...], list[float]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind: tuple[Any, ...] = (record.name, str(record.msg))
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and record.args:
            kind += (record.args[-1],)
        now = time.monotonic()
        with self._lock:
            window = self._seen.get(kind)
            if window is None or now - window[0] > self.period_s:
                dropped = int(window[2]) if window else 0
                self._seen[kind] = [now, 1, 0]
                if len(self._seen) > 1000:  # bound the table itself
                    self._seen = {kind: self._seen[kind]}
                if dropped:
                    record.msg = f"{record.msg} ({dropped} more like this were not logged)"
                return True
            window[1] += 1
            if window[1] <= self.burst:
                return True
            window[2] += 1
            return False


QUIET_LOGGERS = ("uvicorn.error", "uvicorn.access", "asyncio", __name__)


def quiet_repetitive_logs(*extra: str, burst: int = 10, period_s: float = 10.0) -> None:
    """Install one ``QuietRepeats`` on each logger a hostile client can make talk:
    ``QUIET_LOGGERS`` and the ``extra`` names (the app's own). A logger's filter sees only the
    records logged on it, not those its children pass up, so each logger is named."""
    for name in (*QUIET_LOGGERS, *extra):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietRepeats) for f in logger.filters):
            logger.addFilter(QuietRepeats(burst, period_s))


# --- the batch gate ---------------------------------------------------------------------------


class _BatchThreads:
    """Executor jobs one batch started (asyncio.to_thread), counted on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.running = loop, 0
        self.idle = asyncio.Event()
        self.idle.set()

    def started(self, future: Future) -> None:
        self.running += 1
        self.idle.clear()
        future.add_done_callback(self._finished)  # runs in the worker, or here if already done

    def _finished(self, _: Future) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
            self.loop.call_soon_threadsafe(self._one_done)

    def _one_done(self) -> None:
        self.running -= 1
        if self.running == 0:
            self.idle.set()


_batch_threads: ContextVar[_BatchThreads | None] = ContextVar("batch_threads", default=None)


class TrackingExecutor(ThreadPoolExecutor):
    """The event loop's default executor, telling each batch which threads are its own."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future = super().submit(fn, *args, **kwargs)
        threads = _batch_threads.get()
        if threads is not None and _running_loop() is threads.loop:
            threads.started(future)
        return future


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class BatchGate:
    """At most ``size`` batches are decoded and scored at a time (1 by default: a GPU reward
    model should see one batch rather than run out of memory on several, and decoding inside
    the gate keeps queued requests from all holding their decoded pixels at once).

    Consumes: one job (decode + score) per /score request. Waits for: a free slot, racing the
    client's disconnect. Unblocks: a slot frees when its job and every executor thread the job
    started have returned.
    Invariants: a job whose client left while it queued never starts; a job whose client leaves
    while it runs is cancelled, which stops an async scorer at its next await; a thread cannot
    be interrupted, so a cancelled job's thread keeps the slot until it returns, and cancelling
    never puts two batches on the GPU.
    """

    def __init__(self, size: int = 1) -> None:
        self._slots = asyncio.Semaphore(size)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, job: Callable[[], Awaitable[T]], gone: asyncio.Future) -> T | None:
        """``job()``'s result, or None when the client left (``gone`` done) first."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # each loop gets one tracking default executor
            loop.set_default_executor(TrackingExecutor(thread_name_prefix="reward-batch"))
            self._loop = loop
        if not await self._acquire(gone):
            return None
        threads = _BatchThreads(loop)

        async def tracked() -> T:
            _batch_threads.set(threads)  # the task's own context: unseen by other requests
            return await job()

        task = loop.create_task(tracked())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            task.cancel()  # a no-op once it is done
            await asyncio.wait({task})
            await threads.idle.wait()
            self._slots.release()
        return None if task.cancelled() else task.result()

    async def _acquire(self, gone: asyncio.Future) -> bool:
        if gone.done():
            return False
        acquire = asyncio.ensure_future(self._slots.acquire())
        try:
            await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            acquire.cancel()  # Semaphore.acquire gives a slot back if cancelled after the grant
            await asyncio.wait({acquire})
        if acquire.cancelled():
            return False
        if gone.done():
            self._slots.release()
            return False
        return True


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone. Only after the body was read: uvicorn's receive then
    blocks until the connection is lost. If the connection cannot be watched, it never
    returns: a batch is cancelled only for a client known to have left."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        log.debug("cannot watch a /score connection for a disconnect", exc_info=True)
        await asyncio.Event().wait()  # until cancelled, when the request is answered
