"""SIGTERM and SIGINT as a request to stop: the training loop finishes the step it is in,
writes a checkpoint and returns, so a preempted job or a Ctrl-C loses no work and exits 0.

``StopSignals`` only sets a flag; the loop reads ``stop.requested`` after each step. A second
signal while the first is pending gives up on the clean stop: the previous handlers come back
and the signal is raised again (SIGINT: ``KeyboardInterrupt``; SIGTERM: the default, exit).
Handlers can only be installed from the main thread; elsewhere this is a flag nobody sets.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

# what signal.signal takes and returns: a handler, SIG_DFL/SIG_IGN, or None (set from C)
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

log = logging.getLogger(__name__)


class StopSignals:
    """``with StopSignals() as stop:`` around the step loop; ``stop.requested`` after a step."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.received: str | None = None  # name of the first signal, e.g. "SIGTERM"
        self._previous: dict[int, Handler] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def install(self) -> StopSignals:
        """Take over the signals (prefer ``with``: it restores them however the loop ends)."""
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous.setdefault(s, signal.signal(s, self._handle))
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set in C
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # asked twice: stop now, the way it would have
            log.warning("%s again: stopping without a checkpoint", name)
            self.restore()
            signal.raise_signal(signum)
            return
        self.received = name
        log.warning(
            "%s: finishing this step, then a checkpoint and exit (send it again to stop now)", name
        )
