"""Multi-process tests on CPU over gloo: the meshes build_meshes makes, and FSDP2 data parallelism
giving the single-process loss and gradients.

Each test spawns its ranks (``spawn`` start method, a free TCP port on 127.0.0.1), the ranks
write what they saw to ``tmp_path``, and the test asserts on it here, in the parent, so a
failure reads like any other pytest failure. A rank that raises fails the test with its
traceback; ranks still running after ``DEADLINE_S`` are terminated and the test fails.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import finish_rank, free_port, init_gloo, leave_group, run_ranks

from diffrl.models.families.tiny_dit import build
from diffrl.models.family import FamilyModel
from diffrl.models.tiny_dit import TinyDiTConfig
from diffrl.parallel.dims import MAIN_AXES, ParallelDims

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

DEADLINE_S = 60.0  # a hang (a rank stuck in a collective) fails here, not at pytest's timeout


def _spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` fresh processes; re-raise a failure."""
    run_ranks(fn, world, (world, free_port(), *args), DEADLINE_S)


def _init(rank: int, world: int, port: int) -> None:
    init_gloo(rank, world, port, 30)


# --- (a) the meshes --------------------------------------------------------------------------

# Layouts built, one after another, by the same 4 ranks.
MESH_LAYOUTS = {
    "shard2_tp2_etp2": dict(dp_shard=2, tp=2, etp=2),
    "shard2_tp2_etp4": dict(dp_shard=2, tp=2, etp=4),
    "rep2_sp2_etp1": dict(dp_replicate=2, sp=2, etp=1),  # dp_shard=-1 resolves to 1
}


def _mesh_worker(rank: int, world: int, port: int, out: str) -> None:
    from diffrl.errors import ConfigError
    from diffrl.parallel.dims import AXES, build_meshes

    _init(rank, world, port)
    seen: dict = {}
    for name, degrees in MESH_LAYOUTS.items():
        m = build_meshes(ParallelDims(**degrees, world_size=world), "cpu")
        facts: dict = {
            "names": list(m.main.mesh_dim_names),
            "shape": list(m.main.shape),
            "etp_names": list(m.etp.mesh_dim_names),
            "etp_shape": list(m.etp.shape),
            "ranks": {a: dist.get_process_group_ranks(m.group(a)) for a in AXES},
            "rank_in": {a: m.rank_in(a) for a in AXES},
            "dp_size": m.dp_size,
            "dp_rank": m.dp_rank,
            "fsdp_names": list(m.fsdp_mesh.mesh_dim_names),
            "fsdp_shape": list(m.fsdp_mesh.shape),
            # identity of the communicators, only comparable inside the process
            "tp_is_etp": m.group("tp") is m.group("etp"),
            "etp_is_any_main": any(m.group("etp") is m.group(a) for a in MAIN_AXES),
        }
        # each group is a live communicator over exactly its ranks: the sum of the global ranks
        sums = {}
        for axis in AXES:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=m.group(axis))
            sums[axis] = t.item()
        facts["sums"] = sums
        seen[name] = facts
    try:  # degrees for 2 ranks under a world of 4
        build_meshes(ParallelDims(world_size=2), "cpu")
        seen["mismatch"] = None
    except ConfigError as e:
        seen["mismatch"] = str(e)
    finish_rank(Path(out), rank, seen)


def test_meshes_over_4_gloo_ranks(tmp_path: Path) -> None:
    """With 4 ranks, for each layout in MESH_LAYOUTS, on every rank:

    * the main mesh has the axes ("dp_replicate", "dp_shard", "sp", "tp") with the layout's
      sizes (size-1 axes present), and the ETP mesh is 1-D ("etp",) of size etp;
    * each axis's process group holds exactly the expected global ranks (tp: consecutive
      ranks; dp_shard: stride tp; etp: groups of etp consecutive ranks), and an all_reduce
      over it sums exactly those ranks (a live communicator, not only metadata);
    * the ETP group is a different ProcessGroup object from the TP group and from every
      main-mesh group, even at dp_shard=2, tp=2, etp=2 where its rank set equals the TP
      group's ({0,1} or {2,3}); at etp=4 the rank sets differ too (all 4 vs a TP pair);
    * rank_in, dp_rank and dp_size agree with the layout, and fsdp_mesh is 1-D dp_shard,
      or 2-D (dp_replicate, dp_shard) when there are replicas;
    * build_meshes refuses degrees whose world size is not the process group's.
    """
    t0 = time.monotonic()
    _spawn(_mesh_worker, 4, str(tmp_path))
    elapsed = time.monotonic() - t0
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        pair = [rank - rank % 2, rank - rank % 2 + 1]  # this rank's consecutive pair
        stride2 = [rank % 2, rank % 2 + 2]
        me = [rank]
        everyone = [0, 1, 2, 3]

        a = seen["shard2_tp2_etp2"]
        assert a["names"] == list(MAIN_AXES) and a["shape"] == [1, 2, 1, 2]
        assert a["etp_names"] == ["etp"] and a["etp_shape"] == [2]
        assert a["ranks"] == dict(dp_replicate=me, dp_shard=stride2, sp=me, tp=pair, etp=pair)
        coords = dict(dp_replicate=0, dp_shard=rank // 2, sp=0, tp=rank % 2, etp=rank % 2)
        assert a["rank_in"] == coords
        assert (a["dp_size"], a["dp_rank"]) == (2, rank // 2)
        assert a["fsdp_names"] == ["dp_shard"] and a["fsdp_shape"] == [2]
        assert not a["tp_is_etp"] and not a["etp_is_any_main"]

        b = seen["shard2_tp2_etp4"]
        assert b["shape"] == [1, 2, 1, 2] and b["etp_shape"] == [4]
        assert b["ranks"]["tp"] == pair and b["ranks"]["etp"] == everyone
        assert b["rank_in"]["etp"] == rank
        assert not b["tp_is_etp"] and not b["etp_is_any_main"]

        c = seen["rep2_sp2_etp1"]
        assert c["shape"] == [2, 1, 2, 1] and c["etp_shape"] == [1]
        assert c["ranks"] == dict(dp_replicate=stride2, dp_shard=me, sp=pair, tp=me, etp=me)
        assert (c["dp_size"], c["dp_rank"]) == (2, rank // 2)
        assert c["fsdp_names"] == ["dp_replicate", "dp_shard"] and c["fsdp_shape"] == [2, 1]

        for facts in (a, b, c):
            for axis, ranks in facts["ranks"].items():
                assert facts["sums"][axis] == sum(ranks), axis

        assert "world_size=2, but the process group has 4 ranks" in seen["mismatch"]
    assert elapsed < 30, f"took {elapsed:.1f} s"


# --- (b) FSDP2 -------------------------------------------------------------------------------


def _flow_loss(model: FamilyModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Flow-matching MSE, mean over the batch: x_s = (1-s) x0 + s eps, target v = eps - x0."""
    x0, eps, sigma = batch["x0"], batch["eps"], batch["sigma"]
    s = sigma[:, None, None, None]
    v = model((1 - s) * x0 + s * eps, sigma, batch["input_ids"])
    return ((v - (eps - x0)) ** 2).mean()


def _fsdp_worker(rank: int, world: int, port: int, degrees: dict, arch, state, batch, out) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from diffrl.parallel.dims import build_meshes

    _init(rank, world, port)
    m = build_meshes(ParallelDims(**degrees, world_size=world), "cpu")
    model = build(arch)
    model.load_state_dict(state)
    # FSDP2 as torchtitan applies it: each block its own unit, then the root for the rest
    for block in model.net.blocks:
        fully_shard(block, mesh=m.fsdp_mesh)
    fully_shard(model, mesh=m.fsdp_mesh)
    # this rank's slice of the batch (equal slices, so the mean of the slices' means is the mean)
    rows = len(batch["x0"]) // m.dp_size
    mine = {k: v[m.dp_rank * rows : (m.dp_rank + 1) * rows] for k, v in batch.items()}
    loss = _flow_loss(model, mine)
    loss.backward()  # reduce-scatters the gradients: the average over the data-parallel ranks
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    shards = {}
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), n
        shards[n] = (str(p.placements), p.to_local().numel(), p.numel(), p.shape[0])
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # all-gathered
    torch.save(
        {"losses": torch.stack(losses), "grads": grads, "shards": shards},
        Path(out, f"rank{rank}.pt"),
    )
    leave_group()


@pytest.mark.parametrize(
    "world, degrees",
    [(2, dict(dp_shard=2)), (4, dict(dp_replicate=2, dp_shard=2))],
    ids=["fsdp_2ranks", "hsdp_4ranks"],
)
def test_fsdp2_matches_one_process(tmp_path: Path, tiny_model, train_batch_factory, world, degrees):
    """FSDP2 (fully_shard per block, then the root) over ``world`` gloo ranks, each holding
    1/dp of a batch of 4, gives the one-process loss and gradients on the whole batch:

    * the mean of the ranks' losses equals the whole-batch loss (rtol 1e-5, fp32);
    * on every rank, every parameter's gradient, all-gathered to full size, equals the
      one-process gradient (rtol 1e-5, atol 1e-6 x that tensor's largest |grad|: the
      summation order differs, so entries that cancel to near zero need an absolute floor
      scaled to the tensor; seen: 1.6e-7 x the largest |grad|, on 2 of pos_img's 2048);
    * every parameter is a DTensor placed Shard(0) over dp_shard (Replicate() over
      dp_replicate too for HSDP), and the dp_shard ranks of one replica hold its elements
      between them, none all of them where dim 0 can be cut: FSDP really sharded; and the
      gradients are not all
      zero (the comparison is not vacuous).
    The 4-rank case is HSDP: 2 replicas x 2 shards, one sample per rank.
    """
    g = torch.Generator().manual_seed(1)
    tb = train_batch_factory(4)
    batch = {
        "x0": tb.x0,
        "eps": torch.randn(tb.x0.shape, generator=g),
        "sigma": torch.rand(4, generator=g),
        "input_ids": tb.input_ids,
    }
    ref = tiny_model
    arch: TinyDiTConfig = ref.net.cfg
    state = {k: v.clone() for k, v in ref.state_dict().items()}

    t0 = time.monotonic()
    _spawn(_fsdp_worker, world, degrees, arch, state, batch, str(tmp_path))
    elapsed = time.monotonic() - t0

    ref_loss = _flow_loss(ref, batch)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert any(g.abs().max() > 0 for g in ref_grads.values())
    shard = degrees["dp_shard"]
    want_placements = "(Shard(dim=0),)" if world == shard else "(Replicate(), Shard(dim=0))"
    shards = {}
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        shards[rank] = got["shards"]
        torch.testing.assert_close(got["losses"].mean(), ref_loss.detach(), rtol=1e-5, atol=0)
        assert got["grads"].keys() == ref_grads.keys()
        for n, want in ref_grads.items():
            floor = 1e-6 * want.abs().max().item()
            torch.testing.assert_close(
                got["grads"][n], want, rtol=1e-5, atol=floor, msg=lambda m, n=n: f"{n}: {m}"
            )
            assert got["shards"][n][0] == want_placements, n
    # the dp_shard ranks of the first replica (ranks 0 .. dp_shard-1) hold every element once,
    # and none holds them all unless dim 0 is too short to cut (pos_img: (1, 64, 32))
    for n in ref_grads:
        held, (_, _, whole, rows) = [shards[r][n][1] for r in range(shard)], shards[0][n]
        assert sum(held) == whole, f"{n}: shards {held} of {whole}"
        assert max(held) < whole or rows < shard, f"{n} is not sharded: {held} of {whole}"
    assert elapsed < 30, f"took {elapsed:.1f} s"
