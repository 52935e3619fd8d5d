"""What stands between a socket and the reward app: the connection protocol, the log filter and
the batch gate (the server's first and last defences; server.py holds the checks between).

- ``GuardedH11Protocol`` (via ``uvicorn_config``): read deadlines on every socket, the head's
  size and token checked before the app sees it, and admission (``Admission``): request slots
  for authenticated requests only, a bounded queue past them;
- ``quiet_repetitive_logs``: a rate limit on the log lines a hostile client can cause, and a
  cap on their length;
- ``BatchGate`` with ``wait_for_disconnect``: one batch decoded and scored at a time, and work
  whose client has gone skipped or cancelled.

``GuardedH11Protocol`` subclasses uvicorn's h11 protocol and reads its internals (``conn``,
``cycle``, ``transport``, ``connections``, ``on_response_complete``): the serve extra bounds the
uvicorn version to the ones it was tested on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http
import json
import logging
import math
import re
import threading
import time
from collections import deque
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


# --- connections: deadlines, auth at the head, admission -------------------------------------


@dataclass(frozen=True)
class ConnectionLimits:
    """What a socket may cost the server before and while it holds a request.

    A socket without a request (new, keep-alive, or closing after an early reply) is cheap and
    bounded by ``max_idle``; a request holds one of ``max_connections`` slots from its head
    (authenticated) to its response, and past them it waits in a bounded, timed queue."""

    header_timeout_s: float = 10.0  # a complete request head within this of the socket going idle
    body_timeout_s: float = 60.0  # the whole body within this of its head (64 MB at >1 MB/s)
    keep_alive_s: float = 5.0  # an idle keep-alive socket is closed after this (uvicorn's)
    max_connections: int = 64  # request slots: authenticated requests uploading or being served
    max_queued: int = 256  # requests (heads arrived, authenticated) waiting for a slot; 503 beyond
    queue_timeout_s: float = 10.0  # a request waits at most this for a slot (then 503)
    max_idle: int = 512  # sockets without a request; past it the oldest one is closed
    max_head_bytes: int = 16 << 10  # request line + headers (431 beyond)

    def __post_init__(self) -> None:
        timeouts = (
            self.header_timeout_s,
            self.body_timeout_s,
            self.keep_alive_s,
            self.queue_timeout_s,
        )
        if not all(0 < t < math.inf for t in timeouts):  # NaN fails too
            raise ValueError(f"{self}: timeouts must be finite and > 0")
        if min(self.max_connections, self.max_queued, self.max_idle) < 1:
            raise ValueError(f"{self}: max_connections, max_queued and max_idle must be >= 1")
        if self.max_head_bytes < 1024:
            raise ValueError(f"{self}: max_head_bytes must be >= 1024")


LINGER_S = 2.0  # after an early reply, the rest of the request is read and dropped this long
BLANK_LINE = re.compile(rb"\n\r?\n")  # the end of a request head, as h11 finds it
UNAUTHORIZED = "missing or wrong bearer token (send 'Authorization: Bearer <token>')"


def bearer_matches(header: str | bytes | None, expected: bytes) -> bool:
    """Whether an Authorization header value is ``Bearer <expected>``. compare_digest: the time
    taken must not reveal how much of the token matched."""
    raw = header.encode("latin-1") if isinstance(header, str) else (header or b"")
    scheme, _, given = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), expected)


class Admission:
    """Request slots of one server: at most ``max_connections`` requests hold one, from a head
    that passed the token check to the end of its response; the rest wait first come, first
    served (at most ``max_queued``, each at most ``queue_timeout_s``).

    Consumes: sockets whose head arrived (``enter``). Waits for: a slot to free (``release``,
    when a response completes or a socket holding a slot goes). Unblocks: the oldest waiting
    socket, whose buffered head is then handed to the app.
    Invariants: only authenticated requests hold or wait for a slot (an unauthenticated head
    is answered 401 and its socket closed before it gets here); a socket whose head arrived
    is never closed to make room: it waits, or is told 503 with Retry-After."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.busy = 0
        self.waiting: deque[GuardedH11Protocol] = deque()

    def enter(self, protocol: GuardedH11Protocol) -> bool:
        """True if ``protocol`` got a slot; otherwise it waits (or was refused)."""
        if self.busy < self.limits.max_connections and not self.waiting:
            self.busy += 1
            return True
        if len(self.waiting) >= self.limits.max_queued:
            log.warning("%d requests already wait for a slot: refusing one", len(self.waiting))
            protocol._reply_and_linger(503, "the request queue is full; retry shortly", retry=True)
            return False
        if not self.waiting:
            log.warning(
                "all %d request slots are busy: requests wait (at most %d, %g s each)",
                self.limits.max_connections,
                self.limits.max_queued,
                self.limits.queue_timeout_s,
            )
        self.waiting.append(protocol)
        protocol._wait()
        return False

    def leave(self, protocol: GuardedH11Protocol) -> None:
        with contextlib.suppress(ValueError):
            self.waiting.remove(protocol)

    def release(self) -> None:
        self.busy -= 1
        while self.waiting and self.busy < self.limits.max_connections:
            protocol = self.waiting.popleft()
            if protocol._phase == "queued" and not _closing(protocol):
                self.busy += 1
                protocol.loop.call_soon(protocol._admitted)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, the token checked at the head, and
    admission by request.

    uvicorn itself times out only idle keep-alive sockets: a socket that sends nothing, half a
    request head, or one body byte a minute stays open forever. Each socket is in one phase:
      head    -- waiting for a complete request head, which is buffered here, not yet given
                 to h11: closed ``header_timeout_s`` after entering (a 408 if part of a head
                 arrived, else silently); a head over ``max_head_bytes`` gets 431;
      queued  -- its head arrived and passed the token check, but every request slot is busy
                 (see ``Admission``): reading paused; 503 after ``queue_timeout_s``;
      body    -- it holds a slot, body incomplete: closed ``body_timeout_s`` after the head
                 (408);
      app     -- it holds a slot and the request is with the app: no deadline (scoring takes as
                 long as it takes; a client that leaves cancels it, see ``BatchGate``);
      closing -- a reply went out before the request was read in full (a 401, a 413): the rest
                 is read and dropped for ``LINGER_S``, so the client can read the reply, then
                 the socket is closed. It holds no slot and the body is never awaited.
    With a token set, a head without it is answered 401 here, before the app or a slot: so a
    client without the token cannot hold a request slot (a slow body after a 401 once held
    one for 60 s, and 64 of them locked every real client out with 503s).
    Sockets in the head and closing phases are bounded by ``max_idle``: a new socket past it
    closes the oldest of them. uvicorn's ``limit_concurrency`` is not used: it counts idle
    sockets too, so they would turn every real request into a 503.
    Pipelined requests are not served: a connection with bytes left after a request closes
    after its response (the next request would skip the head checks above).
    """

    limits = ConnectionLimits()  # replaced per server by ``guarded_protocol``
    token: bytes | None = None  # the bearer token; None: no auth (loopback only)
    admission = Admission(limits)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # see the class docstring; None: closed
        self._deadline: asyncio.TimerHandle | None = None
        self._phase_since = 0.0  # loop time the phase began; the oldest idle socket goes first
        self._head = bytearray()  # the request head so far (head and queued phases)
        self._slot = False  # holds one of the admission's request slots

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._track()
        self._trim_idle()

    def data_received(self, data: bytes) -> None:
        if self._phase == "closing":
            return  # the rest of a request already answered: dropped, never awaited
        if self._phase in ("head", "queued"):
            self._unset_keepalive_if_required()  # this phase has its own deadline
            self._head += data
            if self._phase == "queued" or not self._screen_head():
                return
            data = bytes(self._head)
            self._head.clear()
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]:
            # answered before its body was read (401/413/...), or pipelined bytes follow
            self._linger()
            return
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    # -- the head: size, token, admission

    def _screen_head(self) -> bool:
        """True once the buffered head is complete, small enough, authenticated and holds a
        slot; otherwise it was answered, queued, or needs more bytes."""
        buf = self._head
        start = len(buf) - len(buf.lstrip(b"\r\n"))  # blank lines before a request: skipped
        end = BLANK_LINE.search(buf, start)
        size = (end.end() if end else len(buf)) - start
        if size > self.limits.max_head_bytes:
            self._reply_and_linger(
                431, f"request head over {self.limits.max_head_bytes} bytes (line + headers)"
            )
            return False
        if end is None:
            return False
        if self.token is not None:
            lines = bytes(buf[start : end.start()]).split(b"\n")[1:]
            auth = next(
                (
                    v
                    for n, _, v in (ln.partition(b":") for ln in lines)
                    if n.strip().lower() == b"authorization"
                ),
                None,
            )
            if not bearer_matches(auth, self.token):
                log.warning(
                    "%s: 401 (no valid token); closed without reading on", _peer(self.client)
                )
                self._reply_and_linger(401, UNAUTHORIZED, bearer=True)
                return False
        if not self.admission.enter(self):
            return False
        self._slot = True
        return True

    def _wait(self) -> None:
        self._set_phase("queued")
        self.flow.pause_reading()

    def _admitted(self) -> None:
        """A slot was granted while queued: hand the buffered head (and any body) to h11."""
        self._slot = True
        if self._phase != "queued" or _closing(self):
            self._release()
            return
        data = bytes(self._head)
        self._head.clear()
        if self._deadline is not None:  # leave the queue's deadline, keeping the slot
            self._deadline.cancel()
            self._deadline = None
        self._phase = "admitted"  # until ``_track`` sees where h11 is with the request
        self.flow.resume_reading()
        super().data_received(data)
        self._track()

    def _release(self) -> None:
        if self._slot:
            self._slot = False
            self.admission.release()
        elif self._phase == "queued":
            self.admission.leave(self)

    # -- phases and deadlines

    def _track(self) -> None:
        if self._phase in ("queued", "closing"):
            return  # left only by ``_admitted`` / a deadline / the socket closing
        if self.transport.is_closing():
            self._set_phase(None)
        elif self.conn.their_state is h11.IDLE:
            self._set_phase("head")
        elif self.conn.their_state is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase("app")

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # a phase keeps the deadline it started with
        if phase in ("head", "closing", None):
            self._release()  # a response ended, was cut short, or the socket went
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase, self._phase_since = phase, self.loop.time()
        timeout = {
            "head": self.limits.header_timeout_s,
            "body": self.limits.body_timeout_s,
            "queued": self.limits.queue_timeout_s,
            "closing": LINGER_S,
        }.get(phase or "")
        if phase == "head":
            self._head.clear()
        if timeout is not None:
            self._deadline = self.loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        phase = self._phase
        if phase == "closing":
            self._close(b"", None)
            return
        if phase == "queued":
            log.warning(
                "%s: no request slot within %g s: 503",
                _peer(self.client),
                self.limits.queue_timeout_s,
            )
            self._reply_and_linger(503, "every request slot stayed busy; retry shortly", retry=True)
            return
        if phase == "head":
            what, partial = "no complete request head", bool(self._head)
        else:
            what = "no complete request body"
            partial = self.cycle is not None and not self.cycle.response_started
        log.info("closing %s: %s within the deadline", _peer(self.client), what)
        # Raw bytes, not h11: h11 cannot answer a request it has not seen, and the app's task
        # (body phase) sees the closed connection as a disconnect and sends nothing more.
        self._close(b"408 Request Timeout", f"{what} within the deadline\n" if partial else None)

    def _trim_idle(self) -> None:
        """Past ``max_idle`` sockets without a request, close the oldest of them."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and _idle(c)]
        if len(idle) <= self.limits.max_idle:
            return
        oldest = min(idle, key=lambda c: c._phase_since)
        log.warning("%d connections without a request: closing the oldest idle one", len(idle))
        oldest._close(b"408 Request Timeout", None)

    # -- replies outside the app

    def _reply_and_linger(
        self, status: int, detail: str, *, bearer: bool = False, retry: bool = False
    ) -> None:
        """Answer a request the app never saw (JSON ``{"detail": ...}`` like the app's errors)
        and close the socket without reading the rest of it."""
        body = json.dumps({"detail": detail}).encode()
        extra = b"www-authenticate: Bearer\r\n" if bearer else b""
        extra += b"retry-after: 1\r\n" if retry else b""
        reason = http.HTTPStatus(status).phrase.encode()
        self._release()
        if not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (status, reason, extra, len(body), body)
            )
        self._linger()

    def _linger(self) -> None:
        """Close after a reply sent before the request was read: send FIN now (the client sees
        the reply and the end), drop what still arrives, close after ``LINGER_S`` (closing at
        once with unread bytes would reset the connection, losing the reply)."""
        self._set_phase("closing")
        if self.transport.is_closing():
            return
        self.flow.resume_reading()  # drain what comes, so the close is not a reset
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:  # pragma: no cover (TCP transports can)
            self._close(b"", None)

    def _close(self, status: bytes, body: str | None) -> None:
        if body is not None and not self.transport.is_closing():
            data = body.encode()
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data)
            )
        self._set_phase(None)
        self.transport.close()


def _idle(protocol: object) -> bool:
    """A socket holding no request: waiting for a head, or closing after an early reply."""
    return (
        isinstance(protocol, GuardedH11Protocol)
        and protocol._phase in ("head", "closing")
        and not _closing(protocol)
    )


def _closing(protocol: object) -> bool:
    transport = getattr(protocol, "transport", None)
    return transport is None or transport.is_closing()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def guarded_protocol(
    limits: ConnectionLimits, token: str | None = None
) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per socket, carrying this server's limits, its
    token and its request slots (one ``Admission`` per server)."""
    attrs = {
        "limits": limits,
        "token": token.encode() if token else None,
        "admission": Admission(limits),
    }
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attrs)


def uvicorn_config(
    app: Any, limits: ConnectionLimits, token: str | None = None, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn settings for the reward server. The protocol is always h11 (uvicorn's "auto"
    would pick httptools when installed, which the deadlines above do not cover). ``token``:
    the bearer token the app requires, checked at the head too (see ``GuardedH11Protocol``)."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits, token),
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


MAX_LOG_ARG_CHARS = 1000  # one value in a log line (a prompt, an exception's message)
MAX_LOG_TRACE_LINE_CHARS = 1000  # one line of a logged traceback


def clip(text: str, limit: int = MAX_LOG_ARG_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters not shown]"


class CapLines(logging.Filter):
    """Cuts every value in a log record (its message, each argument, each line of its
    traceback) to a bounded length, the excess counted: a 19 MB prompt quoted in a refusal
    was once logged whole, 95 MB of log in 2 s. Installed on handlers, so it covers every
    logger that writes through them. Arguments are cut one by one rather than the formatted
    line as a whole, so formatters that unpack them (uvicorn's access lines) still work."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or len(record.msg) > MAX_LOG_ARG_CHARS:
            record.msg = clip(str(record.msg))
        if isinstance(record.args, tuple):
            record.args = tuple(_clip_arg(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _clip_arg(v) for k, v in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text and len(record.exc_text) > MAX_LOG_TRACE_LINE_CHARS:
            lines = record.exc_text.splitlines()
            record.exc_text = "\n".join(clip(ln, MAX_LOG_TRACE_LINE_CHARS) for ln in lines)
        return True


def _clip_arg(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value  # formatters may need the number itself (%d)
    text = str(value)
    return clip(text) if len(text) > MAX_LOG_ARG_CHARS else value


def cap_log_lines(*loggers: str) -> None:
    """Install one ``CapLines`` on every handler of the root logger and of ``loggers``."""
    for name in ("", *loggers):
        for handler in logging.getLogger(name or None).handlers:
            if not any(isinstance(f, CapLines) for f in handler.filters):
                handler.addFilter(CapLines())


QUIET_LOGGERS = ("uvicorn.error", "uvicorn.access", "asyncio", __name__)


def quiet_repetitive_logs(*extra: str, burst: int = 10, period_s: float = 10.0) -> None:
    """Install one ``QuietRepeats`` on each logger a hostile client can make talk:
    ``QUIET_LOGGERS`` and the ``extra`` names (the app's own). A logger's filter sees only the
    records logged on it, not those its children pass up, so each logger is named. Then cap
    the length of every line the handlers write (``CapLines``)."""
    for name in (*QUIET_LOGGERS, *extra):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietRepeats) for f in logger.filters):
            logger.addFilter(QuietRepeats(burst, period_s))
    cap_log_lines("uvicorn", "uvicorn.error", "uvicorn.access")


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
