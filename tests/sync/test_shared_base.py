"""rollout.share_base: the rollout and evaluator alias the loaded model's frozen weights and hold
the synced LoRA as factors beside them (diffrl/sync/shared_base.py). Sampling equals the merged
copy's within float rounding; the actor's training does not reach the rollout before a sync;
a tampered update raises and changes nothing; the copies cost only their factors."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch

from diffrl.errors import ConfigError
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.sync.receipt import load_verified
from diffrl.sync.shared_base import apply_shared_lora
from diffrl.sync.weights import LoraDelta, SyncError, WeightUpdate
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts

SHARED = ["rollout.share_base=true", "rollout.compile=false"]  # compiled blocks: refused

CPU = torch.device("cpu")
RANK = 4  # conftest's make_actor default
# fp32 sampling, 3 Euler steps of the tiny DiT: x W^T + (x A^T) B^T against x (W + BA)^T
# differs by float32 reassociation only
ATOL = 2e-5


def engines(model, names, **kw):
    cfg = RolloutConfig(group_size=2, num_steps=3, **kw)
    merged = RolloutEngine(model, cfg, names, CPU)
    shared = RolloutEngine(
        model, dataclasses.replace(cfg, share_base=True), names, CPU, lora_rank=RANK
    )
    return merged, shared


def sample(engine, prompts, seed=5):
    return asyncio.run(engine.generate(prompts, seed)).x0


def factors(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.named_buffers() if "shared_lora" in k}


@pytest.fixture
def setup(tiny_model, actor_factory, train_batch_factory, lora_names):
    names = lora_names(tiny_model)
    merged, shared = engines(tiny_model, names)
    actor = actor_factory(tiny_model, lr=2e-2, rank=RANK)
    prompts = PromptSet(
        [Prompt(p.text) for p in split_prompts("train")[:3]], tiny_model.family.tokenize
    )
    return tiny_model, merged, shared, actor, prompts.batch([0, 1, 2])


def test_shared_base_aliases_and_samples_like_the_merged_copy(setup, train_batch_factory) -> None:
    model, merged, shared, actor, prompts = setup
    # every weight of the shared copy is the loaded model's storage; the merged copy's is not
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert {p.untyped_storage().data_ptr() for p in shared.model.parameters()} <= own
    assert not {p.untyped_storage().data_ptr() for p in merged.model.parameters()} & own
    # the hook is on the alias copy's Linears only, never on the actor's modules
    hooked = [m for m in shared.model.modules() if apply_shared_lora in m._forward_hooks.values()]
    assert len(hooked) == len(shared.target.expected) == 8
    assert not any(apply_shared_lora in m._forward_hooks.values() for m in actor.model.modules())
    # version 0: the zero factors add exactly nothing
    v0 = sample(shared, prompts)
    assert torch.equal(v0, sample(merged, prompts))
    actor.train_step(train_batch_factory(4, seed=1))
    # the actor's new adapter does not reach the rollout before a sync
    assert torch.equal(sample(shared, prompts), v0)
    update = actor.export_weights("default")
    load_verified(merged, update)
    metrics = load_verified(shared, update)  # the receipt checks what the hooks apply
    assert metrics["sync/applied"] == 8 and shared.version == 1
    after = sample(shared, prompts)
    assert (after - v0).abs().max() > 1e-3  # the sync changed the policy
    torch.testing.assert_close(after, sample(merged, prompts), rtol=0, atol=ATOL)


def _swap_rows(update: WeightUpdate) -> WeightUpdate:
    """Rows 0 and 1 of one delta's B swapped, its checksum and prints kept: only the row
    prints can see it."""
    name = sorted(update.deltas)[-1]
    d = update.deltas[name]
    b = d.b.clone()
    b[[0, 1]] = b[[1, 0]]
    return dataclasses.replace(update, deltas={**update.deltas, name: LoraDelta(d.a, b, d.scale)})


@pytest.mark.parametrize("fault", ["checksum", "swapped_rows", "rank", "dtype"])
def test_a_tampered_update_raises_and_changes_nothing(setup, train_batch_factory, fault) -> None:
    _, _, shared, actor, prompts = setup
    actor.train_step(train_batch_factory(4, seed=1))
    shared.load_weights(actor.export_weights("default"))  # a non-base state to protect
    actor.train_step(train_batch_factory(4, seed=2))
    good = actor.export_weights("default")
    name = sorted(good.deltas)[-1]
    if fault == "checksum":
        bad, match = dataclasses.replace(good, checksums={**good.checksums, name: 1.0}), "checksum"
    elif fault == "swapped_rows":
        bad, match = _swap_rows(good), "row print of trained row 0"
    elif fault == "rank":
        d = good.deltas[name]
        wide = LoraDelta(torch.cat([d.a, d.a]), torch.cat([d.b, d.b], 1), d.scale)
        bad, match = (
            WeightUpdate.build(2, "default", {**good.deltas, name: wide}, good.base),
            "do not fit",
        )
    else:
        d = good.deltas[name]
        half = LoraDelta(d.a.half(), d.b.half(), d.scale)
        bad, match = dataclasses.replace(good, deltas={**good.deltas, name: half}), "converted"
    before, x_before = factors(shared), sample(shared, prompts)
    with pytest.raises(SyncError, match=match):
        shared.load_weights(bad)
    after = factors(shared)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(sample(shared, prompts), x_before) and shared.version == 1
    load_verified(shared, good)  # the good one still applies


def test_the_receipt_sees_a_removed_hook_and_a_changed_base(setup, train_batch_factory) -> None:
    model, _, shared, actor, _ = setup
    actor.train_step(train_batch_factory(4, seed=1))
    update = actor.export_weights("default")
    load_verified(shared, update)
    name = shared.target.expected[0]
    module = shared.model.get_submodule(name)
    handle = next(k for k, h in module._forward_hooks.items() if h is apply_shared_lora)
    hook = module._forward_hooks.pop(handle)  # the LoRA no longer applied: samples the base
    with pytest.raises(SyncError, match="still on its base"):
        load_verified(shared, update)
    module._forward_hooks[handle] = hook
    load_verified(shared, update)
    with torch.no_grad():  # a full fine-tune would move the shared base under the rollout
        model.get_submodule(name).weight[:] += 0.01
    with pytest.raises(SyncError, match="changed after it was verified"):
        load_verified(shared, update)


def test_the_copies_cost_their_factors_only(tiny_model, lora_names) -> None:
    from diffrl.parallel.plan import held_tensors

    names = lora_names(tiny_model)
    gc.collect()
    start = sum(held_tensors("cpu").values())
    cfg = RolloutConfig(share_base=True)
    shared = [RolloutEngine(tiny_model, cfg, names, CPU, lora_rank=RANK) for _ in range(2)]
    gc.collect()
    grown = sum(held_tensors("cpu").values()) - start
    want = sum(e.target.factor_bytes() for e in shared)
    whole = sum(p.nbytes for p in tiny_model.parameters())
    assert want < whole / 5
    # the factors, the sync's float64 base prints and probes, and the few small tensors deepcopy
    # gives the copies: no weight and no base copy
    assert want <= grown < want + whole / 4, (grown, want, whole)
    merged = RolloutEngine(tiny_model, RolloutConfig(), names, CPU)
    gc.collect()
    assert sum(held_tensors("cpu").values()) - start - grown > whole  # a DiT and its base copy
    del merged


def test_what_cannot_share_is_refused(tiny_model, lora_names) -> None:
    names = lora_names(tiny_model)
    with pytest.raises(ConfigError, match="LoRA rank"):
        RolloutEngine(tiny_model, RolloutConfig(share_base=True), names, CPU)
    with pytest.raises(ConfigError, match="sampling with the actor's own model"):
        RolloutEngine(
            tiny_model, RolloutConfig(share_base=True), [], CPU, serving_layout=False,
            share_model=True, lora_rank=RANK,
        )  # fmt: skip
    meta = torch.device("meta")
    with pytest.raises(ConfigError, match="not wholly on meta"):
        RolloutEngine(tiny_model, RolloutConfig(share_base=True), names, meta, lora_rank=RANK)


def test_a_diffusers_family_samples_alike_shared_or_merged() -> None:
    """sd35-tiny: the merged copy in SD3's serving layout, the shared one beside its base."""
    from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm
    from diffrl.build import expanded_targets
    from diffrl.models.registry import ModelConfig, load_model, lora_targets

    pytest.importorskip("diffusers")
    mcfg = ModelConfig(family="sd3", preset="sd35-tiny", resolution=32)
    model = load_model(mcfg, "cpu")
    targets = list(lora_targets(mcfg))
    merged, shared = engines(model, expanded_targets(model, targets))
    actor = ActorEngine(
        model, ActorConfig(lora=AdapterConfig(rank=RANK, alpha=float(RANK))), targets,
        get_algorithm("diffusion_nft"), NFTConfig(), CPU,
    )  # fmt: skip
    texts = ["a red circle", "a blue square"]
    prompts = PromptSet([Prompt(t) for t in texts], model.family.tokenize).all()
    v0 = sample(shared, prompts)
    assert torch.equal(v0, sample(merged, prompts))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # an adapter far from its zero start, as training would leave it
        for layer in actor.layers.values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g))
    assert torch.equal(sample(shared, prompts), v0)  # not before a sync
    update = actor.export_weights("default")
    load_verified(merged, update)
    load_verified(shared, update)
    after, want = sample(shared, prompts), sample(merged, prompts)
    moved = float((want - v0).abs().max())  # the random tiny SD3 moves little with its LoRA
    assert moved > 1e-4
    torch.testing.assert_close(after, want, rtol=0, atol=min(ATOL, moved / 20))


def test_compiled_blocks_are_refused(tiny_model, lora_names) -> None:
    """rollout.compile with share_base is refused: dynamo does not guard on module hooks, so a
    block compiled before the LoRA hooks were added would be reused without them (in the CI
    suite it was: samples 0.05 off the eager ones); the config and the engine both say so."""
    from diffrl.config import load_config

    with pytest.raises(ConfigError, match="rollout.compile=false with rollout.share_base"):
        load_config(None, ["rollout.share_base=true", "rollout.compile=true"])
    cfg = RolloutConfig(group_size=2, num_steps=2, share_base=True, compile=True)
    with pytest.raises(ConfigError, match="rollout.compile with rollout.share_base"):
        RolloutEngine(tiny_model, cfg, lora_names(tiny_model), CPU, lora_rank=RANK)


def test_the_run_config_refuses_what_cannot_share() -> None:
    from types import SimpleNamespace

    from diffrl.build import check_config
    from diffrl.config import load_config
    from diffrl.sync.shared_base import check_share_ranks

    with pytest.raises(ConfigError, match="CUDA IPC of the base, not built"):
        check_config(load_config(None, [*SHARED, "run.backend=ray"]))
    with pytest.raises(ConfigError, match="rollout.cuda_graphs=true"):
        check_config(load_config(None, [*SHARED, "rollout.cuda_graphs=true"]))
    check_config(load_config(None, SHARED))  # the default recipe shares, eager

    def ranks(dp: int, tp: int) -> SimpleNamespace:
        return SimpleNamespace(dp_size=dp, meshes=SimpleNamespace(size={"tp": tp}.get))

    check_share_ranks(ranks(1, 1))  # torchrun, one rank (or sp only): the base stays whole
    for dp, tp in ((2, 1), (1, 2)):
        with pytest.raises(ConfigError, match="FSDP2-sharded .* or TP-sharded"):
            check_share_ranks(ranks(dp, tp))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factors_held_in_the_model_dtype_verify_and_apply(dtype) -> None:
    """A bf16 model holds its factors in bf16 (the scale folded into B): the prints' and the
    checksum's tolerances cover that rounding, and still see two swapped rows."""
    from diffrl.sync.receipt import check_receipt, expected_of
    from diffrl.sync.shared_base import SharedBaseTarget, receipt_of_shared
    from diffrl.sync.weights import BasePrints

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96)).to(dtype)
    before = model[0].weight.clone()
    target = SharedBaseTarget(model, ["0"], 8, BasePrints.of_model(model, ["0"]))
    delta = LoraDelta(torch.randn(8, 64) * 0.1, torch.randn(96, 8) * 0.1, scale=0.75)
    update = WeightUpdate.build(1, "default", {"0": delta}, target.verified)
    report = target.apply(update)
    assert report.applied == 1
    if dtype == torch.bfloat16:  # the cast's rounding shows, inside its tolerance
        assert 0 < report.max_print_frac < 1
    check_receipt(1, expected_of(update), receipt_of_shared(target, 1))
    assert torch.equal(model[0].weight, before)  # the base is never written
    x = torch.randn(5, 64)
    want = x @ (before.float() + delta.delta()).T + model[0].bias.float()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(model(x.to(dtype)).float(), want, rtol=0, atol=tol)
    with pytest.raises(SyncError, match="row print"):
        target.apply(dataclasses.replace(_swap_rows(update), version=2))


def test_a_target_refuses_what_it_cannot_hold_or_verify() -> None:
    from diffrl.sync.shared_base import SharedBaseTarget
    from diffrl.sync.weights import BasePrints

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU())
    other = torch.nn.Sequential(torch.nn.Linear(16, 24))  # another base of the same shapes
    prints = BasePrints.of_model(model, ["0"])
    with pytest.raises(ConfigError, match="rank 0"):
        SharedBaseTarget(model, ["0"], 0, prints)
    with pytest.raises(SyncError, match="'1' is not a Linear"):
        SharedBaseTarget(model, ["0", "1"], 4, prints)
    assert not model[0]._forward_hooks  # nothing installed by a target that failed its checks
    with pytest.raises(SyncError, match="holds other base weights"):
        SharedBaseTarget(copy_of(model), ["0"], 4, BasePrints.of_model(other, ["0"]))
    target = SharedBaseTarget(copy_of(model), ["0"], 4, prints)
    with pytest.raises(SyncError, match="already holds shared factors"):
        SharedBaseTarget(target.model, ["0"], 4, prints)
    delta = LoraDelta(torch.randn(4, 16), torch.randn(24, 4), scale=1.0)
    # an actor that trains another base: its prints differ from the shared base's
    update = WeightUpdate.build(1, "default", {"0": delta}, BasePrints.of_model(other, ["0"]))
    with pytest.raises(SyncError, match="against the actor's base"):
        target.apply(update)
    assert not target.model[0].shared_lora_b.any()  # nothing committed
    target.apply(WeightUpdate.build(1, "default", {"0": delta}, prints))
    assert target.model[0].shared_lora_b.any()


def copy_of(model: torch.nn.Module) -> torch.nn.Module:
    from diffrl.parallel.tp_sync import alias_copy

    return alias_copy(model)


def test_bench_runs_a_shared_base_recipe_against_its_own_baseline(tiny_checkpoint, tmp_path):
    """``diffrl bench rollout`` on a run with share_base: the run's engines share, and the
    plain-loop baseline (its own freshly loaded model, share_model) is built without it."""
    from tiny_runs import tiny_run

    from diffrl.bench import mfu
    from diffrl.config import load_config

    over = tiny_run(
        tiny_checkpoint, tmp_path, 1, "rollout.num_steps=2", "rollout.share_base=true",
        "data.prompts_per_step=1", "rollout.group_size=2",
    )  # fmt: skip
    result = mfu.bench("rollout", load_config("recipes/shapes_nft.yaml", over), repeats=1)
    assert result.seconds > 0 and result.baseline_seconds > 0
