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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

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
