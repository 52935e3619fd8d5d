"""Helpers for scorer tests: a trajectory carrying only the prompts and media a scorer reads,
and a raw HTTP server for replies no framework would send."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import Tensor

from diffrl.types import PromptBatch, Trajectory


def build_media_traj(texts: Sequence[str], **fields: Tensor) -> Trajectory:
    """A Trajectory of ``len(texts)`` samples with the given extra fields (e.g. image=...).

    Token ids and latents are placeholders: scorers read only ``prompts.texts`` and
    ``extra_fields``, so these tests need neither a tokenizer nor a model.
    """
    n = len(texts)
    prompts = PromptBatch(
        texts=tuple(texts),
        input_ids=torch.zeros(n, 1, dtype=torch.long),
        ids_hash=tuple("0" for _ in range(n)),
        prompt_ids=torch.arange(n),
    )
    return Trajectory(
        prompts=prompts,
        group=torch.arange(n),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 3, 4, 4),
        sigmas=torch.linspace(1, 0, 2),
        policy_version=0,
        extra_fields=dict(fields),
    )


@pytest.fixture
def media_traj() -> Callable[..., Trajectory]:
    """``media_traj(texts, image=..., audio=..., video=...)`` -> Trajectory."""
    return build_media_traj


@contextlib.contextmanager
def raw_http_server(
    head: bytes, body: Callable[[], Iterator[bytes]], pause_s: float = 0.0
) -> Iterator[str]:
    """A loopback server that reads each request, then answers with ``head`` and the chunks
    of ``body()``, ``pause_s`` apart, until the chunks run out or the client goes: the
    trickling or endless replies no web framework sends on purpose. Yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            request = b""
            while b"\r\n\r\n" not in request and (chunk := conn.recv(65536)):
                request += chunk
            head_part, _, got = request.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length:\s*(\d+)", head_part)
            missing = (int(length.group(1)) if length else 0) - len(got)
            while missing > 0 and (chunk := conn.recv(65536)):
                missing -= len(chunk)
            try:
                conn.sendall(head)
                for chunk in body():
                    if stop.is_set():
                        return
                    conn.sendall(chunk)
                    time.sleep(pause_s)
            except OSError:  # the client went away: what these tests want it to do
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


@pytest.fixture
def raw_server() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """``with raw_server(head, body, pause_s) as url:`` (see ``raw_http_server``)."""
    return raw_http_server
