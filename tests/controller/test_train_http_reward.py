"""The default recipe pointed at `diffrl serve-reward` running the ShapesBench verifier in
another process: training runs, logs the remote rewards, and moves the adapters."""

from __future__ import annotations

import asyncio

import pytest
import torch
from reward_server import serve_reward_process
from safetensors.torch import load_file
from tiny_runs import tiny_run

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics

TOKEN = "test-token-123"


@pytest.fixture
def reward_server():
    # partial credit: the tiny checkpoint earns no strict (mode=overall, the server's default
    # for shapes) score in 3 steps, so the adapters would get no gradient to move by
    with serve_reward_process(TOKEN, "--scorer-param", "mode=partial") as url:
        yield url


def test_default_recipe_trains_against_a_reward_server(
    reward_server, tiny_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("DIFFRL_REWARD_TOKEN", TOKEN)
    scorers = f'[{{name: http, required: true, params: {{url: "{reward_server}"}}}}]'
    extra = [f"reward.scorers={scorers}", "rollout.num_steps=3", "actor.lr=1e-2"]
    cfg = load_config("recipes/shapes_nft.yaml", tiny_run(tiny_checkpoint, tmp_path, 3, *extra))
    root = asyncio.run(train(cfg))
    rows = read_metrics(root)
    steps = [r for r in rows if "reward/http/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["reward/http/valid_frac"] == 1.0 for r in steps)
    assert all(r["reward/http/http_attempts"] >= 1 for r in steps)
    adapters = load_file(str(root / "checkpoints" / "step_000003" / "adapters.safetensors"))
    lora_b = [v for k, v in adapters.items() if ".lora_B.default." in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # B starts at 0: it moved
    assert torch.isfinite(torch.stack([v.abs().sum() for v in lora_b])).all()
