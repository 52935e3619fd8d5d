"""The rollout at tp=2 (``parallel.rollout=sharded``): the rollout's DiT copy sharded with the
family's TP plan over the tp group, updates landing through the verified sharded sync
(``parallel/tp_sync.py``), against the replicated copy a rank holds otherwise.

Two gloo ranks build the same sd35-tiny model (``torch.manual_seed(0)``) and the same actor (one
process each, LoRA with random B so the first update already moves the forward), a replicated
rollout (``RolloutEngine`` as in one process: the family's fused serving layout) and a sharded one
(``tp_mesh``: Q/K/V fused as in the serving layout, strided over the ranks), then on every
rank:

- sync the actor's adapter into both (``load_verified``: the merge's checks, then the receipt)
  and sample the same prompts and seeds: the sharded rollout's samples equal the replicated
  one's to fp32 rounding (the sharded matmuls reorder sums; atol 1e-5 on samples in [-1, 1]);
- take a training step, sync again (verified, receipt read across the ranks' shards), sample
  again: equal again, and moved by the step;
- a corrupted update (one rank's copy of a row-sharded delta has two rows swapped in transit,
  so its own slice still matches the factors it got) raises ``SyncError`` on every rank and
  commits nothing; a merge that writes nothing and says it did is caught by the receipt;
- the layout checked at start-up: one trained weight sharded on the other dim than the plan
  says, the fused Q/K/V split in plain halves instead of per part, or the copy sharded over
  another mesh than the sync's tp group, fails building.

Every other family's tiny preset (FLUX, Qwen-Image, Wan, LTX-2, H3), in one process group:
after one sync the sharded rollout samples as the replicated one, and its build (an alias of
the model's storage, the serving layout read off a meta copy) gives the shards a whole copy
sharded after gives, shares no storage with the model, leaves the model as it was, and leaves
the global RNG where the replicated build does (not so without the replay of the layout's
draws).

Without gloo: ``parallel.rollout`` checked at load, a serving-layout draw the replay cannot
repeat refused, ``rollout.compile`` / ``cuda_graphs``
refused with a sharded rollout before any process group, held-out eval shared by data-parallel
rank, and a family without a TP plan refused by name.

``diffrl train`` under torchrun at tp=2 with the sharded rollout (the default) runs in
``tests/parallel/test_tp_lora_gloo.py`` (SD3) and ``test_tp_etp_cli.py`` (MiniMax-H3).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import finish_rank, free_port, init_gloo, run_ranks
from sync_faults import no_op_apply, sync_error_of
from torch.utils._python_dispatch import TorchDispatchMode

from diffrl.sync.weights import LoraDelta, WeightUpdate

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

WORLD = 2
DEADLINE_S = 120.0
ATOL = 1e-5
DIT_STD = 0.1  # as test_tp_gloo.py: the presets' 0.02 leaves a tiny DiT's blocks nearly silent


def _rank(rank: int, port: int, out: Path) -> None:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from diffrl.build import expanded_targets
    from diffrl.models.families._diffusers import init_weights
    from diffrl.models.families.sd3 import LORA_TARGETS, TP_PLAN
    from diffrl.models.family import transformer_root
    from diffrl.models.registry import ModelConfig, load_model
    from diffrl.parallel import tp_sync
    from diffrl.rollout.engine import RolloutConfig, RolloutEngine
    from diffrl.sync.receipt import load_verified
    from diffrl.tasks import Prompt, PromptSet
    from diffrl.types import TrainBatch

    init_gloo(rank, WORLD, port, DEADLINE_S)
    mesh = DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
    init_weights(transformer_root(model), std=DIT_STD)
    targets = expanded_targets(model, list(LORA_TARGETS))
    cfg = RolloutConfig(group_size=2, num_steps=3, max_batch=4)
    cpu = torch.device("cpu")
    whole = RolloutEngine(model, cfg, targets, cpu)
    # its sync base copies on the host (rollout.base_copy=cpu; the device is the host here)
    host = dataclasses.replace(cfg, base_copy="cpu")
    sharded = RolloutEngine(model, host, targets, cpu, tp_mesh=mesh, tp_plan=TP_PLAN)
    result: dict = dict(rank=rank)
    # where the trained rows live: Q/K/V fused (as the replicated copy's serving layout has
    # them) and strided over the ranks, the rest column or row shards
    slots = sharded.target.slot_map
    held = {s.module for n in targets for s in slots.slots_for(n)}
    weights = [sharded.model.get_submodule(m).weight for m in held]
    result["sharded"] = all(isinstance(w, DTensor) for w in weights)
    result["placements"] = sorted({str(w.placements) for w in weights})
    result["fused"] = sorted({m.rsplit(".", 1)[-1] for m in held if m.endswith("qkv")})

    # the layout checked at start-up: a trained weight on the wrong dim, or another mesh
    real_apply = tp_sync.apply_plan

    def wrong_dim(root, on, plan):  # the plan applied, then one row-sharded weight re-split
        real_apply(root, on, plan)
        lin = root.get_submodule("transformer_blocks.0.attn.to_out.0")
        lin.weight = nn.Parameter(lin.weight.redistribute(on, [Shard(0)]), requires_grad=False)

    real_parallelize = tp_sync.parallelize_module

    def plain_qkv(lin, on, style):  # each fused Q/K/V sharded, then split in plain halves
        real_parallelize(lin, on, style)
        whole = lin.weight.full_tensor()
        lin.weight = nn.Parameter(distribute_tensor(whole, on, [Shard(0)]), requires_grad=False)
        return lin

    other = DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("other",))
    faults = dict(  # (the tp_sync function each replaces, the fault)
        plain_qkv=("parallelize_module", plain_qkv),
        wrong_dim=("apply_plan", wrong_dim),
        other_mesh=("apply_plan", lambda root, on, plan: real_apply(root, other, plan)),
    )
    for key, (where, fault) in faults.items():
        real = getattr(tp_sync, where)
        setattr(tp_sync, where, fault)
        try:
            result[key] = sync_error_of(
                lambda: RolloutEngine(model, cfg, targets, cpu, tp_mesh=mesh, tp_plan=TP_PLAN)
            )
        finally:
            setattr(tp_sync, where, real)

    # the actor: one process on every rank (the same adapter everywhere)
    from test_tp_lora_gloo import _actor, _batch

    actor = _actor(model)
    batch: TrainBatch = _batch(model)
    prompts = PromptSet([Prompt("a red square"), Prompt("a blue circle")], model.family.tokenize)

    def samples(engine) -> torch.Tensor:
        return asyncio.run(engine.generate(prompts.batch([0, 1]), 5)).x0

    before = None
    for version in (0, 1):
        if version:
            actor.train_step(batch)
        update = actor.export_weights("default")
        m_whole = load_verified(whole, update)
        m_sharded = load_verified(sharded, update)
        x_whole, x_sharded = samples(whole), samples(sharded)
        result[f"v{version}"] = dict(
            diff=(x_sharded - x_whole).abs().max().item(),
            scale=x_whole.abs().max().item(),
            moved=0.0 if before is None else (x_sharded - before).abs().max().item(),
            applied=m_sharded["sync/applied"],
            whole_applied=m_whole["sync/applied"],
            receipt_frac=m_sharded["sync/receipt_frac"],
            version=sharded.version,
        )
        before = x_sharded

    # a corrupted update: rank 1's copy of one delta has two rows swapped in transit
    name = next(n for n in targets if n.endswith("ff.net.2"))  # row-sharded: half rows each
    d = update.deltas[name]
    rows = d.b.clone()
    rows[[0, 1]] = rows[[1, 0]]
    bad = dataclasses.replace(update, version=update.version + 1)
    if rank == 1:
        bad = dataclasses.replace(
            bad, deltas={**update.deltas, name: LoraDelta(d.a, rows, d.scale)}
        )
    result["corrupt"] = sync_error_of(lambda: load_verified(sharded, bad))
    result["corrupt_version"] = sharded.version
    # a merge that writes nothing and says it did: the receipt across the shards sees it
    sharded.target.apply = no_op_apply
    doubled = {n: LoraDelta(d.a, 2 * d.b, d.scale) for n, d in update.deltas.items()}
    later = WeightUpdate.build(update.version + 2, "default", doubled, update.base)
    result["no_op"] = sync_error_of(lambda: load_verified(sharded, later))
    finish_rank(out, rank, result)


def test_sharded_rollout_samples_and_syncs_as_the_replicated_one(tmp_path: Path) -> None:
    run_ranks(_rank, WORLD, (free_port(), tmp_path), DEADLINE_S)
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["sharded"], r
        assert r["placements"] == [
            "(Shard(dim=0),)", "(Shard(dim=1),)", "(_StridedShard(dim=0, sf=3),)"
        ], r["placements"]  # fmt: skip
        assert r["fused"] == ["to_added_qkv", "to_qkv"], r["fused"]
        for v in ("v0", "v1"):
            s = r[v]
            assert s["diff"] <= ATOL, (v, s)
            assert s["applied"] == s["whole_applied"] > 0, s
            assert s["receipt_frac"] < 1.0, s
        assert r["v1"]["moved"] > 100 * ATOL, r["v1"]  # the step's update reached the samples
        assert r["v1"]["version"] > r["v0"]["version"]
        # rank 0's copy was fine and each rank's slice matches the factors it got: only the
        # row prints summed over the ranks see it, on both
        assert "row print of trained row" in r["corrupt"] and "ff.net.2" in r["corrupt"], r
        assert r["corrupt_version"] == r["v1"]["version"]  # nothing committed
        assert "holds other weights than the actor sent" in r["no_op"], r["no_op"]
        assert "rollout layout at start-up" in r["wrong_dim"], r["wrong_dim"]
        assert "attn.to_out.0" in r["wrong_dim"] and "Shard(dim=1)" in r["wrong_dim"]
        q = r["plain_qkv"]
        assert "transformer_blocks.0.attn.to_qkv (trained" in q and "sf=3" in q, q
        assert "rollout layout at start-up" in r["other_mesh"], r["other_mesh"]
        assert "'other'" in r["other_mesh"], r["other_mesh"]


# --- the key, and what it refuses before any process group ------------------------------------


def test_parallel_rollout_is_checked_at_load() -> None:
    from diffrl.config import load_config
    from diffrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'parallel.rollout' = 'whole'.*'sharded', 'replicated'"):
        load_config("recipes/shapes_sd3_nft.yaml", ["parallel.rollout=whole"])
    assert load_config("recipes/shapes_sd3_nft.yaml").parallel.rollout == "sharded"


@pytest.mark.parametrize("key", ["rollout.compile", "rollout.cuda_graphs"])
def test_a_sharded_rollout_refuses_compile_and_graphs_first(tmp_path, monkeypatch, key) -> None:
    """Before any process group, naming the key and the way out; replicated, the same config
    passes this check (and is refused later only for want of a CUDA device)."""
    from diffrl.config import load_config
    from diffrl.errors import ConfigError
    from diffrl.parallel.launch import check_tp

    monkeypatch.setenv("WORLD_SIZE", "2")
    over = ["parallel.tp=2", "probe.mode=off", f"run.out_dir={tmp_path}", f"{key}=true"]
    cfg = load_config("recipes/shapes_sd3_nft.yaml", over)
    with pytest.raises(ConfigError, match=rf"'{key}' = True with parallel.tp=2 and parallel.rollo"):
        check_tp(cfg, cfg.parallel.dims())
    assert not dist.is_initialized()
    replicated = load_config("recipes/shapes_sd3_nft.yaml", [*over, "parallel.rollout=replicated"])
    check_tp(replicated, replicated.parallel.dims())


def test_a_sharded_rollouts_eval_shares_are_the_data_parallel_ranks() -> None:
    """4 ranks, dp 2 x tp 2: the two ranks of a tp group sample the same held-out share (the
    rows the one-process run gives that dp rank); replicated, every rank its own."""
    from diffrl.parallel.launch import Ranks

    class Mesh:  # the two numbers share() reads of a dp 2 x tp 2 layout
        dp_size = 2

        def __init__(self, rank: int) -> None:
            self.dp_rank = rank // 2

    def shares(sharded: bool) -> list:
        out = []
        for r in range(4):
            ranks = Ranks(r, 4, Mesh(r), rollout_tp=sharded)  # type: ignore[arg-type]
            first, idx = ranks.share(5)
            out.append((first, idx.tolist()))
        return out

    assert shares(True) == [(0, [0, 1, 2]), (0, [0, 1, 2]), (3, [3, 4]), (3, [3, 4])]
    assert shares(False) == [(0, [0, 1]), (2, [2, 3]), (4, [4]), (5, [])]


def test_a_family_without_a_tp_plan_cannot_shard_its_rollout(tiny_model) -> None:
    """The tiny DiT declares no TP plan: its rollout copy is refused before anything is
    sharded, naming the family and the keys (``launch.check_tp`` refuses its tp first)."""
    from diffrl.errors import ConfigError
    from diffrl.parallel.tp_sync import shard_rollout

    with pytest.raises(ConfigError, match=r"parallel.rollout=sharded: model family 'tiny_dit'"):
        shard_rollout(tiny_model, None, None, [])  # type: ignore[arg-type]


# --- every family's tiny preset through the sharded rollout -------------------------------------


class _PassThrough(TorchDispatchMode):  # the meta copy's fills, not repeated anywhere
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _family_rank(rank: int, port: int, out: Path) -> None:
    """Per family: the replicated and the sharded rollout of the same tiny DiT, the same
    adapter synced into both (random B: the deltas move the forward), the same prompts sampled;
    a family's failure is recorded as its result, so the others still run in this group."""
    from test_tp_lora_gloo import _actor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from diffrl.build import expanded_targets
    from diffrl.models.families._diffusers import init_weights
    from diffrl.models.family import transformer_root
    from diffrl.models.registry import FAMILIES, ModelConfig, load_model
    from diffrl.parallel import tp_sync
    from diffrl.parallel.tp_sync import _local
    from diffrl.rollout.engine import RolloutConfig, RolloutEngine
    from diffrl.sync.receipt import load_verified
    from diffrl.tasks import Prompt, PromptSet

    init_gloo(rank, WORLD, port, DEADLINE_S)
    mesh = DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("tp",))
    cpu = torch.device("cpu")
    result: dict = {}
    for family, preset in FAMILY_PRESETS:
        try:
            torch.manual_seed(0)
            model = load_model(ModelConfig(family=family, preset=preset), "cpu")
            init_weights(transformer_root(model), std=DIT_STD)
            targets = expanded_targets(model, list(FAMILIES[family].lora_targets))
            cfg = RolloutConfig(group_size=1, num_steps=2, max_batch=2)
            plan = FAMILIES[family].tp_plan
            before = {k: v.clone() for k, v in model.state_dict().items()}
            torch.manual_seed(1)
            whole = RolloutEngine(model, cfg, targets, cpu)
            rng_whole = torch.get_rng_state()
            torch.manual_seed(1)
            sharded = RolloutEngine(model, cfg, targets, cpu, tp_mesh=mesh, tp_plan=plan)
            rng_sharded = torch.get_rng_state()
            # today's construction before it: a whole copy laid out, a whole copy sharded
            old = copy.deepcopy(model)
            layout = model.family.serving_layout(copy.deepcopy(model))
            tp_sync.shard_rollout(old, mesh, plan, targets, layout=layout)
            new_sd, old_sd = sharded.model.state_dict(), old.state_dict()
            as_before = new_sd.keys() == old_sd.keys() and all(
                torch.equal(_local(new_sd[k]), _local(old_sd[k])) for k in new_sd
            )
            # the fused Linears' draws replayed on the device (here the host): without, the
            # global RNG would not be where one process leaves it
            replay = tp_sync._ReplayDraws
            tp_sync._ReplayDraws = lambda device: _PassThrough()
            try:
                torch.manual_seed(1)
                RolloutEngine(model, cfg, targets, cpu, tp_mesh=mesh, tp_plan=plan)
                rng_unreplayed = torch.get_rng_state()
            finally:
                tp_sync._ReplayDraws = replay
            # (before the actor: peft renames the model's tensors)
            source_kept = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            # a source whose untrained tensors differ by rank: a replicated placement is
            # broadcast from rank 0 in place, which must land in the copy's own storage
            odd = copy.deepcopy(model)
            trained = {f"{t}.weight" for t in targets}
            with torch.no_grad():
                for k, v in odd.state_dict().items():
                    if k not in trained and v.is_floating_point():
                        v.add_(1e-3 * rank)
            odd_before = {k: v.clone() for k, v in odd.state_dict().items()}
            RolloutEngine(odd, cfg, targets, cpu, tp_mesh=mesh, tp_plan=plan)
            odd_kept = all(torch.equal(v, odd_before[k]) for k, v in odd.state_dict().items())
            slots = sharded.target.slot_map
            held = {s.module for n in targets for s in slots.slots_for(n)}
            weights = [sharded.model.get_submodule(m).weight for m in held]
            texts = [Prompt("a red square"), Prompt("a blue circle")]
            batch = PromptSet(texts, model.family.tokenize).batch([0, 1])
            y0 = asyncio.run(sharded.generate(batch, 5)).x0  # the base's samples
            update = _actor(model, family=family).export_weights("default")
            applied = load_verified(sharded, update)["sync/applied"]
            whole_applied = load_verified(whole, update)["sync/applied"]
            x = asyncio.run(whole.generate(batch, 5)).x0
            y = asyncio.run(sharded.generate(batch, 5)).x0
            result[family] = dict(
                rng=torch.equal(rng_sharded, rng_whole),
                rng_unreplayed=torch.equal(rng_unreplayed, rng_whole),
                as_before=as_before,
                own=not (tp_sync._storages(sharded.model) & tp_sync._storages(model)),
                source_kept=source_kept,
                odd_kept=odd_kept,
                diff=(y - x).abs().max().item(),
                scale=x.abs().max().item(),
                moved=(y - y0).abs().max().item(),
                applied=applied,
                whole_applied=whole_applied,
                sharded=sum(isinstance(w, DTensor) for w in weights),
                placements=sorted({str(w.placements) for w in weights if isinstance(w, DTensor)}),
            )
        except Exception as e:  # this family's failure, named in the parent
            result[family] = dict(error=f"{type(e).__name__}: {e}")
        dist.barrier()  # a family that failed on one rank only must not desync the next one
    finish_rank(out, rank, result)


# SD3 runs above, with the faults; each other family with a TP plan once, in one process group
FAMILY_PRESETS = [
    ("flux", "flux1-tiny"),  # fused single-block styles: FusedColwiseParallel(4) on proj_mlp
    ("qwen_image", "qwen-image-tiny"),  # dual stream
    ("wan", "wan-tiny"),
    ("ltx2", "ltx2-tiny"),  # swapped shards in its serving layout: TP keeps the plan's
    ("minimax_h3", "h3-tiny"),  # swapped SwiGLU shards, fused Q/K/V
]


def test_every_familys_sharded_rollout_samples_as_the_replicated_one(tmp_path: Path) -> None:
    run_ranks(_family_rank, WORLD, (free_port(), tmp_path), DEADLINE_S)
    for rank in range(WORLD):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for family, _ in FAMILY_PRESETS:
            r = results[family]
            assert "error" not in r, (family, r)
            assert r["sharded"] > 0, (family, r)  # the trained weights are held as shards
            assert r["applied"] == r["whole_applied"] > 0, (family, r)
            assert r["diff"] <= ATOL * max(1.0, r["scale"]), (family, r)
            assert r["moved"] > 100 * ATOL, (family, r)  # the synced adapter reached them
            # built without a whole second copy: today's shards, its own storage, the source
            # untouched, the RNG where the replicated build leaves it: the serving layout
            # draws nothing (sync/layouts.py), so with or without the replay
            assert r["as_before"] and r["own"] and r["source_kept"], (family, r)
            assert r["odd_kept"], (family, r)
            assert r["rng"] and r["rng_unreplayed"], (family, r)


def test_a_serving_layout_draw_that_cannot_be_replayed_is_refused(tiny_model, monkeypatch):
    """The sharded rollout reads the serving layout off a meta copy and repeats its
    ``nn.Linear`` init fills on the device: they advance the global RNG as on a real copy. A
    layout that drew any other way (here ``bernoulli_``) is refused by name, not let to move
    the RNG apart from the one-process run's."""
    from diffrl.errors import ConfigError
    from diffrl.parallel.tp_sync import serving_slot_map
    from diffrl.sync.weights import SlotMap

    def linear_init(self, model):  # what a fusion does: a fresh Linear, initialised from the RNG
        torch.nn.Linear(8, 4, device=next(model.parameters()).device)
        return SlotMap()

    monkeypatch.setattr(type(tiny_model.family), "serving_layout", linear_init, raising=False)
    torch.manual_seed(0)
    serving_slot_map(tiny_model, torch.device("cpu"))
    replayed = torch.get_rng_state()
    torch.manual_seed(0)
    torch.nn.Linear(8, 4)  # the same fill on a real copy
    assert torch.equal(replayed, torch.get_rng_state())

    def bernoulli(self, model):
        torch.empty(3, device=next(model.parameters()).device).bernoulli_(0.5)
        return SlotMap()

    monkeypatch.setattr(type(tiny_model.family), "serving_layout", bernoulli, raising=False)
    with pytest.raises(ConfigError, match=r"serving layout draws with aten.bernoulli_"):
        serving_slot_map(tiny_model, torch.device("cpu"))
