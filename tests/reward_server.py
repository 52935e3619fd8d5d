"""A real reward server process for tests (shared by reward and controller tests).

``serve_reward_cli`` runs the `diffrl serve-reward` command itself (``python -m diffrl.cli``)
with any of its flags. For a test scorer below (``TEST_SCORERS``), which the command's registry
does not hold, it runs this file instead, whose ``__main__`` registers them and then calls the
same ``diffrl.cli.main``: the flags, checks and server are the command's own. Each server's
output goes to a file, never to a pipe nobody reads: a server that logs a lot would otherwise
block on a full pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class RunningServer:
    url: str
    pid: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def peak_rss_mib(self) -> float:
        """The process's peak resident memory so far (Linux VmHWM)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM in /proc/<pid>/status")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    """The free port was taken by another process before the server bound it."""


@contextlib.contextmanager
def _running(cmd: list[str], token: str, port: int) -> Iterator[RunningServer]:
    """Start ``cmd``; yield once /health answers; stop it afterwards. ``PortTaken`` if it
    exited because its port was taken (test workers share the machine's ports)."""
    env = {**os.environ, "DIFFRL_REWARD_TOKEN": token}
    with tempfile.TemporaryDirectory(prefix="reward-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        server = RunningServer(f"http://127.0.0.1:{port}", proc.pid, log_path)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None and "address already in use" in server.log():
                    raise PortTaken(server.log())
                assert proc.poll() is None, server.log()
                try:
                    httpx.get(f"{server.url}/health", headers=headers, timeout=1)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the reward server did not start in 60 s"
                    time.sleep(0.1)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def serve_reward_cli(token: str, *args: str, scorer: str = "shapes") -> Iterator[RunningServer]:
    """Run `diffrl serve-reward --scorer SCORER ARGS` on a free loopback port (an empty token:
    no auth); yield it once /health answers; stop it afterwards."""
    entry = [__file__] if scorer in TEST_SCORERS else ["-m", "diffrl.cli"]
    for _ in range(3):  # a port found free can be taken before the server binds it
        port = _free_port()
        cmd = [sys.executable, *entry, "serve-reward", "--scorer", scorer]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *args]
        with contextlib.ExitStack() as stack:
            try:
                server = stack.enter_context(_running(cmd, token, port))
            except PortTaken:
                continue
            yield server
            return
    raise RuntimeError("no free port for the reward server after 3 tries")


@contextlib.contextmanager
def serve_reward_process(token: str, *args: str) -> Iterator[str]:
    """Run `diffrl serve-reward --scorer shapes ARGS`; yield its URL (see ``serve_reward_cli``)."""
    with serve_reward_cli(token, *args) as server:
        yield server.url


# --- test scorers, registered only in the server process --------------------------------------


class SleepyScorer:
    """The ShapesBench verifier, except for batches whose first prompt starts with "sleep" or
    "thread": those score 1.0 after ``delay_s``, awaiting or in a thread (like a model scorer)
    respectively. Writes "start <time>" / "done <time>" lines to ``journal`` for those."""

    name = "sleepy"
    needs = frozenset({"image"})

    def __init__(self, delay_s: float = 1.0, journal: str = "") -> None:
        from diffrl.tasks.shapes.scorer import ShapesScorer

        self.delay_s, self.journal, self.shapes = delay_s, journal, ShapesScorer()

    def _note(self, event: str) -> None:
        if self.journal:
            with open(self.journal, "a") as f:
                f.write(f"{event} {time.time()}\n")

    def _sleep(self) -> None:
        time.sleep(self.delay_s)
        self._note("done")

    async def score(self, traj):
        import torch

        from diffrl.reward.scorer import ScoreResult

        first = traj.prompts.texts[0]
        if not first.startswith(("sleep", "thread")):
            return await self.shapes.score(traj)
        self._note("start")
        if first.startswith("thread"):
            await asyncio.to_thread(self._sleep)  # "done" when the thread ends, even if cancelled
        else:
            await asyncio.sleep(self.delay_s)
            self._note("done")
        n = len(traj)
        return ScoreResult(torch.ones(n), torch.ones(n, dtype=torch.bool))


def journal_events(path: Path) -> list[tuple[str, float]]:
    if not path.exists():
        return []
    return [(e, float(t)) for e, t in (line.split() for line in path.read_text().splitlines())]


TEST_SCORERS = {"sleepy": SleepyScorer}


if __name__ == "__main__":  # `python reward_server.py serve-reward ...`: the CLI + test scorers
    from diffrl.cli import main
    from diffrl.reward.scorer import register_scorer

    for name, factory in TEST_SCORERS.items():
        register_scorer(name)(factory)
    sys.exit(main(sys.argv[1:]))
