"""What the Ray backend's test modules share: one local Ray instance per module, runs of a
recipe read back as metric rows, and the check that a run released everything it placed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics

RECIPE = "recipes/shapes_nft.yaml"
PARTIAL = "reward.scorers=[{name: shapes, weight: 1.0, required: true, params: {mode: partial}}]"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance with 2 CPUs (the CI machine's) for the module; build_ray uses it
    and leaves it running."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    if started:
        ray.shutdown()


def untimed(rows: list[dict]) -> list[dict]:
    drop = lambda k: k.startswith("perf/") or k == "time"  # noqa: E731
    return [{k: v for k, v in r.items() if not drop(k)} for r in rows]


def run(overrides: list[str], recipe: str | None = None) -> list[dict]:
    return read_metrics(asyncio.run(train(load_config(recipe, overrides))))


def all_released() -> bool:
    """Every CPU of the instance is free again: the run's actors and placement groups are gone."""
    import ray

    for _ in range(50):
        if ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]:
            return True
        asyncio.run(asyncio.sleep(0.1))
    return False
