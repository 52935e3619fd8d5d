"""The ``placement`` section carried out on Ray: each engine's replicas (rollout replicas, actor
workers, the reward pool) as bundles of placement groups, and the Ray actor options that put
each replica on its bundle.

Apart (``placement.colocate=false``): the rollout pool's ``replicas`` bundles in one placement
group, the actor pool's in another, the reward pool's one bundle in a third; each bundle is
``{CPU: cpus, GPU: gpus}`` of its pool. A pool of all zeros takes no placement group: its
replicas ask for nothing and land anywhere.

Colocated (``placement.colocate=true``): rollout replica i and actor worker i share bundle i of
one placement group, so they time-share its GPU. ``cpus`` and ``gpus`` stay each engine's own
share, as apart; the bundle holds the sum (``rollout.gpus=0.5 actor.gpus=0.5``: one GPU per
bundle, half each). The two pools then need the same ``replicas``. The reward pool stays apart.

``layout`` is the plan (pure, unit-tested without Ray); ``place`` makes the groups, waits for
them (a ConfigError at ``ray.place_timeout_s`` instead of actors that never start) and returns
``Placed``. A replica that dies is started again with the same options, on the same bundle
(``backends/ray_rollout.py``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from diffrl.errors import ConfigError
from diffrl.placement import PlacementConfig, PoolConfig

ROLES = ("rollout", "reward", "actor")


def bundle(pool: PoolConfig) -> dict[str, float]:
    """One replica's resources ({} for a pool that asks for none)."""
    return {k: v for k, v in (("CPU", pool.cpus), ("GPU", pool.gpus)) if v > 0}


@dataclass
class Group:
    """One placement group to make: its bundles, and which role's replica i sits on which
    bundle (``members[role][i]``)."""

    name: str
    bundles: list[dict[str, float]]
    members: dict[str, list[int]] = field(default_factory=dict)


def layout(p: PlacementConfig) -> list[Group]:
    """The placement groups ``p`` asks for (pools of all zeros take none)."""
    if p.colocate and p.rollout.replicas != p.actor.replicas:
        raise ConfigError(
            f"config keys 'placement.rollout.replicas' = {p.rollout.replicas} and "
            f"'placement.actor.replicas' = {p.actor.replicas}: with placement.colocate=true "
            "rollout replica i and actor worker i share bundle i, so they must be equal (or "
            "set placement.colocate=false)"
        )
    groups = []
    apart = ("reward",) if p.colocate else ROLES
    for role in apart:
        pool = getattr(p, role)
        if bundle(pool):
            groups.append(
                Group(role, [bundle(pool)] * pool.replicas, {role: list(range(pool.replicas))})
            )
    if p.colocate:
        r, a = p.rollout, p.actor  # each engine's share; the bundle holds both
        shared = bundle(PoolConfig(cpus=r.cpus + a.cpus, gpus=r.gpus + a.gpus))
        if shared:
            every = list(range(p.rollout.replicas))
            groups.append(
                Group(
                    "rollout+actor",
                    [shared] * p.rollout.replicas,
                    {"rollout": every, "actor": every},
                )
            )
    return groups


def check_fits(p: PlacementConfig, have: dict[str, float]) -> None:
    """Every pool's resources (``replicas`` x per replica) against the cluster's ``have``."""
    for kind in ("CPU", "GPU"):
        want = {r: getattr(p, r).replicas * bundle(getattr(p, r)).get(kind, 0.0) for r in ROLES}
        if sum(want.values()) > have.get(kind, 0.0) + 1e-9:
            asks = ", ".join(
                f"placement.{r}.{kind.lower()}s={bundle(getattr(p, r))[kind]:g}"
                + (f" x {getattr(p, r).replicas} replicas" if getattr(p, r).replicas > 1 else "")
                for r, v in want.items()
                if v
            )
            raise ConfigError(
                f"the engines' pools ask for {sum(want.values()):g} {kind} ({asks}) and the Ray "
                f"cluster has {have.get(kind, 0.0):g}; lower them, or start Ray with more "
                "(ray.num_cpus for a local instance)"
            )


@dataclass
class Placed:
    """Ray actor options per replica of each role (``scheduling_strategy``, ``num_cpus``,
    ``num_gpus``), and the placement groups to remove at the end."""

    rollout: list[dict[str, Any]]
    actor: list[dict[str, Any]]
    reward: dict[str, Any]
    groups: list[Any]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g)
        self.groups = []


def place(p: PlacementConfig, timeout: float) -> Placed:
    """Makes ``layout(p)``'s placement groups on the running Ray cluster and waits until all
    are placed; ConfigError (and nothing left behind) when they do not fit or do not place
    within ``timeout`` seconds."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_fits(p, ray.cluster_resources())
    plan = layout(p)
    opts: dict[str, list[dict[str, Any]]] = {
        r: [{"num_cpus": 0, "num_gpus": 0} for _ in range(getattr(p, r).replicas)] for r in ROLES
    }
    made = Placed([], [], {}, [])
    for g in plan:
        pg = placement_group(
            g.bundles, strategy="PACK", name=f"diffrl-{g.name}-{uuid.uuid4().hex[:6]}"
        )
        made.groups.append(pg)
        for role, at in g.members.items():
            pool = getattr(p, role)
            for i, b in enumerate(at):
                opts[role][i] = {
                    "num_cpus": pool.cpus,
                    "num_gpus": pool.gpus,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=b
                    ),
                }
    waits = [pg.ready() for pg in made.groups]
    ready, _ = ray.wait(waits, num_returns=len(waits), timeout=timeout) if waits else ([], [])
    if len(ready) < len(waits):
        made.remove()
        asks = "; ".join(f"{g.name}: {len(g.bundles)} x {g.bundles[0]}" for g in plan)
        raise ConfigError(
            f"config key 'placement': the pools ({asks}) could not be placed within "
            f"{timeout:g} s (ray.place_timeout_s; free now: {ray.available_resources()}); "
            "lower them or add nodes"
        )
    made.rollout, made.actor, made.reward = opts["rollout"], opts["actor"], opts["reward"][0]
    return made
