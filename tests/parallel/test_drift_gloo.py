"""Contract 3 across ranks (``parallel/drift.py``, ``Ranks.rows_groups``), over 2 gloo ranks.

Under tensor (or sequence) parallelism both ranks compute on the same rows, so they must hold
the same ids and conditions. Each test spawns the ranks as a ``tp=2`` or ``sp=2`` mesh
(``build_meshes``),
hands each a batch, and records what each rank raised; the parent asserts on both:

- the same batch on both ranks passes;
- rank 1's ids re-tokenised with its own, consistent hashes (its own check passes): only the
  comparison across the group sees it, and both ranks raise naming rank 1 and the row;
- rank 1's ids changed on the way (the data stage's hashes kept): both ranks raise naming it;
- rank 1's conditioning frame re-encoded differently: both raise naming cond and the row;
- the actor (``ActorEngine`` given the mesh's ``rows_groups``) refuses before training;
- with data parallelism alone (no groups) only rank 1 raises, naming "rank 1 of 2";
- and so does ``diffrl train`` over 2 data-parallel ranks whose rank 1 receives a drifted id.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import finish_rank, free_port, init_gloo, run_ranks

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

WORLD = 2
DEADLINE_S = 60.0  # a rank left waiting in a collective fails here


def _batch():
    from tiny_models import make_train_batch

    from diffrl.types import hash_cond_rows

    b = make_train_batch(4)
    cond = torch.linspace(-1, 1, 4 * 2 * 6).view(4, 2, 6)
    return dataclasses.replace(b, cond=cond, cond_hash=hash_cond_rows(cond))


def _worker(rank: int, port: int, out: str, axis: str) -> None:
    from tiny_models import make_tiny_model

    from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm
    from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS
    from diffrl.parallel.dims import ParallelDims, build_meshes
    from diffrl.parallel.drift import check_tokens_across
    from diffrl.parallel.launch import Ranks
    from diffrl.types import check_token_hashes, hash_cond_rows, hash_rows

    init_gloo(rank, WORLD, port, DEADLINE_S)
    meshes = build_meshes(ParallelDims(dp_shard=1, world_size=WORLD, **{axis: 2}), "cpu")
    groups = Ranks(rank, WORLD, meshes).rows_groups
    batch = _batch()
    ids = batch.input_ids.clone()
    ids[2, 1] += 1
    frame = batch.cond.clone()
    frame[3, 1, 0] = 0.5
    mine = {  # what rank 1 holds in each case; rank 0 always holds the data stage's batch
        "same": batch,
        "retokenised": dataclasses.replace(batch, input_ids=ids, ids_hash=hash_rows(ids)),
        "changed": dataclasses.replace(batch, input_ids=ids),
        "cond": dataclasses.replace(batch, cond=frame, cond_hash=hash_cond_rows(frame)),
    }
    seen: dict[str, str | None] = {"groups": sorted(groups)}
    for case, held in mine.items():
        try:
            check_tokens_across(held if rank == 1 else batch, groups, "the actor")
            seen[case] = None
        except Exception as e:  # noqa: BLE001 - the parent asserts on the message
            seen[case] = f"{type(e).__name__}: {e}"

    actor = ActorEngine(
        make_tiny_model(0),
        ActorConfig(lr=1e-2, lora=AdapterConfig(rank=4, alpha=4.0)),
        list(TINY_DIT_LORA_TARGETS),
        get_algorithm("diffusion_nft"),
        NFTConfig(weighting="uniform", timesteps_per_sample=1),
        torch.device("cpu"),
        rows_groups=groups,
    )
    try:
        actor.train_step(mine["retokenised"] if rank == 1 else batch)
        seen["actor"] = None
    except Exception as e:  # noqa: BLE001
        seen["actor"] = f"{type(e).__name__}: {e}"
    seen["actor_version"] = actor.version

    try:  # data parallelism alone: each rank its own rows, no group to compare with
        check_token_hashes(mine["changed"] if rank == 1 else batch, "the actor")
        seen["dp"] = None
    except Exception as e:  # noqa: BLE001
        seen["dp"] = f"{type(e).__name__}: {e}"
    finish_rank(Path(out), rank, seen)


@pytest.mark.parametrize("axis", ["tp", "sp"])
def test_token_drift_across_a_tp_or_sp_group(axis: str, tmp_path: Path) -> None:
    run_ranks(_worker, WORLD, (free_port(), str(tmp_path), axis), DEADLINE_S)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, s in enumerate(seen):
        assert s["groups"] == [axis]
        assert s["same"] is None, s
        group = rf"token drift at the actor, seen by rank {rank} \({axis} group of ranks \[0, 1\]\)"
        assert s["retokenised"].startswith("ContractError: "), s
        assert _match(rf"{group}: rank 1 holds other input_ids than rank 0 in rows \[2\]", s)
        assert _match(
            rf"{group}: rank 1: input_ids of rows \[2\] changed since the data stage", s, "changed"
        )
        assert _match(rf"{group}: rank 1 holds other cond than rank 0 in rows \[3\]", s, "cond")
        assert _match(r"rank 1 holds other input_ids than rank 0 in rows \[2\]", s, "actor")
        assert s["actor_version"] == 0  # refused before any update
    assert seen[0]["dp"] is None
    assert seen[1]["dp"].startswith(
        "ContractError: token drift at the actor on rank 1 of 2: input_ids of rows [2]"
    )


def _match(pattern: str, seen: dict, case: str = "retokenised") -> bool:
    import re

    return seen[case] is not None and re.search(pattern, seen[case]) is not None


def _dp_train_worker(rank: int, port: int, over: list[str]) -> None:
    """``diffrl train`` as torchrun's rank ``rank`` of 2 (data parallel); on rank 1 the
    trajectories reach the controller with one id of row 1 changed."""
    import asyncio
    import os

    from diffrl.build import build
    from diffrl.config import load_config
    from diffrl.controller.sync import train_sync
    from diffrl.reward.edges import PerSample
    from diffrl.types import Trajectory

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    if rank == 1:
        put = PerSample.put  # the rollout -> reward edge, a micro-batch at a time

        async def drifting_put(self, record, version):
            if isinstance(record, Trajectory):
                ids = record.prompts.input_ids.clone()
                ids[1, 0] += 1
                prompts = dataclasses.replace(record.prompts, input_ids=ids)
                record = dataclasses.replace(record, prompts=prompts)
            await put(self, record, version)

        PerSample.put = drifting_put  # this rank's process only
    cfg = load_config("recipes/shapes_nft.yaml", over)
    parts = build(cfg)
    asyncio.run(train_sync(cfg, parts))


def test_data_parallel_training_stops_on_the_drifted_rank(tiny_checkpoint, tmp_path) -> None:
    """Under ``diffrl train`` over 2 data-parallel ranks, the rank whose ids drifted raises
    at its first update, naming itself; the launcher then ends the other rank."""
    from tiny_runs import tiny_run

    over = tiny_run(tiny_checkpoint, tmp_path, 1, "rollout.num_steps=2", "run.threads=1")
    message = r"token drift at the actor on rank 1 of 2: input_ids of rows \[1\]"
    with pytest.raises(Exception, match=message) as err:
        run_ranks(_dp_train_worker, WORLD, (free_port(), over), DEADLINE_S)
    assert "ContractError" in str(err.value)
