"""`diffrl train` data-parallel over 2 gloo ranks (parallel/launch.py, parallel/fsdp.py): the
ranks' rollouts are the one-process run's samples, the frozen base is sharded and the adapters
stay identical on every rank, rank 0 alone writes the run directory, and a resumed run
continues; the actor's FSDP2 forward with adapters averaged over ranks gives the one-process
gradient; and the layouts diffrl train cannot run yet are refused before any work (async
mode with each rank's rollout on its own latest weights among them)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import free_port, leave_group, run_ranks
from tiny_runs import tiny_run

from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

RECIPE = "recipes/shapes_nft.yaml"
PARTIAL = "reward.scorers=[{name: shapes, weight: 1.0, required: true, params: {mode: partial}}]"
DEADLINE_S = 120.0


def overrides(checkpoint: Path, out: Path, steps: int) -> list[str]:
    return tiny_run(
        checkpoint, out, steps, "rollout.num_steps=2", "actor.lr=1e-2", "run.eval_every=1",
        "run.save_every=1", PARTIAL, "run.threads=1",
    )  # fmt: skip


def as_rank(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode() + tensors[k].float().numpy().tobytes())
    return h.hexdigest()


def _train_worker(rank: int, world: int, port: int, over: list[str], out: str) -> None:
    from torch.distributed.tensor import DTensor

    from diffrl.build import build
    from diffrl.controller.sync import train_sync

    as_rank(rank, world, port)
    cfg = load_config(RECIPE, over)
    parts = build(cfg)
    sharded = [
        (p.to_local().numel(), p.numel())
        for n, p in parts.actor.model.named_parameters()
        if isinstance(p, DTensor)
    ]
    asyncio.run(train_sync(cfg, parts))
    result = {
        "adapters": digest(parts.actor.adapter_tensors()),
        "sharded": len(sharded),
        "local_frac": sum(a for a, _ in sharded) / max(1, sum(b for _, b in sharded)),
        "lora_dtensor": any(
            isinstance(p, DTensor) for n, p in parts.actor.model.named_parameters() if "lora_" in n
        ),
        "version": parts.actor.version,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    asyncio.run(parts.aclose())  # leaves the process group


def _run_ranks(world: int, over: list[str], out: Path) -> list[dict]:
    run_ranks(_train_worker, world, (world, free_port(), over, str(out)), DEADLINE_S)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_ranks_train_as_one_process_would_sample(tiny_checkpoint, tmp_path):
    one = read_metrics(
        asyncio.run(train(load_config(RECIPE, overrides(tiny_checkpoint, tmp_path / "one", 2))))
    )  # noqa: E501
    dp_dir = tmp_path / "dp"
    ranks = _run_ranks(2, overrides(tiny_checkpoint, dp_dir, 2), tmp_path)
    rows = read_metrics(dp_dir / "shapes_nft")
    assert [r["step"] for r in rows] == [0, 1, 2]  # rank 0 alone logs, once per step
    # the untrained policy's eval, and step 1's samples (drawn before any update), are the
    # one-process run's: each rank rolled out its slice with the one-process seeds
    assert rows[0] == {**one[0], "time": rows[0]["time"]}
    for key in [k for k in one[1] if k.startswith("reward/")]:
        assert rows[1][key] == pytest.approx(one[1][key], rel=1e-6, abs=1e-7), key
    assert rows[1]["actor/grad_norm"] > 0
    # the ranks stay in step: the same adapters everywhere; the frozen base is sharded
    assert ranks[0]["adapters"] == ranks[1]["adapters"] and ranks[0]["version"] == 2
    for r in ranks:
        assert r["sharded"] > 0 and r["local_frac"] == pytest.approx(0.5, abs=0.1)
        assert not r["lora_dtensor"]  # adapters whole on every rank
    # resumed to 3 steps: continues from rank 0's checkpoint, one row per step
    _run_ranks(2, overrides(tiny_checkpoint, dp_dir, 3), tmp_path)
    rows3 = read_metrics(dp_dir / "shapes_nft")
    assert [r["step"] for r in rows3] == [0, 1, 2, 3]
    assert rows3[:3] == rows
    assert (dp_dir / "shapes_nft" / "checkpoints" / "latest").read_text().strip() == "step_000003"


def _lockstep_worker(rank: int, world: int, port: int, over: list[str], out: str) -> None:
    from diffrl.build import build
    from diffrl.controller.sync import rollout_and_score

    as_rank(rank, world, port)
    cfg = load_config(RECIPE, over)
    parts = build(cfg)
    scored, _ = asyncio.run(rollout_and_score(parts, 0))
    full = parts.algorithm.prepare(scored, cfg.algorithm)
    empty = full.select(torch.arange(0))
    one = full.select(torch.arange(1))
    seen = []
    # rank 1's slice: empty before it has a spare row; one row; empty with a spare; all empty
    for mine in (full if rank == 0 else empty, full if rank == 0 else one,
                 full if rank == 0 else empty, empty):  # fmt: skip
        m = parts.actor.train_step(mine)
        seen.append(
            {"version": parts.actor.version, "skipped": m.get("actor/skipped_empty", 0.0),
             "loss": m.get("actor/loss"), "adapters": digest(parts.actor.adapter_tensors())}
        )  # fmt: skip
    Path(out, f"lock{rank}.json").write_text(json.dumps({"rows": len(full), "seen": seen}))
    asyncio.run(parts.aclose())


def test_ranks_with_uneven_or_empty_slices_stay_in_lockstep(tiny_checkpoint, tmp_path):
    """FSDP2's passes are collectives: rank 0 trains a micro-batch per row while rank 1 has one
    row, or none (zero-weight passes on its spare row). No hang; every rank takes or skips
    each step together, and ends with the same adapters; a rank with no row and no spare yet
    (its first step), or no rows anywhere, skips the step on every rank."""
    over = [*overrides(tiny_checkpoint, tmp_path, 1), "actor.micro_batch=1"]
    run_ranks(_lockstep_worker, 2, (2, free_port(), over, str(tmp_path)), DEADLINE_S)
    ranks = [json.loads((tmp_path / f"lock{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["rows"] >= 2  # rank 0 makes more passes than rank 1
    a, b = ranks[0]["seen"], ranks[1]["seen"]
    assert [s["version"] for s in a] == [s["version"] for s in b] == [0, 1, 2, 2]
    assert [s["skipped"] for s in a] == [s["skipped"] for s in b] == [1.0, 0.0, 0.0, 1.0]
    for x, y in zip(a, b, strict=True):
        assert x["adapters"] == y["adapters"] and x["loss"] == y["loss"]
    assert a[1]["adapters"] != a[0]["adapters"] != a[2]["adapters"]


def _grad_worker(
    rank: int, world: int, port: int, replicas: int, arch, state, batch, out: str
) -> None:
    from peft import LoraConfig, get_peft_model

    from diffrl.actor.engine import average_over
    from diffrl.models.families.tiny_dit import build
    from diffrl.parallel.dims import ParallelDims, build_meshes
    from diffrl.parallel.fsdp import shard_frozen_base

    as_rank(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dims = ParallelDims(dp_replicate=replicas, world_size=world)
    mesh = build_meshes(dims, "cpu").fsdp_mesh  # 1-D FSDP, or 2-D HSDP with replicas
    model = build(arch)
    model.load_state_dict(state)
    torch.manual_seed(2)  # peft draws lora_A from the global generator
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS))
    torch.manual_seed(3)
    with torch.no_grad():  # B = 0 at init would give A no gradient
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    shard_frozen_base(mesh)(peft)
    lo, hi = SPLITS[world][rank]  # uneven slices: ranks hold different numbers of rows
    rows = hi - lo
    # an empty rank still makes the pass (FSDP's all-gathers are collectives), on a spare row
    # with weight 0, as the actor does
    mine = {k: v[lo:hi] if rows else v[:1] for k, v in batch.items()}
    loss = _loss(peft, mine) * rows  # a sum over the rank's rows, as the actor weighs them
    loss.backward()
    params = [p for n, p in peft.named_parameters() if "lora_" in n and p.requires_grad]
    mean_loss = average_over(dist.group.WORLD, [p.grad for p in params], loss.detach(), rows)
    names = [n for n, p in peft.named_parameters() if "lora_" in n and p.requires_grad]
    grads = {n: p.grad for n, p in zip(names, params, strict=True)}
    torch.save({"loss": mean_loss, "grads": grads}, Path(out, f"grad{rank}.pt"))
    leave_group()


TARGETS = ["attn.qkv", "attn.proj"]
SPLITS = {2: [(0, 3), (3, 4)], 4: [(0, 1), (1, 2), (2, 4), (4, 4)]}  # (first, end) row per rank


def _loss(model, batch) -> torch.Tensor:
    s = batch["sigma"][:, None, None, None]
    v = model((1 - s) * batch["x0"] + s * batch["eps"], batch["sigma"], batch["input_ids"])
    return ((v - (batch["eps"] - batch["x0"])) ** 2).mean()


@pytest.mark.parametrize(
    ("world", "replicas"), [(2, 1), (4, 2)], ids=["fsdp_2ranks", "hsdp_2x2ranks"]
)
def test_sharded_base_with_averaged_adapters_is_the_one_process_gradient(
    tmp_path, tiny_model, train_batch_factory, world, replicas
):
    """Each rank: the frozen base under FSDP2 (shard_frozen_base; HSDP with 2 replicas of 2
    shards on 4 ranks), LoRA whole, an uneven slice of the batch (3+1 rows; 1+1+2+0 on 4
    ranks, one rank empty), its loss summed over its rows, then average_over weighted by rows:
    the loss and every adapter gradient equal one process on the whole batch (rtol 1e-5, atol
    1e-6 x the tensor's largest |grad|: summation order)."""
    from peft import LoraConfig, get_peft_model

    g = torch.Generator().manual_seed(1)
    tb = train_batch_factory(4)
    batch = {"x0": tb.x0, "eps": torch.randn(tb.x0.shape, generator=g),
             "sigma": torch.rand(4, generator=g), "input_ids": tb.input_ids}  # fmt: skip
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    args = (world, free_port(), replicas, tiny_model.net.cfg, state, batch, str(tmp_path))
    run_ranks(_grad_worker, world, args, DEADLINE_S)
    torch.manual_seed(2)
    ref = get_peft_model(tiny_model, LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS))
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    loss = _loss(ref, batch)
    loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n and p.requires_grad}
    assert any(w.abs().max() > 0 for w in want.values())
    for rank in range(world):
        got = torch.load(tmp_path / f"grad{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=0)
        assert got["grads"].keys() == want.keys()
        for n, w in want.items():
            floor = 1e-6 * w.abs().max().item()
            torch.testing.assert_close(got["grads"][n], w, rtol=1e-5, atol=floor)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            ["parallel.tp=2"],
            r"parallel.tp=2: model family 'tiny_dit' declares no TP plan for "
            r"the tp axis",
        ),
        (
            ["parallel.sp=2", "parallel.dp_shard=1"],
            r"parallel.sp=2: model family 'tiny_dit' has no context-parallel plan for the sp "
            r"axis",
        ),
        (["parallel.etp=2"], r"parallel.etp=2: model family 'tiny_dit' declares no ETP plan"),
        (
            ["run.mode=async", "run.async_weights=latest"],
            r"'run.async_weights' = 'latest' under torchrun: each rank's rollout",
        ),
        (["data.prompts_per_step=3"], r"'data.prompts_per_step' = 3.*multiple of 2"),
        (["parallel.dp_shard=3"], r"parallel: dp_replicate\*dp_shard\*sp\*tp = 1\*3\*1\*1 = 3"),
    ],
)
def test_layouts_train_cannot_run_are_refused_first(
    tiny_checkpoint, tmp_path, monkeypatch, extra, says
):  # noqa: E501
    """Under a 2-rank launch, before any process group or model: a clear error naming the key."""
    from diffrl.build import build

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(RECIPE, [*overrides(tiny_checkpoint, tmp_path, 1), *extra])
    with pytest.raises(ConfigError, match=says):
        build(cfg)
    assert not dist.is_initialized()


def test_tp_with_hsdp_replicas_is_refused_first(tmp_path, monkeypatch):
    """tp=2 with 2 HSDP replicas on 4 ranks: not run by diffrl train yet, so the layout is
    refused before any process group, naming the keys."""
    from diffrl.build import build

    monkeypatch.setenv("WORLD_SIZE", "4")
    over = ["parallel.tp=2", "parallel.dp_replicate=2", "probe.mode=off", f"run.out_dir={tmp_path}"]
    cfg = load_config("recipes/shapes_sd3_nft.yaml", over)
    with pytest.raises(ConfigError, match=r"parallel.tp=2 with parallel.dp_replicate=2"):
        build(cfg)
    assert not dist.is_initialized()


def test_held_out_shares_are_contiguous_and_cover_the_set():
    from diffrl.parallel.launch import Ranks

    def shares(n, world):
        return [(f, idx.tolist()) for f, idx in (Ranks(r, world).share(n) for r in range(world))]

    assert shares(5, 2) == [(0, [0, 1, 2]), (3, [3, 4])]
    assert shares(52, 4) == [(13 * r, list(range(13 * r, 13 * r + 13))) for r in range(4)]
    assert shares(1, 2) == [(0, [0]), (1, [])]  # a rank with no share still joins
    assert shares(3, 1) == [(0, [0, 1, 2])]


def test_parallel_keys_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"'parallel.tp' = 0"):
        load_config(RECIPE, ["parallel.tp=0"])
    assert load_config(RECIPE).parallel.dp_shard == -1


def test_tp_with_the_actor_compiled_is_refused_first(tmp_path, monkeypatch):
    """The AV recipes compile the actor; over a TP-sharded base inductor fails mid-step, so
    the layout is refused before any process group, naming the key to change."""
    from diffrl.build import build

    monkeypatch.setenv("WORLD_SIZE", "2")
    over = ["parallel.tp=2", "probe.mode=off", f"run.out_dir={tmp_path}"]
    cfg = load_config("recipes/av_t2va_nft.yaml", over)
    assert cfg.actor.compile
    with pytest.raises(ConfigError, match=r"'actor.compile' = True with parallel.tp=2"):
        build(cfg)
    assert not dist.is_initialized()
