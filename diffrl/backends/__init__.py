"""Engine backends: where a run's engines live. ``run.backend=local`` builds them in this
process (``diffrl.build``); ``run.backend=ray`` places them as Ray actors (``backends/ray.py``),
behind the same Protocols. Importing this package does not import Ray (an optional extra:
``pip install -e '.[ray]'``); its settings are ``diffrl.placement.RayConfig``.
"""

from __future__ import annotations

from diffrl.build import Engines, build
from diffrl.config import Config


def build_engines(cfg: Config) -> Engines:
    """The run's engines for ``run.backend``."""
    if cfg.run.backend == "ray":
        from diffrl.backends.ray import build_ray  # ray is an optional extra

        if cfg.placement.actor.replicas > 1:  # the actor as a torch.distributed group
            from diffrl.backends import ray_actor_group as group

            group.check_group(cfg)  # before anything is placed
            return build_ray(cfg, group.start_group)
        return build_ray(cfg)
    return build(cfg)
