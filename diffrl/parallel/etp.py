"""Tensor parallelism of the frozen text encoders in ``diffrl train`` (``parallel.etp``).

Each text encoder whose architecture (``config.model_type``) has a plan in the family's record
(``FamilySpec.etp_plans``, ``models/families/_encoder_plans.py``) is sharded over this rank's ETP
group (``Meshes.etp``: ``etp`` consecutive ranks) with ``tp.apply_plan``, right after the model
loads and before anything encodes (``build.rollout_side``). Encoders without a plan stay whole
on every rank (SD3's two small CLIPs beside its sharded T5), as ``diffrl plan`` counts them; a
family none of whose encoders has a plan refuses ``parallel.etp > 1``.

A sharded encoder's forward is a collective: every rank of the group must call it with the same
rows at the same time. Encoding is lazy elsewhere (``DiffusersNet.conditions`` encodes a cache
miss inside the DiT's forward), and data-parallel ranks hold different prompts, so their misses
differ and a lazy encode would hang the group. Instead the ranks encode, at start-up, every row
the run can ask for: the training prompts and the held-out prompts (every rank builds both sets
whole and identically; the data-parallel split comes later, ``prompt_source``) and the empty
prompt CFG's unconditional branch runs on, in one order and one chunking on every rank
(``encode_all``). That fills the ``EncodeCache`` the rollout, the evaluator and the actor share
(one per process; copies of the model keep the same cache), and then seals it: a later miss is a
``ContractError`` naming the row, where it would otherwise deadlock. The set must fit the cache
(its capacity, 4096 rows: what one process may already hold), else a ``ConfigError`` at
start-up. The start-up probe's prompts are encoded before the seal, in step on every rank, as
every rank runs the same probe.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from diffrl.errors import ConfigError, ContractError
from diffrl.parallel.dims import KEY
from diffrl.parallel.tp import Plan, apply_plan
from diffrl.types import hash_rows

log = logging.getLogger(__name__)


def text_encoders(model) -> dict[str, nn.Module]:
    """The family's frozen text encoders by name (transformers models; the rest are VAEs)."""
    from transformers import PreTrainedModel

    from diffrl.models.registry import frozen_modules

    return {k: m for k, m in frozen_modules(model).items() if isinstance(m, PreTrainedModel)}


def encoder_type(module: nn.Module) -> str:
    return str(getattr(getattr(module, "config", None), "model_type", ""))


def encoder_plans(model, spec, etp: int) -> dict[str, Plan]:
    """Encoder name -> its ETP plan, for the encoders the family has one for; a ConfigError
    naming the family and each encoder when none has."""
    encoders = text_encoders(model)
    plans = {
        n: dict(spec.etp_plans[encoder_type(m)])
        for n, m in encoders.items()
        if encoder_type(m) in spec.etp_plans
    }
    if not plans:
        have = ", ".join(
            f"{n} ({type(m).__name__}, model_type {encoder_type(m)!r})" for n, m in encoders.items()
        )
        raise ConfigError(
            f"{KEY}.etp={etp}: model family {spec.name!r} has no ETP plan for any of its text "
            f"encoders ({have or 'none'}); its record has plans for model types "
            f"{sorted(spec.etp_plans)}. Set {KEY}.etp=1"
        )
    return plans


def shard_encoders(model, spec, mesh: DeviceMesh) -> list[str]:
    """Shard each of ``model``'s text encoders that has a plan over the ETP ``mesh``, in place
    (the weights every rank keeps come from rank 0's copy); returns their names. An encoder the
    family offloads to the host between encodes is moved to the compute device first and stays
    there: ETP is the other way to make it fit (``diffrl plan`` counts it so)."""
    etp = mesh.size()
    plans = encoder_plans(model, spec, etp)
    encoders = text_encoders(model)
    net = model.net
    if getattr(net, "offload", False):
        device = net.compute_device()
        for m in encoders.values():
            m.to(device)
        net.offload = False
    for name, plan in plans.items():
        try:
            apply_plan(encoders[name], mesh, plan)
        except ConfigError as e:
            raise ConfigError(
                f"{KEY}.etp={etp}: model family {spec.name!r}, text encoder {name!r} "
                f"({type(encoders[name]).__name__}): {e}"
            ) from e
    whole = sorted(set(encoders) - set(plans))
    rest = f"; {', '.join(whole)} whole on every rank (no plan)" if whole else ""
    log.info("ETP: text encoder(s) %s sharded over %d ranks%s", ", ".join(plans), etp, rest)
    return list(plans)


def encode_all(model, rows: list[Tensor], group, chunk: int) -> int:
    """Encode every distinct row of ``rows`` (each (N, L) or (L,) token ids, the same on every
    rank of ``group``) into the model's ``EncodeCache``, in first-seen order, ``chunk`` rows per
    encoder call, then seal the cache; returns the number of distinct rows. Collective over
    ``group``: the ranks first check they hold the same rows (a ``ContractError`` naming the
    ranks that differ, instead of a hang)."""
    net = model.net
    cache = net.cache
    ids = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])
    keys = hash_rows(ids)
    first = {k: i for i, k in reversed(list(enumerate(keys)))}  # key -> its first row
    order = sorted(first, key=first.get)
    if len(order) > cache.capacity:
        raise ConfigError(
            f"{KEY}.etp: every prompt row is encoded at start-up and kept, and this run has "
            f"{len(order)} distinct rows (training + held-out prompts + the empty one), more "
            f"than the text-encoder cache's {cache.capacity}; use fewer prompts (data.* keys, "
            f"data.eval_prompts) or set {KEY}.etp=1"
        )
    _check_same(order, group)
    uniq = ids[[first[k] for k in order]]
    for start in range(0, len(order), max(1, chunk)):
        cache.get(uniq[start : start + chunk], net._encode)
    cache.sealed = (
        f"under {KEY}.etp every prompt row is encoded at start-up (training and held-out prompts, "
        "the empty prompt), collectively over the encoder's group; a row outside them would "
        "have this rank encode alone and hang the group"
    )
    return len(order)


def _check_same(keys: list[str], group) -> None:
    """Every rank of ``group`` holds the same rows in the same order (a digest each)."""
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, digest, group=group)
    if len(set(seen)) > 1:
        raise ContractError(
            f"{KEY}.etp: the ranks of this ETP group hold different prompt rows to encode at "
            f"start-up (digests by group rank: {seen}); their collective encodes would not "
            "line up. Every rank must build the same training and held-out prompt sets"
        )
