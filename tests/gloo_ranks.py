"""Running a test's ranks as fresh processes over gloo (shared by the tests/parallel files)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port the OS reports free (bound to port 0 and released; rank 0 binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, nprocs: int, args: tuple, deadline_s: float) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; a rank's exception is re-raised here,
    and ranks still running after ``deadline_s`` (a hang in a collective) fail the test."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException if a rank failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"{nprocs} ranks still running after {deadline_s:.0f} s (a hang?)")


def init_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join the gloo group on this machine, one thread per rank (the ranks share its cores)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def finish_rank(out: Path, rank: int, result: dict) -> None:
    """Write this rank's results as ``out/rank{rank}.json`` (the test reads them in the parent),
    then leave (``leave_group``)."""
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    leave_group()


def leave_group() -> None:
    """Leave the group once every rank is here (so none tears gloo down mid-talk), and end the
    process at once: the rank's last call, after it has written what the parent reads.

    ``os._exit(0)`` skips the interpreter's finalisation. There, objects that still hold the
    destroyed group (a DeviceMesh, DTensor parameters) are freed in no set order, and gloo's
    threads can be torn down under them: CI saw a rank that had written every result abort in
    its exit with "terminate called without an active exception" (SIGABRT). A failure before
    this point still raises in the rank and reaches the parent as before."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


ROOT = Path(__file__).resolve().parents[1]


def torchrun_train(world: int, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node WORLD -m diffrl.cli train ARGS`` as a user runs
    it (CPU, gloo), from the repository root with this checkout first on the path; a non-zero
    exit fails the test with the tail of its stderr."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", "-m", "diffrl.cli", "train", *args,
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def assert_same_first_step(rows: list[dict], one: list[dict]) -> None:
    """A torchrun run's step 1 against the one-process run's: the same samples (its rewards,
    to fp32 rounding) and the same update (loss and grad norm, rel 1e-4: the shards and
    collectives reorder sums)."""
    import pytest

    for key in [k for k in one[1] if k.startswith("reward/")]:
        assert rows[1][key] == pytest.approx(one[1][key], rel=1e-5, abs=1e-6), key
    for key in ("actor/loss", "actor/grad_norm"):
        assert rows[1][key] == pytest.approx(one[1][key], rel=1e-4), key
