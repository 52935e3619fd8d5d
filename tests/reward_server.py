"""A real `diffrl serve-reward` process for tests (shared by reward and controller tests)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

# --- a real `diffrl serve-reward` process ---------------------------------------------------


@contextlib.contextmanager
def serve_reward_process(token: str, *args: str) -> Iterator[str]:
    """Run `diffrl serve-reward --scorer shapes ARGS` on a free loopback port; yield its URL
    once /health answers; stop it afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DIFFRL_REWARD_TOKEN": token}
    cmd = [
        sys.executable,
        "-m",
        "diffrl.cli",
        "serve-reward",
        "--scorer",
        "shapes",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {token}"}, timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "serve-reward did not start in 60 s"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.stdout.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
