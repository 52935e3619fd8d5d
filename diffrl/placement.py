"""Where the engines run: the ``placement`` section (one resource pool per engine: replicas,
CPUs and GPUs each, colocated or apart, and the path weights take from the actor to the
rollout) and the ``ray`` section (the Ray cluster itself). Both sit below ``config.py`` so the
config imports no backend; ``backends/ray.py`` reads them. The local backend ignores them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from diffrl.errors import check, check_choice


@dataclass(frozen=True)
class PoolConfig:
    """One engine's resource pool. ``cpus`` and ``gpus`` are per replica (a fraction of a GPU
    is allowed: several Ray actors then time-share it); all zero = no placement group, the
    replica takes no resources and lands anywhere. Colocated, they stay each engine's own
    share of the bundle its replica shares with the other pool's (``backends/ray_placement.py``).

    ``replicas``: for the rollout, independent copies behind one dispatcher that balances
    micro-batches by load; for the actor, the size of its torch.distributed group (the run's
    ``parallel`` section is its layout, as under torchrun); for the reward pool, 1."""

    replicas: int = 1
    cpus: float = 1.0
    gpus: float = 0.0

    def validate(self) -> None:
        check(self.replicas >= 1, "replicas", self.replicas, "must be >= 1")
        check(math.isfinite(self.cpus) and self.cpus >= 0, "cpus", self.cpus, "must be >= 0")
        check(math.isfinite(self.gpus) and self.gpus >= 0, "gpus", self.gpus, "must be >= 0")


# how a weight update travels from the actor to the rollout replicas (placement.weights)
WEIGHT_PATHS = ("auto", "object_store", "broadcast", "ipc")


@dataclass(frozen=True)
class PlacementConfig:
    rollout: PoolConfig = field(default_factory=PoolConfig)
    reward: PoolConfig = field(default_factory=lambda: PoolConfig(cpus=0.0))
    actor: PoolConfig = field(default_factory=PoolConfig)
    # false: each pool on placement groups of its own (separate devices); true: the rollout
    # replicas and the actor workers share one placement group, bundle by bundle, and so their
    # GPUs (time-shared, e.g. gpus=0.5 each)
    colocate: bool = False
    # auto: CUDA IPC handles when actor and rollout share a GPU, a broadcast over a dedicated
    # process group (NCCL) when they are on separate GPUs, the object store on the CPU;
    # broadcast on CPU pools runs over gloo
    weights: str = "auto"  # auto | object_store | broadcast | ipc

    def validate(self) -> None:
        check_choice("weights", self.weights, WEIGHT_PATHS)
        check(self.reward.replicas == 1, "reward.replicas", self.reward.replicas,
              "must be 1 (one scorer pool; its scorers run concurrently inside it)")  # fmt: skip


@dataclass(frozen=True)
class RayConfig:
    # "" starts a local Ray instance (and stops it at the end); "auto" or host:port joins a
    # running cluster (left running)
    address: str = ""
    # a local instance's logical CPUs; 0 = all cores, or what the pools ask for if more
    num_cpus: int = 0
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
