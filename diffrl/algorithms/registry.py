"""The algorithm registry: the loop looks an algorithm up by name, never branches on it.

An algorithm is one typed record (``Algorithm``): a frozen config class (an ``AlgorithmConfig``)
plus pure functions of it:
  prepare(scored, cfg) -> TrainBatch              advantages / r in [0,1] / pairs
  loss(policy, batch, cfg, gen[, backward])       one micro-batch, differentiable
       -> (loss, metrics)
  weight_plan(step, cfg) -> WeightPlan             as data, what happens to the weights after
                                                   update ``step`` (counted from 1): which
                                                   adapter the rollout samples with, whether
                                                   ``old`` refreshes, whether to sync; the
                                                   controller carries it out
  train_cost(cfg, batch) -> TrainCost              forwards and backwards per trained sample
                                                   (``diffrl bench``'s FLOP model)
  diagnostics(policy, batch, cfg) -> metrics       optional, before the update (no grad)
  first_step_gate(diagnostics, cfg, dtype)         optional, on the first step's diagnostics:
                                                   raises when rollout and training disagree
and what it needs of the rest of the run, as data (``needs_logprobs``, the config's
``whole_batch_keys``), which ``Algorithm.validate`` checks against the run's config.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from diffrl.errors import ConfigError, check
from diffrl.types import ScoredBatch, TrainBatch

if TYPE_CHECKING:  # typing.Self is Python 3.11+; annotations are never evaluated at run time
    from typing_extensions import Self


@dataclass(frozen=True)
class WeightPlan:
    """What the controller does to the weights after one update (DESIGN §1).

    ``sync`` is False only when the update cannot change the weights the rollout samples with
    (DiffusionNFT between refreshes of ``old``): the controller may then start the next
    step's rollout before the update ends, and the samples are the same either way."""

    rollout_adapter: str  # the actor adapter the rollout samples with ("default" or "old")
    refresh_old: float | None = None  # old <- d * old + (1 - d) * default; None = keep old
    sync: bool = True  # push rollout_adapter's weights to the rollout after this update


MODALITY_STDS = ("pooled", "own")  # algorithm.modality_std (algorithms/modality.py)


@dataclass(frozen=True)
class AlgorithmConfig:
    """Base of every algorithm's config; each algorithm subclasses it with its own fields."""

    name: str = "diffusion_nft"
    # credit per modality (video+audio families): each modality's advantage from its own
    # rewards plus the joint ones, training its own part of the latent (algorithms/modality.py)
    modality_credit: bool = False
    # the scale of the modalities' advantages: pooled (one std per group over both modalities'
    # centred rewards) | own (each modality's own group std)
    modality_std: str = "pooled"

    def validate(self) -> None:
        """The algorithm's own fields (``ConfigError`` names the key); none here."""

    def unbatched(self) -> Self:
        """This config with the loss's no-grad forwards (an old policy's, a reference's) made
        one per timestep beside the policy's, as a diffusers training script runs them (the
        ``diffrl bench`` baseline); itself when the loss batches none."""
        return self

    def one_step_reason(self) -> str | None:
        """Why this setting needs one optimizer step per update (``actor.minibatches=1``), or
        None when it does not."""
        return None

    def whole_batch_keys(self) -> tuple[str, ...]:
        """Keys set to something ``prepare`` needs the whole step's batch for (a batch-wide
        normalisation): a micro-batch of whole groups cannot be prepared alone under them."""
        return ()


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
# a loss's metrics: name -> value, a 0-d device tensor or a number (the actor reads the
# tensors all in one host sync per step)
Metrics = dict[str, Tensor | float]


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
class TrainCost:
    """Passes through the policy network per trained sample of one update, in forward
    equivalents of one sample at one timestep (the family's ``flops(1)``). A backward through
    frozen weights takes input gradients only: one forward's worth (a floor: attention's takes
    two, both its operands being activations)."""

    forwards: float  # with and without grad: the policy's, the old policy's, a reference's
    backwards: float

    @property
    def passes(self) -> float:
        return self.forwards + self.backwards


C = TypeVar("C", bound=AlgorithmConfig)
C_contra = TypeVar("C_contra", bound=AlgorithmConfig, contravariant=True)


class Loss(Protocol[C_contra]):
    """One micro-batch's loss -> (total, metrics); metric values may be 0-d device tensors
    (the actor reads them all in one sync per step). With ``partial_backward`` the loss takes
    ``backward`` and hands it each additive part of itself (``add_part``), returning the total
    detached."""

    def __call__(
        self,
        policy: Policy,
        batch: TrainBatch,
        cfg: C_contra,
        gen: torch.Generator,
        backward: Backward | None = None,
    ) -> tuple[Tensor, Metrics]: ...


class RunSettings(Protocol):
    """The loop settings an algorithm's cross-component rules read (``config.RunConfig``)."""

    @property
    def mode(self) -> str: ...
    @property
    def stale(self) -> str: ...
    @property
    def stream_train(self) -> bool: ...


class RolloutSettings(Protocol):
    """The rollout settings they read (``rollout.engine.RolloutConfig``)."""

    @property
    def sampler(self) -> str: ...
    @property
    def keep_latents(self) -> bool: ...
    @property
    def noise_level(self) -> float: ...
    @property
    def ode_tail_steps(self) -> int: ...
    @property
    def group_size(self) -> int: ...


class Setup(Protocol):
    """What of the root config (``config.Config``) the rules read."""

    @property
    def run(self) -> RunSettings: ...
    @property
    def rollout(self) -> RolloutSettings: ...
    @property
    def algorithm(self) -> AlgorithmConfig: ...


@dataclass(frozen=True)
class Algorithm(Generic[C]):
    name: str
    config_cls: type[C]
    prepare: Callable[[ScoredBatch, C], TrainBatch]
    loss: Loss[C]
    weight_plan: Callable[[int, C], WeightPlan]
    # forwards and backwards per trained sample of an update on this batch
    train_cost: Callable[[C, TrainBatch], TrainCost]
    # trains on the rollout's per-step log-probs (stochastic, kept trajectories): it can also
    # correct a stale sample by its importance ratio (run.stale=correct)
    needs_logprobs: bool = False
    partial_backward: bool = False
    # diagnostics(policy, batch, cfg) -> metrics, run by the actor (no grad) before the
    # update, with the weights the rollout used (e.g. FlowGRPO's log-prob consistency)
    diagnostics: Callable[[Policy, TrainBatch, C], dict[str, float]] | None = None
    # first_step_gate(diagnostics, cfg, compute dtype), run by the actor on the diagnostics of
    # its first step (before any update): raises when rollout and training disagree
    first_step_gate: Callable[[dict[str, float], C, torch.dtype], None] | None = None
    # what the algorithm learns from within a prompt's group of samples, for the error that
    # refuses rollout.group_size=1: a group of one has nothing to compare, every advantage (or
    # pair) is empty, and the run would train nothing while exiting 0
    group_use: str = "its advantages are each sample's reward minus its group's mean"
    # learns from comparing a prompt's samples (every RL loss here); False for one that trains
    # on each sample alone (distillation), which a group of one serves as well
    needs_groups: bool = True

    def validate(self, cfg: Setup) -> None:
        """What this algorithm needs of the rest of the run, checked before any work: the
        rollout it trains on (groups of two or more samples per prompt), run.stale=correct,
        and run.stream_train."""
        if self.needs_groups and cfg.rollout.group_size < 2:
            raise ConfigError(
                f"config key 'rollout.group_size' = {cfg.rollout.group_size}: {self.name} "
                f"needs at least 2 samples per prompt ({self.group_use}, so a group of one "
                "trains nothing); set rollout.group_size >= 2"
            )
        check_rollout_for(self, cfg.rollout)
        if cfg.algorithm.modality_std not in MODALITY_STDS:
            raise ConfigError(
                f"config key 'algorithm.modality_std' = {cfg.algorithm.modality_std!r}: must be "
                f"one of {list(MODALITY_STDS)}"
            )
        run = cfg.run
        if run.mode == "async" and run.stale == "correct" and not self.needs_logprobs:
            raise ConfigError(
                f"config key 'run.stale' = 'correct': {self.name} has no importance ratio to "
                "correct a stale sample with (it trains on final samples, not on recorded "
                "log-probs); use run.stale=drop or keep"
            )
        if run.stream_train:
            for key in cfg.algorithm.whole_batch_keys():
                value = getattr(cfg.algorithm, key)
                default = getattr(type(cfg.algorithm)(), key)
                want = str(default).lower() if isinstance(default, bool) else default
                raise ConfigError(
                    f"config key 'algorithm.{key}' = {value!r}: run.stream_train prepares each "
                    "micro-batch alone, which this setting needs the whole batch for; set "
                    f"algorithm.{key}={want}"
                )


def check_rollout_for(algorithm: Algorithm, r: RolloutSettings) -> None:
    """An algorithm that trains on per-step log-probs needs stochastic, kept trajectories; one
    that trains on the final samples must not get them from a coarse ODE tail."""
    if not algorithm.needs_logprobs:
        if r.ode_tail_steps:
            raise ConfigError(
                f"config key 'rollout.ode_tail_steps' = {r.ode_tail_steps}: "
                f"{algorithm.name} trains on the final samples, so a coarse ODE tail would train "
                "it on rougher images; the option is for the GRPO family (set it to 0)"
            )
        return
    for key, ok, want in (
        ("sampler", r.sampler == "sde", "sde"),
        ("keep_latents", r.keep_latents, "true"),
        ("noise_level", r.noise_level > 0, "> 0"),
    ):
        if not ok:
            raise ConfigError(
                f"config key 'rollout.{key}' = {getattr(r, key)!r}: {algorithm.name} trains on "
                "per-step log-probs of stochastic trajectories; "
                f"set rollout.{key}={want}"
            )


_ALGORITHMS: dict[str, Algorithm[Any]] = {}


def register_algorithm(algo: Algorithm[C]) -> Algorithm[C]:
    if algo.name in _ALGORITHMS:
        raise ValueError(f"algorithm {algo.name!r} registered twice")
    _ALGORITHMS[algo.name] = algo
    return algo


@functools.cache
def _load_builtins() -> None:
    """Import every module of this package, once: each algorithm's registers itself, so adding
    one touches no other file."""
    package = __name__.rsplit(".", 1)[0]
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{package}.{info.name}")


def registered_algorithms() -> list[str]:
    _load_builtins()
    return sorted(_ALGORITHMS)


def get_algorithm(name: str) -> Algorithm[Any]:
    _load_builtins()
    if name not in _ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; registered: {sorted(_ALGORITHMS)}")
    return _ALGORITHMS[name]


def default_config() -> AlgorithmConfig:
    """The default algorithm's config (``Config.algorithm`` before a recipe names one)."""
    return get_algorithm(AlgorithmConfig.name).config_cls()
