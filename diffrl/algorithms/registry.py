"""The algorithm registry: the loop looks an algorithm up by name, never branches on it.

An algorithm is a frozen config class plus pure functions:
  prepare(scored, cfg) -> TrainBatch              advantages / r in [0,1] / pairs
  loss(policy, batch, cfg, gen) -> (loss, metrics) one micro-batch, differentiable
  rollout_adapter(cfg) -> str                      which actor adapter the rollout samples with
  after_step(actor, step, cfg) -> bool             e.g. refresh the old policy; True = the
                                                   rollout's adapter changed (sync it)
  changes_rollout(step, cfg) -> bool               will after_step(step) change the rollout's
                                                   weights? If not, the controller may start
                                                   the next rollout before this update ends
  diagnostics(policy, batch, cfg) -> metrics       optional, before the update (no grad)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from diffrl.errors import check
from diffrl.types import ScoredBatch, TrainBatch


@dataclass(frozen=True)
class AlgorithmConfig:
    """Base of every algorithm's config; each algorithm subclasses it with its own fields."""

    name: str = "diffusion_nft"


def check_training_draws(draws_key: str, draws: int, sigma_min: float, sigma_max: float) -> None:
    """The shared checks of losses that re-noise clean samples: draws >= 1, and
    sigma ~ U(sigma_min, sigma_max) inside [0, 1]."""
    check(draws >= 1, draws_key, draws, "must be >= 1")
    check(
        0 <= sigma_min < sigma_max <= 1,
        "sigma_max",
        sigma_max,
        "need 0 <= sigma_min < sigma_max <= 1",
    )


class Policy(Protocol):
    """What a loss may call: the canonical velocity under an adapter (None = reference,
    i.e. adapters disabled)."""

    def velocity(
        self, x: Tensor, sigma: Tensor, input_ids: Tensor, adapter: str | None = "default"
    ) -> Tensor: ...


@dataclass(frozen=True)
class Algorithm:
    name: str
    config_cls: type
    prepare: Callable[[ScoredBatch, Any], TrainBatch]
    loss: Callable[..., tuple[Tensor, dict[str, float]]]
    rollout_adapter: Callable[[Any], str]
    after_step: Callable[[Any, int, Any], bool]
    needs_logprobs: bool = False
    changes_rollout: Callable[[int, Any], bool] = lambda step, cfg: True
    # diagnostics(policy, batch, cfg) -> metrics, run by the actor (no grad) before the
    # update, with the weights the rollout used (e.g. FlowGRPO's log-prob consistency)
    diagnostics: Callable[[Policy, TrainBatch, Any], dict[str, float]] | None = None


_ALGORITHMS: dict[str, Algorithm] = {}
_BUILTIN_MODULES = (
    "diffrl.algorithms.diffusion_nft",
    "diffrl.algorithms.flow_grpo",
    "diffrl.algorithms.diffusion_dpo",
)


def register_algorithm(algo: Algorithm) -> Algorithm:
    if algo.name in _ALGORITHMS:
        raise ValueError(f"algorithm {algo.name!r} registered twice")
    _ALGORITHMS[algo.name] = algo
    return algo


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def registered_algorithms() -> list[str]:
    _load_builtins()
    return sorted(_ALGORITHMS)


def get_algorithm(name: str) -> Algorithm:
    _load_builtins()
    if name not in _ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; registered: {sorted(_ALGORITHMS)}")
    return _ALGORITHMS[name]
