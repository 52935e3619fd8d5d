"""What the LoRA adapter is bound to, counted at start-up (the bound-module gate).

A target list that matches nothing, or less than it declares (a typo'd suffix, an engine
upgrade that renamed a module), trains nothing or less, and the run still "finishes
successfully" (verl-omni #552). So before any work every declared target suffix must match
Linear modules of the model, and the actor (peft's LoRA layers) and the rollout copy (the
modules it will merge updates into, named before its serving layout fuses or splits them)
must hold the same modules, with the same weight shapes and dtypes. Their count is logged once
per run: "LoRA on 96 of 96 target modules (family sd3)".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from diffrl.errors import ContractError

log = logging.getLogger(__name__)

# module name -> (weight shape, weight dtype)
Bound = dict[str, tuple[tuple[int, ...], torch.dtype]]


class BoundModuleError(ContractError):
    """The LoRA targets bind no module, fewer than declared, or different ones in the actor
    and in the rollout copy."""


def matches(name: str, target: str) -> bool:
    """peft's and ``expanded_targets``' rule: the name is the target or ends in ".target"."""
    return name == target or name.endswith("." + target)


def bound_of(weights: Mapping[str, Tensor]) -> Bound:
    return {name: (tuple(w.shape), w.dtype) for name, w in weights.items()}


def linear_weights(model: nn.Module, names: Iterable[str]) -> dict[str, Tensor]:
    """The weights of the named modules (names without one are left out: the gate then
    reports them as missing from this side)."""
    modules = dict(model.named_modules())
    weights = {n: getattr(modules.get(n), "weight", None) for n in names}
    return {n: w for n, w in weights.items() if isinstance(w, Tensor)}


def match_targets(names: Iterable[str], targets: Iterable[str], family: str, where: str) -> dict:
    """-> target suffix -> the ``names`` it matches (sorted); raises BoundModuleError naming
    the family and the suffixes that match nothing (all of them: a run that trains nothing)."""
    names, targets = sorted(names), list(targets)
    found = {t: [n for n in names if matches(n, t)] for t in targets}
    empty = [t for t, hit in found.items() if not hit]
    if not targets or len(empty) == len(targets):
        raise BoundModuleError(
            f"LoRA targets {targets} bind no module of the {where} (family {family}): the run "
            "would train nothing; name the model's Linear modules (actor.lora.targets, or the "
            "family's lora_targets)"
        )
    if empty:
        bound = sum(len(found[t]) for t in targets if found[t])
        raise BoundModuleError(
            f"LoRA target {empty[0]!r} binds no module of the {where} (family {family}), "
            f"while the other targets bind {bound}: a misspelt or renamed target trains less "
            f"than declared (targets matching nothing: {empty})"
        )
    return found


@dataclass(frozen=True)
class BoundReport:
    family: str
    targets: tuple[str, ...]
    bound: int  # modules the actor's adapter is on (== the rollout's)
    declared: int  # modules the declared targets name in the rollout copy
    per_target: dict[str, int]

    def line(self) -> str:
        each = ", ".join(f"{t}: {n}" for t, n in self.per_target.items())
        return (
            f"LoRA on {self.bound} of {self.declared} target modules (family {self.family}; {each})"
        )

    def as_metrics(self) -> dict[str, float]:
        return {"lora/bound_modules": self.bound, "lora/target_modules": self.declared}


def check_bound(targets: Iterable[str], family: str, actor: Bound, rollout: Bound) -> BoundReport:
    """The gate: every target suffix binds modules in the actor and in the rollout copy, and
    both hold the same modules with the same weight shapes and dtypes. Raises
    BoundModuleError naming the first difference; returns the counts (and logs them)."""
    targets = tuple(targets)
    per = match_targets(actor, targets, family, "actor")
    match_targets(rollout, targets, family, "rollout copy")
    only_a, only_r = sorted(set(actor) - set(rollout)), sorted(set(rollout) - set(actor))
    if only_a or only_r:
        first = (only_a or only_r)[0]
        side = "the actor's adapter but not the rollout copy" if only_a else (
            "the rollout copy's targets but not the actor's adapter"
        )  # fmt: skip
        raise BoundModuleError(
            f"LoRA modules differ between actor ({len(actor)}) and rollout ({len(rollout)}) "
            f"(family {family}): {first} is in {side} (actor only: {only_a[:5]}, rollout "
            f"only: {only_r[:5]}); a sync would miss or refuse it"
        )
    for name in sorted(actor):
        (sa, da), (sr, dr) = actor[name], rollout[name]
        if sa != sr or da != dr:
            raise BoundModuleError(
                f"LoRA module {name} (family {family}) differs between actor and rollout: "
                f"actor weight {list(sa)} {da}, rollout weight {list(sr)} {dr}"
            )
    report = BoundReport(
        family,
        targets,
        len(actor),
        len(rollout),
        {t: len(names) for t, names in per.items()},
    )
    log.info("%s", report.line())
    return report
