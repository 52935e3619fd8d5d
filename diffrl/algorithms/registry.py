"""The algorithm registry: the loop looks an algorithm up by name, never branches on it.

An algorithm is a frozen config class plus pure functions:
  prepare(scored, cfg) -> TrainBatch              advantages / r in [0,1] / pairs
  loss(policy, batch, cfg, gen) -> (loss, metrics) one micro-batch, differentiable
  weight_plan(step, cfg) -> WeightPlan             as data, what happens to the weights after
                                                   update ``step`` (counted from 1): which
                                                   adapter the rollout samples with, whether
                                                   ``old`` refreshes, whether to sync; the
                                                   controller carries it out
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
class WeightPlan:
    """What the controller does to the weights after one update (DESIGN §1).

    ``sync`` is False only when the update cannot change the weights the rollout samples with
    (DiffusionNFT between refreshes of ``old``): the controller may then start the next
    step's rollout before the update ends, and the samples are the same either way."""

    rollout_adapter: str  # the actor adapter the rollout samples with ("default" or "old")
    refresh_old: float | None = None  # old <- d * old + (1 - d) * default; None = keep old
    sync: bool = True  # push rollout_adapter's weights to the rollout after this update


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
    i.e. adapters disabled); ``cond`` is the batch's ``TrainBatch.cond`` for those rows."""

    def velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        input_ids: Tensor,
        adapter: str | None = "default",
        cond: Tensor | None = None,
    ) -> Tensor: ...


Backward = Callable[[Tensor], None]


def add_part(total: Tensor, part: Tensor, backward: Backward | None) -> Tensor:
    """``total + part``. Given ``backward``, the part's gradient is taken now, so its autograd
    graph is freed before the next part's is built, and the part joins the total detached: a
    loss over T timesteps then holds one timestep's activations instead of T (the default
    recipe's peak host memory fell by ~4x), with the same gradient up to float summation order."""
    if backward is None:
        return total + part
    backward(part)
    return total + part.detach()


def per_forward(steps: int, samples: int, max_rows: int) -> int:
    """How many of ``steps`` timesteps of ``samples`` samples one batched no-grad forward
    takes, about ``max_rows`` samples at most (at least one timestep), balanced so that the
    forwards are about equal: 9 steps of 4 samples at 32 rows -> 5 (forwards of 5 and 4)."""
    fit = max(1, max_rows // max(1, samples))
    forwards = -(-steps // fit)
    return -(-steps // forwards)


@dataclass(frozen=True)
class Algorithm:
    name: str
    config_cls: type
    prepare: Callable[[ScoredBatch, Any], TrainBatch]
    # loss(policy, batch, cfg, gen[, backward]) -> (total, metrics); metric values may be
    # 0-d device tensors (the actor reads them all in one sync per step); an algorithm with
    # ``partial_backward`` takes ``backward`` and hands it each additive part of its loss
    # (``add_part``), returning the total detached
    loss: Callable[..., tuple[Tensor, dict[str, float | Tensor]]]
    weight_plan: Callable[[int, Any], WeightPlan]
    needs_logprobs: bool = False
    partial_backward: bool = False
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
