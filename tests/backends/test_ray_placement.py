"""The placement plan (``backends/ray_placement.py``) without Ray: the groups and bundles each
layout asks for, and the pools' checks (``backends/ray.py``'s refusals of what is not built)."""

from __future__ import annotations

import pytest

from diffrl.backends.ray_placement import check_fits, layout
from diffrl.errors import ConfigError
from diffrl.placement import PlacementConfig, PoolConfig


def test_apart_each_pool_has_a_group_of_its_own() -> None:
    p = PlacementConfig(rollout=PoolConfig(replicas=3, cpus=1, gpus=0.5), actor=PoolConfig(cpus=2))
    groups = {g.name: g for g in layout(p)}
    assert set(groups) == {"rollout", "actor"}  # the reward pool asks for nothing: no group
    assert groups["rollout"].bundles == [{"CPU": 1, "GPU": 0.5}] * 3
    assert groups["rollout"].members == {"rollout": [0, 1, 2]}
    assert groups["actor"].bundles == [{"CPU": 2}]


def test_colocated_replica_i_and_worker_i_share_bundle_i() -> None:
    half = PoolConfig(replicas=2, cpus=1, gpus=0.5)
    p = PlacementConfig(rollout=half, actor=half, reward=PoolConfig(cpus=1), colocate=True)
    groups = {g.name: g for g in layout(p)}
    assert groups["rollout+actor"].bundles == [{"CPU": 2, "GPU": 1.0}] * 2  # each takes half
    assert groups["rollout+actor"].members == {"rollout": [0, 1], "actor": [0, 1]}
    assert groups["reward"].bundles == [{"CPU": 1}]
    with pytest.raises(ConfigError, match=r"rollout.replicas' = 2 .*actor.replicas' = 1.*equal"):
        layout(PlacementConfig(rollout=half, actor=PoolConfig(gpus=0.5), colocate=True))


def test_pools_that_do_not_fit_name_their_replicas() -> None:
    p = PlacementConfig(rollout=PoolConfig(replicas=2, gpus=1), actor=PoolConfig(gpus=1))
    check_fits(p, {"CPU": 4, "GPU": 3})
    message = r"ask for 3 GPU \(placement.rollout.gpus=1 x 2 replicas, placement.actor.gpus=1\)"
    with pytest.raises(ConfigError, match=message + r" and the Ray cluster has 2"):
        check_fits(p, {"CPU": 4, "GPU": 2})


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            ["placement.rollout.replicas=2", "ray.channel=transferqueue"],
            r"'ray.channel' = 'transferqueue': several rollout replicas",
        ),
        (
            ["placement.rollout.replicas=2", "placement.weights=broadcast"],
            r"'placement.weights' = 'broadcast'.*several rollout replicas take weights",
        ),
        (
            ["placement.weights=broadcast", "placement.actor.gpus=1"],
            r"'placement.weights' = 'broadcast': a broadcast needs the actor and the rollout",
        ),
    ],
)
def test_what_the_ray_backend_does_not_carry_out_is_refused(over, message) -> None:
    pytest.importorskip("ray")
    from diffrl.backends.ray import _check_built
    from diffrl.config import load_config

    with pytest.raises(ConfigError, match=message):
        _check_built(load_config(None, ["run.backend=ray", *over]))
