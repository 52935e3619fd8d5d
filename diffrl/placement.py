"""Where the engines run under ``run.backend=ray``: the ``ray`` config section, one resource
pool per engine. It sits below ``config.py`` so the config imports no backend; ``backends/ray.py``
reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from diffrl.errors import check, check_choice


@dataclass(frozen=True)
class PoolConfig:
    """One engine's resource pool: a placement group of one bundle. All zero = no group; the
    engine's actor then takes no resources and lands anywhere."""

    cpus: float = 1.0
    gpus: float = 0.0

    def validate(self) -> None:
        check(math.isfinite(self.cpus) and self.cpus >= 0, "cpus", self.cpus, "must be >= 0")
        check(math.isfinite(self.gpus) and self.gpus >= 0, "gpus", self.gpus, "must be >= 0")


@dataclass(frozen=True)
class RayConfig:
    # "" starts a local Ray instance (and stops it at the end); "auto" or host:port joins a
    # running cluster (left running)
    address: str = ""
    num_cpus: int = 0  # a local instance's logical CPUs; 0 = Ray's default (all cores)
    rollout: PoolConfig = field(default_factory=PoolConfig)
    reward: PoolConfig = field(default_factory=lambda: PoolConfig(cpus=0.0))
    actor: PoolConfig = field(default_factory=PoolConfig)
    # how trajectories reach the controller: Ray's object store (a streaming generator), or
    # TransferQueue (the data layer verl-omni uses; backends/ray.py, channel/transferqueue.py)
    channel: str = "object_store"  # object_store | transferqueue
    place_timeout_s: float = 60.0  # how long to wait for the pools to be placed
    # modules (dotted names) or .py files every host imports before it builds its engines:
    # plug-ins registered outside diffrl (a scorer, task or family) exist in each process
    imports: list[str] = field(default_factory=list)

    def validate(self) -> None:
        check(self.num_cpus >= 0, "num_cpus", self.num_cpus, "must be >= 0")
        check_choice("channel", self.channel, ("object_store", "transferqueue"))
        check(self.place_timeout_s > 0, "place_timeout_s", self.place_timeout_s, "must be > 0")
        for name in self.imports:
            if name.endswith(".py"):
                check(Path(name).is_file(), "imports", name, "a .py file that exists")
