"""Ranks that must hold the same adapters do (``parallel/drift.py``'s
``check_adapters_across``, run by the actor after every optimizer step): on 2 gloo ranks with
the sd35-tiny SD3 actor, one element of one LoRA tensor nudged on rank 1 fails that step on
both ranks with a ``ContractError`` naming rank 1, the tensor and the axis: data parallel
(dp peers hold every adapter tensor whole), and tp=2 (the tp ranks replicate ``to_q``'s
lora_A: Colwise shards only lora_B). Untouched, a real step passes at tp=2 (the replicated
factors are bit-identical across the tp ranks), and the checksum sees order, not just sums."""

from __future__ import annotations

import copy
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
DEADLINE_S = 180.0
NUDGED = "transformer_blocks.0.attn.to_q.lora_A.default.weight"  # whole on every tp rank


def _actor(model, tensor_parallel=None, dp_group=None, rows_groups=None):
    from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm
    from diffrl.models.families.sd3 import LORA_TARGETS
    from diffrl.types import TrainBatch

    torch.manual_seed(1)  # peft draws lora_A from the global generator: the same on each rank
    actor = ActorEngine(
        model, ActorConfig(lr=1e-2, lora=AdapterConfig(rank=4, alpha=4.0)), list(LORA_TARGETS),
        get_algorithm("diffusion_nft"), NFTConfig(weighting="uniform", timesteps_per_sample=1),
        torch.device("cpu"), tensor_parallel=tensor_parallel, dp_group=dp_group,
        rows_groups=rows_groups,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    tokens = model.family.tokenize(["a red square", "a blue circle"])
    batch = TrainBatch(
        input_ids=tokens.input_ids,
        ids_hash=tuple(tokens.hashes),
        x0=torch.randn((2, *model.family.latent_shape()), generator=g),
        optimality=torch.rand(2, generator=g),
        seeds=torch.arange(2),
    )
    return actor, batch


def _nudge(actor, name: str) -> None:
    from diffrl.parallel.tp_lora import local

    (p,) = [p for n, p in actor.model.named_parameters() if n.endswith("." + name)]
    with torch.no_grad():
        local(p).view(-1)[3] += 1e-3


def _step(actor, batch) -> str | None:
    try:
        actor.train_step(batch)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from diffrl.models.families.sd3 import TP_PLAN
    from diffrl.models.registry import ModelConfig, load_model
    from diffrl.parallel.tp_lora import tp_hook

    init_gloo(rank, WORLD, port, DEADLINE_S)
    torch.manual_seed(0)
    model = load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
    spare = copy.deepcopy(model)  # for the tp actor: loading costs seconds, a copy nothing
    seen: dict = {}
    # data parallel: every rank trains the same rows here (what is compared is the adapters)
    actor, batch = _actor(model, dp_group=dist.group.WORLD)
    seen["dp_clean"] = _step(actor, batch)
    if rank == 1:
        _nudge(actor, NUDGED)
    seen["dp"] = _step(actor, batch)
    # tp=2: the same rows on both ranks; to_q's lora_A is replicated, its lora_B sharded
    mesh = DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("tp",))
    hook = tp_hook(mesh, TP_PLAN, "sd3")
    actor, batch = _actor(spare, tensor_parallel=hook, rows_groups={"tp": mesh.get_group()})
    seen["tp_clean"] = _step(actor, batch)  # a real TP step: the replicated parts agree
    if rank == 1:
        _nudge(actor, NUDGED)
    seen["tp"] = _step(actor, batch)
    finish_rank(Path(out), rank, seen)


def test_a_rank_whose_adapters_drifted_fails_the_step_on_every_rank(tmp_path: Path) -> None:
    run_ranks(_worker, WORLD, (free_port(), str(tmp_path)), DEADLINE_S)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, s in enumerate(seen):
        assert s["dp_clean"] is None and s["tp_clean"] is None, s
        for axis in ("dp", "tp"):
            said = s[axis]
            assert said is not None and said.startswith("ContractError: adapter drift "), s
            assert f"after optimizer step 2, seen by rank {rank}: " in said, said
            named = f"rank 1 holds other values than rank 0 in net.transformer.{NUDGED} "
            assert named in said, said
            assert f"({axis} group of ranks [0, 1])" in said, said


def test_the_checksum_is_order_sensitive_and_names_tensors_in_order() -> None:
    from diffrl.parallel.drift import adapter_checksums

    a = torch.tensor([1.0, 2.0, 3.0])
    sums = adapter_checksums({"x": a, "y": a.flip(0)})
    assert sums.shape == (2, 2) and sums.dtype == torch.float64
    assert sums[0, 0] == sums[1, 0]  # the same plain sum
    assert sums[0, 1] != sums[1, 1]  # another order
    assert torch.equal(adapter_checksums({"x": a.clone()}), sums[:1])
