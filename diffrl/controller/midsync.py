"""Rollouts that survive a weight sync (``run.async_sync=step``), the async loop's side.

With ``step``, an update the actor publishes while the rollout samples is offered to it
(``RolloutEngine.offer``): the sampling thread applies it at the next denoising-step boundary
and the batch in flight continues under the new weights, each step recording the version that
took it (``Trajectory.step_versions``). What this module decides:

- **the record's version for the staleness bound** (``bound_version``): the oldest version
  among the steps the algorithm's loss reads. FlowGRPO (``needs_logprobs``) trains on the
  SDE steps' log-probs, so the oldest version among the stochastic steps; each of those steps
  is also weighed by its own truncated importance weight, and the bound keeps those weights'
  spread bounded. NFT and DPO train on the final samples x0 only, which the final step
  produces, so the final step's version (the oldest over the batch's micro-batches): the steps
  before it shaped x0 too, but the source gate (``Clock.may_start``) still keeps the oldest
  of them within ``max_staleness`` when the batch starts. The steps carry the versions of the
  weights that took them, which lag the plan's between syncs (NFT's ``old`` policy refreshed
  every few updates), so the record's version is the larger of this and the actor's version
  when the batch started (today's record version, which it stays without a sync mid-batch).
- **the work kept**: ``async/produced`` counts the records the rollout finished and
  ``async/kept_share`` is the share of them the actor trained on (dropped ones and those still
  ahead of the actor are the rest); ``async/step_staleness_mean`` is the mean lag, in
  versions, of the weights that took the trained batch's steps behind the actor (the freshness
  a mid-rollout sync buys; between NFT's refreshes of ``old`` it includes that lag).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from diffrl.errors import ConfigError
from diffrl.sync.weights import WeightUpdate
from diffrl.types import Trajectory

if TYPE_CHECKING:
    from diffrl.config import Config


@runtime_checkable
class OffersWeights(Protocol):
    """A rollout that takes weight updates mid-sampling (``RolloutEngine``, ``RemoteRollout``)."""

    def offer(self, update: WeightUpdate) -> None: ...

    def take_synced(self) -> dict[str, float]: ...


def check_midsync(cfg: Config, rollout: object, fixed: bool) -> None:
    """Before an async run with ``run.async_sync=step`` starts: its weights are not fixed per
    iteration (``auto`` resolves to fixed under torchrun; ``fixed`` itself is refused at load),
    and its rollout takes offers (a remote or local engine with its own copy, not a TP-sharded
    one, whose ranks would have to switch at the same step)."""
    if cfg.run.async_sync != "step":
        return
    if fixed:
        raise ConfigError(
            "config key 'run.async_sync' = 'step': this launch runs run.async_weights="
            f"{cfg.run.async_weights!r} as fixed (one weight schedule for all ranks), which a "
            "sync mid-rollout would break; use run.async_sync=batch"
        )
    shared = getattr(rollout, "shared", False) or getattr(rollout, "collective", False)
    if not isinstance(rollout, OffersWeights) or shared:
        raise ConfigError(
            "config key 'run.async_sync' = 'step': this run's rollout "
            f"({type(rollout).__name__}{', shared or TP-sharded' if shared else ''}) takes no "
            "weights mid-rollout; use run.async_sync=batch"
        )


def bound_version(traj: Trajectory, per_step: bool) -> int:
    """The version the staleness bound measures ``traj`` by (see the module docstring):
    ``per_step`` (the loss trains on per-step log-probs) -> the oldest among its stochastic
    steps; else the oldest final step. ``policy_version`` without per-step records."""
    versions = traj.step_versions
    if versions is None or versions.numel() == 0:
        return traj.policy_version
    if per_step and traj.sde_mask is not None and bool(traj.sde_mask.any()):
        return int(versions[:, traj.sde_mask].min())
    return int(versions[:, -1].min())


def step_staleness(traj: Trajectory, actor_version: int) -> float:
    """Mean lag of ``traj``'s steps behind ``actor_version`` (the record's own lag without
    per-step records)."""
    if traj.step_versions is None or traj.step_versions.numel() == 0:
        return float(actor_version - traj.policy_version)
    return float((actor_version - traj.step_versions.to(torch.float64)).mean())
