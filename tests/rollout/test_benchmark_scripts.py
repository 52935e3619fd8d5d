"""The device benchmark scripts still run: their CPU-sized modes, end to end (the GPU runs them
at real size; a script that rots here would waste a device call)."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

from sd3_tiny import sd3_tiny

from diffrl.models import registry

ROOT = Path(__file__).resolve().parents[2]


def test_continuous_batching_smoke_with_a_diffusers_time_budget() -> None:
    cmd = [sys.executable, "benchmarks/continuous_batching.py", "--smoke", "--modes",
           "scheduler", "diffusers", "--diffusers-seconds", "0.01"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["scheduler"]["images_per_s"] > 0
    done = row["diffusers"]["requests_done"]
    assert 1 <= done <= row["requests"]  # stopped after the budget, the rate over those done
    assert row["scheduler_over_diffusers"] > 0


def test_checkpointing_cost_smoke() -> None:
    cmd = [sys.executable, "benchmarks/ckpt_cost.py", "--smoke", "--rows", "2", "--repeats", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["plain"]["seconds"] > 0 and row["checkpointed"]["seconds"] > 0
    assert row["time_ratio"] > 0


def test_mixed_stream_smoke(monkeypatch, capsys) -> None:
    """benchmarks/mixed_stream.py --smoke, in this process (no second interpreter's imports)."""
    monkeypatch.setattr(sys, "argv", ["mixed_stream.py", "--smoke"])
    # the smoke's model (sd35-tiny, fp32, 32 px) is the one the rollout tests load once
    monkeypatch.setattr(registry, "load_model", lambda cfg, dev: sd3_tiny())
    runpy.run_path(str(ROOT / "benchmarks/mixed_stream.py"), run_name="__main__")
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["packed"]["forwards"] < row["bucketed"]["forwards"]  # shapes shared a forward
    assert row["max_abs_log_prob_diff"] < 1e-5 and row["max_abs_x0_diff"] < 1e-5
    assert row["packed_over_bucketed"] > 0 and row["packed_over_pre_grouped"] > 0
