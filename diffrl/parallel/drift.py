"""Contract 3 across ranks: ranks that compute on the same rows hold the same prompts.

Under data parallelism each rank holds its own rows, and checks them itself
(``diffrl.types.check_token_hashes``, whose error names the rank). Under tensor and sequence
parallelism the ranks of a ``tp`` or ``sp`` group compute *one* forward together, so they must
also hold the same ``input_ids`` and conditions for the same rows: a rank that re-tokenised a
prompt would otherwise feed its shard of the sequence, or its heads, another text, and the
collectives would mix the two without an error. ``check_tokens_across`` therefore:

1. re-hashes this rank's own rows against the hashes the record carries from the data stage;
2. all-gathers, over each group, what every rank found and the hashes it carries (16 hex
   digits a row: a few kB, not the ids);
3. requires every rank's hashes to equal the group's first rank's, row by row.

Every rank of a group sees the same gathered findings and raises the same ``ContractError``,
so no rank is left waiting in the next collective. Ranks of other groups (another data-parallel
slice) raise only through their own findings.

The adapters likewise (``check_adapters_across``, the actor's ``_check_peers`` after every
optimizer step): the data-parallel (and sp) peers of one tp coordinate take the same step from
the same averaged gradients, and the tp ranks hold the LoRA factors their plan leaves whole as
replicas, so those tensors must stay bit-identical. Each rank all-gathers two float64 sums per
tensor (plain and position-weighted: order-sensitive) over each group, and every rank of a group
where one differs from the group's first rank raises the same error, naming the rank, the tensor
and the axis. A rank that drifted (a missed all-reduce, a partial load, a hardware fault) would
otherwise train on silently, its samples and exports no longer the run's policy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from diffrl.errors import ContractError
from diffrl.types import PromptBatch, TrainBatch, drift_error, drifted_rows


def check_tokens_across(
    record: PromptBatch | TrainBatch,
    groups: Mapping[str, dist.ProcessGroup | None],
    where: str,
) -> None:
    """Contract 3 on this rank and across each of ``groups`` (axis name -> its process group;
    None or a group of one is skipped). Collective over every group given; raises
    ``ContractError`` naming the ranks, the groups and the rows, on every rank of a group
    where any rank drifted."""
    me = dist.get_rank() if dist.is_initialized() else 0
    own = drifted_rows(record)
    problems = {me: [f"rank {me}: {f}" for f in own]} if own else {}
    seen_in = []  # the groups in which some rank drifted
    for axis, group in groups.items():
        if group is None or dist.get_world_size(group) == 1:
            continue
        held: list = [None] * dist.get_world_size(group)
        mine = (me, own, record.ids_hash, record.cond_hash)
        dist.all_gather_object(held, mine, group=group)
        first, _, ids0, cond0 = held[0]
        members = [h[0] for h in held]
        for rank, found, ids, cond in held:
            said = [f"rank {rank}: {f}" for f in found]
            said += _against(rank, first, axis, "input_ids", ids, ids0)
            if (cond is None) != (cond0 is None):
                said.append(f"rank {rank} and rank {first} ({axis} group) disagree on conditions")
            elif cond is not None:
                said += _against(rank, first, axis, "cond", cond, cond0)
            if said:
                problems.setdefault(rank, [])
                problems[rank] += [s for s in said if s not in problems[rank]]
        if any(r in problems for r in members):
            seen_in.append(f"{axis} group of ranks {members}")
    if problems:
        place = f"{where}, seen by rank {me}" + (f" ({'; '.join(seen_in)})" if seen_in else "")
        raise drift_error(place, [p for r in sorted(problems) for p in problems[r]])


def _against(rank: int, first: int, axis: str, name: str, got: tuple, ref: tuple) -> list[str]:
    """How rank ``rank``'s hashes differ from the group's first rank's."""
    if rank == first:
        return []
    if len(got) != len(ref):
        return [f"rank {rank} holds {len(got)} rows, rank {first} {len(ref)} ({axis} group)"]
    bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b]
    if not bad:
        return []
    shown = str(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
    return [f"rank {rank} holds other {name} than rank {first} in rows {shown} ({axis} group)"]


# --- adapters: the ranks that should hold the same LoRA tensors do ---------------------------


def adapter_checksums(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(len(tensors), 2) float64 on the host: per tensor, in the mapping's order, the sum of
    its elements and their sum weighted by position (1 + j / n for the j-th of n), so two
    tensors holding the same values in another order differ. Identical tensors give identical
    sums: the same ops on the same device over the same values."""
    rows = []
    for t in tensors.values():
        flat = t.detach().reshape(-1).double()
        ramp = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64)
        ramp = ramp.div_(max(1, flat.numel())).add_(1.0)
        rows.append(torch.stack([flat.sum(), (flat * ramp).sum()]))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.float64)
    return torch.stack(rows).cpu()


def check_adapters_across(
    groups: Mapping[str, tuple[dist.ProcessGroup | None, Mapping[str, torch.Tensor]]],
    where: str,
) -> None:
    """Every rank of each group holds the same tensors: axis -> (its process group, the
    tensors this rank should share with the group's other ranks, by name, in an order every
    rank shares). Collective over every group given (an all-gather of two floats a tensor);
    a group of one is skipped. Raises ``ContractError`` on every rank of a group where some
    rank's checksums differ from the group's first rank's, naming the rank, the tensors and
    the axis, so no rank is left waiting in the next collective."""
    me = dist.get_rank() if dist.is_initialized() else 0
    problems: list[str] = []
    for axis, (group, tensors) in groups.items():
        if group is None or dist.get_world_size(group) == 1:
            continue
        names = list(tensors)
        mine = adapter_checksums(tensors)
        dev = mine.device
        if dist.get_backend(group) == "nccl":  # nccl gathers CUDA tensors only
            dev = torch.device("cuda", torch.cuda.current_device())
        held = [torch.empty_like(mine, device=dev) for _ in range(dist.get_world_size(group))]
        dist.all_gather(held, mine.to(dev), group=group)
        members = dist.get_process_group_ranks(group)
        ref = held[0].cpu()
        for rank, sums in zip(members[1:], held[1:], strict=True):
            sums = sums.cpu()
            same = (sums == ref) | (sums.isnan() & ref.isnan())  # a NaN on both is no drift
            bad = [names[i] for i in range(len(names)) if not bool(same[i].all())]
            if bad:
                shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
                problems.append(
                    f"rank {rank} holds other values than rank {members[0]} in {shown} "
                    f"({axis} group of ranks {members})"
                )
    if problems:
        raise ContractError(
            f"adapter drift {where}, seen by rank {me}: {'; '.join(problems)}. The ranks of a "
            "data-parallel (or sp) group, and the tp ranks for the LoRA factors they replicate, "
            "take the same optimizer step from the same averaged gradients, so their adapters "
            "must stay identical"
        )
