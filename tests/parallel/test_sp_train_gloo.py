"""The actor at sp=2 over 2 gloo ranks (``parallel/sp.py``): LoRA on a diffusers transformer
whose forward is sharded over the sequence with the class's own ``_cp_plan`` (Ulysses), trains
as one process does.

Each rank and the parent build the same model (``torch.manual_seed(0)``), the same actor and the
same random lora_B, then take 3 DiffusionNFT steps on the same batch (an sp group is one
data-parallel rank: same rows, same draws). Against the one-process run (the parent's):

- a forward with the adapter (atol 1e-5: the all-to-alls only move numbers, the attention is
  SDPA over the same rows, so fp32 rounding alone differs);
- the adapters' gradients after the first step, summed over sp, and the same gradients before
  the sum, which must *not* match (each rank holds its tokens' share: measured here, it is why
  the actor sums; rtol 1e-5, atol 1e-6 x the tensor's largest value);
- the 3 losses and gradient norms (rtol 1e-5) and the adapters after 3 steps (as the gradients).

The H3 batch's prompts have different text lengths, so its packed sequences (text + video +
audio rows) come in odd lengths, cut 1 row unevenly over the 2 ranks; H3's actor also runs
with activation checkpointing (the blocks' splits and all-to-alls recomputed in the backward).
Wan, FLUX and Qwen-Image (its padded text's mask gathered over the keys) likewise.

Also: tp=2 x sp=2 on 4 ranks against one process (H3, the same checks); dp_shard=2 x sp=2 on 4
ranks against dp_shard=2 on 2; families without a plan diffrl train runs and the actor's
compile under sp refused at start-up, naming the family and the keys; and ``diffrl train``
under torchrun at sp=2 (the AV recipe) giving the one-process run's samples and first step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import (
    assert_same_first_step,
    free_port,
    init_gloo,
    leave_group,
    run_ranks,
    torchrun_train,
)

from diffrl.errors import ConfigError

pytest.importorskip("diffusers")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

WORLD = 2
STEPS = 3
DEADLINE_S = 180.0
RTOL = 1e-5
# (family, preset, prompts): the H3 prompts differ in length (odd and even packed sequences)
CASES = [
    ("minimax_h3", "h3-tiny", ["a red ball", "a blue ball bounces twice on the floor"]),
    ("wan", "wan-tiny", ["a red ball", "a blue ball bounces"]),
    ("flux", "flux1-tiny", ["a red ball", "a blue ball bounces"]),
    ("qwen_image", "qwen-image-tiny", ["a red ball", "a blue ball bounces"]),
]


def _model(family: str, preset: str):
    from diffrl.models.registry import ModelConfig, load_model

    torch.manual_seed(0)
    model = load_model(ModelConfig(family=family, preset=preset), "cpu")
    if family == "minimax_h3":  # an sp rank makes a call per sample (a packed call's documents
        model.net.pack = False  # would straddle ranks): the one-process runs make the same
    return model


def _batch(model, prompts: list[str]):
    from diffrl.types import TrainBatch

    n = 2 * len(prompts)
    g = torch.Generator().manual_seed(5)
    tokens = model.family.tokenize([p for p in prompts for _ in range(2)])
    return TrainBatch(
        input_ids=tokens.input_ids,
        ids_hash=tuple(tokens.hashes),
        x0=torch.randn((n, *model.family.latent_shape()), generator=g),
        optimality=torch.rand(n, generator=g),
        seeds=torch.arange(n),
    )


def _actor(model, sequence_parallel=None, sp_group=None, shard=None, dp_group=None, tp=None):
    from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm
    from diffrl.parallel.tp_lora import like

    # H3's runs recompute each block in the backward (SP, then activation checkpointing, in
    # torchtitan's order); the other families' keep their activations
    ckpt = model.family.name == "minimax_h3"

    cfg = ActorConfig(
        lr=1e-2, grad_clip=0.5, lora=AdapterConfig(rank=4, alpha=4.0),
        activation_checkpointing=ckpt,
    )  # fmt: skip
    algo = NFTConfig(weighting="uniform", timesteps_per_sample=1)
    actor = ActorEngine(
        model, cfg, list(model.family.lora_targets), get_algorithm("diffusion_nft"), algo,
        torch.device("cpu"), sequence_parallel=sequence_parallel, sp_group=sp_group,
        shard=shard, dp_group=dp_group, tensor_parallel=tp,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B = 0 at init would give A no gradient
        for n, p in sorted(actor.model.named_parameters()):
            if "lora_B.default" in n:
                p.copy_(like(torch.randn(p.shape, generator=g) * 0.1, p))
    actor.update_old(0.0)
    return actor


def _run(family, preset, prompts, sequence_parallel=None, group=None, tp=None) -> dict:
    """A forward, then 3 steps; everything the parent compares, as whole CPU tensors."""
    from diffrl.parallel.tp_lora import full

    model = _model(family, preset)
    batch = _batch(model, prompts)
    actor = _actor(model, sequence_parallel, group, tp=tp)
    x = torch.randn((2, *model.family.latent_shape()), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        v = actor.velocity(x, torch.tensor([0.3, 0.8]), batch.input_ids[1:3])
    shares: dict = {}
    if group is not None:  # the gradients as each rank holds them, before the sum over sp
        summed = actor._sum_over_sp

        def record() -> None:
            if not shares:
                shares.update(
                    {id(p): full(torch.zeros_like(p) if p.grad is None else p.grad).clone()
                     for p in actor.params}
                )  # fmt: skip
            summed()

        actor._sum_over_sp = record  # type: ignore[method-assign]
    lengths: set[int] = set()  # the sequence lengths the plan split, as the forwards saw them
    if group is not None:
        import inspect

        from diffrl.models.family import transformer_root
        from diffrl.parallel.sp import _lengths

        root = transformer_root(actor.model)
        sig = inspect.signature(root.forward)

        def seen(module, args, kwargs) -> None:
            lengths.update(_lengths(module, sig.bind_partial(*args, **kwargs).arguments).values())

        root.register_forward_pre_hook(seen, with_kwargs=True)
    names = {id(p): n for n, p in actor.model.named_parameters() if ".default." in n}
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        m = actor.train_step(batch)
        losses.append(m["actor/loss"])
        norms.append(m["actor/grad_norm"])
        if step == 0:
            # zeros for an adapter the forward does not reach (the sum over sp makes them)
            grads = {
                names[id(p)]: full(
                    torch.zeros_like(p) if p.grad is None else p.grad.detach()
                ).clone()
                for p in actor.params
            }
    return {
        "v": v, "losses": losses, "norms": norms, "grads": grads,
        "shares": {names[i]: g for i, g in shares.items()},
        "adapters": actor.adapter_tensors(), "layout": actor.layout, "lengths": sorted(lengths),
    }  # fmt: skip


def _rank(rank: int, port: int, out: str) -> None:
    """Every case in turn, on one pair of ranks (one spawn: the imports are paid once)."""
    from diffrl.models.registry import family as family_spec
    from diffrl.parallel.dims import ParallelDims, build_meshes
    from diffrl.parallel.sp import sp_hook

    init_gloo(rank, WORLD, port, DEADLINE_S)
    meshes = build_meshes(ParallelDims(sp=WORLD, world_size=WORLD), "cpu")
    for family, preset, prompts in CASES:
        spec = family_spec(family)
        hook = sp_hook(meshes.main["sp"], spec.name, spec.sp_plan)
        result = _run(family, preset, prompts, hook, meshes.group("sp"))
        result["count_restored"] = torch.accelerator.device_count() == 0
        torch.save(result, Path(out, f"{family}{rank}.pt"))
    leave_group()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    floor = 1e-6 * max(want.abs().max().item(), 1e-12)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=floor, msg=lambda m: f"{what}: {m}")


def _check(got: dict, want: dict, what: str) -> None:
    torch.testing.assert_close(got["v"], want["v"], rtol=0, atol=1e-5)
    assert got["grads"].keys() == want["grads"].keys()
    partial = reached = 0
    for n, w in want["grads"].items():
        _close(got["grads"][n], w, f"{what} grad {n}")
        reached += bool(w.abs().max() > 0)
        partial += not torch.allclose(got["shares"][n], w, rtol=1e-3, atol=0)
    # a rank's own gradients are shares, not the whole: the sum over sp is needed
    assert partial > reached // 2, (what, partial, reached)
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=RTOL, atol=0
    )
    for n, w in want["adapters"].items():
        _close(got["adapters"][n], w, f"{what} adapter {n}")


def test_sp_sharded_actor_trains_as_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    wants = {family: _run(family, preset, prompts) for family, preset, prompts in CASES}
    run_ranks(_rank, WORLD, (free_port(), str(tmp_path)), DEADLINE_S)
    for family, want in wants.items():
        assert len(set(want["losses"])) == STEPS and all(n > 0 for n in want["norms"])
        for rank in range(WORLD):
            got = torch.load(tmp_path / f"{family}{rank}.pt", weights_only=False)
            layout = got["layout"]
            assert layout.startswith(f"sequence parallel: Ulysses over sp={WORLD}"), layout
            assert "the rollout replicated" in layout
            assert got["count_restored"] or torch.accelerator.device_count() > 0
            assert got["lengths"], got["lengths"]
            if family == "minimax_h3":  # an odd packed sequence, cut unevenly, and an even one
                assert {n % 2 for n in got["lengths"]} == {0, 1}, got["lengths"]
            _check(got, want, f"{family} rank {rank}")


def _dp_run(fsdp_mesh, dp_group, dp_rank: int, sp_mesh=None) -> dict:
    """A data-parallel rank (dp 2) of H3 tiny, its base under FSDP2 over ``fsdp_mesh`` and,
    with ``sp_mesh``, its sequence sharded first; it trains its dp slice of the batch, 2 steps."""
    from diffrl.models.registry import family as family_spec
    from diffrl.parallel.fsdp import shard_frozen_base
    from diffrl.parallel.sp import sp_hook

    family, preset, prompts = CASES[0]
    spec = family_spec(family)
    hook = sp_hook(sp_mesh, spec.name, spec.sp_plan) if sp_mesh is not None else None
    model = _model(family, preset)
    mine = _batch(model, prompts).select(torch.arange(2 * dp_rank, 2 * dp_rank + 2))
    sp_group = sp_mesh.get_group() if sp_mesh is not None else None
    actor = _actor(model, hook, sp_group, shard=shard_frozen_base(fsdp_mesh), dp_group=dp_group)
    losses = [actor.train_step(mine)["actor/loss"] for _ in range(2)]
    return {"losses": losses, "adapters": actor.adapter_tensors(), "dp_rank": dp_rank}


def _four_ranks(rank: int, port: int, out: str) -> None:
    """On 4 ranks, in turn: tp=2 x sp=2 (H3 AVBench preset: 4 heads, 1 per rank in
    attention); dp_shard=2 x sp=2 (H3 tiny); and, as its reference, dp_shard=2 alone on each
    pair of ranks (0, 1 and 2, 3: two copies of a 2-rank world)."""
    from torch.distributed.device_mesh import DeviceMesh

    from diffrl.models.registry import family as family_spec
    from diffrl.parallel.dims import ParallelDims, build_meshes
    from diffrl.parallel.launch import Ranks
    from diffrl.parallel.sp import sp_hook
    from diffrl.parallel.tp_lora import tp_hook

    init_gloo(rank, 4, port, DEADLINE_S)
    meshes = build_meshes(ParallelDims(sp=2, tp=2, world_size=4), "cpu")
    spec = family_spec("minimax_h3")
    # 4 heads at tp=4 leave 1 per rank: sp=2 cannot split it (refused before any all-to-all)
    try:
        sp_hook(meshes.main["sp"], spec.name, spec.sp_plan, tp=4)(_model(*TP_CASE[:2]))
        refusal = ""
    except ConfigError as e:
        refusal = str(e)
    tp = tp_hook(meshes.main["tp"], spec.tp_plan, spec.name)
    sp = sp_hook(meshes.main["sp"], spec.name, spec.sp_plan, tp=2)
    result = _run(*TP_CASE, sp, meshes.group("sp"), tp=tp)
    result["refusal"] = refusal
    torch.save(result, Path(out, f"tp{rank}.pt"))

    meshes = build_meshes(ParallelDims(dp_shard=2, sp=2, world_size=4), "cpu")
    ranks = Ranks(rank, 4, meshes)
    dp = _dp_run(meshes.fsdp_mesh, ranks.dp_group, ranks.dp_rank, meshes.main["sp"])
    torch.save(dp, Path(out, f"dpsp{rank}.pt"))

    pairs = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("copy", "dp"))["dp"]
    dp = _dp_run(pairs, pairs.get_group(), pairs.get_local_rank())
    torch.save(dp, Path(out, f"dp{rank}.pt"))
    leave_group()


TP_CASE = ("minimax_h3", "h3-avbench", CASES[0][2])


def test_sp_beside_tp_and_dp_shard(tmp_path: Path) -> None:
    """tp=2 x sp=2 against one process: TP first, then Ulysses over each tp rank's heads; the
    same checks as above (the sp groups, ranks 0, 2 and 1, 3, sum the shares of the same
    shards). dp_shard=2 x sp=2 against dp_shard=2 (the same slices, the same per-row draws):
    the same losses and adapters (rtol 1e-5) on every rank; the sp pairs average over their dp
    peers (``Ranks.dp_group``) and sum over their sp group."""
    torch.set_num_threads(1)
    want = _run(*TP_CASE)
    run_ranks(_four_ranks, 4, (free_port(), str(tmp_path)), DEADLINE_S)
    pair = [torch.load(tmp_path / f"dp{r}.pt", weights_only=False) for r in range(4)]
    assert pair[0]["losses"][0] != pair[0]["losses"][1]
    for rank in range(4):
        got = torch.load(tmp_path / f"tp{rank}.pt", weights_only=False)
        assert "4 attention heads (1 per TP rank at tp=4)" in got["refusal"], got["refusal"]
        assert got["layout"].startswith("tensor parallel: minimax_h3's TP plan over tp=2")
        assert "sequence parallel: Ulysses over sp=2" in got["layout"]
        _check(got, want, f"tp x sp rank {rank}")
        got = torch.load(tmp_path / f"dpsp{rank}.pt", weights_only=False)
        assert got["dp_rank"] == rank // 2  # sp groups are consecutive ranks
        ref = pair[got["dp_rank"]]  # dp rank d of a pair is rank d of it
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0
        )
        for n, w in ref["adapters"].items():
            _close(got["adapters"][n], w, f"dp x sp rank {rank} adapter {n}")


# --- diffrl train: what is refused at start-up, and the command line ----------------------------

AV = "recipes/av_t2va_nft.yaml"


@pytest.mark.parametrize(
    ("recipe", "world", "extra", "says"),
    [
        (
            "recipes/shapes_sd3_nft.yaml", 2, [],
            r"parallel.sp=2: model family 'sd3' has no context-parallel plan for the sp axis",
        ),
        (AV, 2, [], r"'actor.compile' = True with parallel.sp=2"),
    ],
    ids=["sd3", "compiled-actor"],
)  # fmt: skip
def test_layouts_sp_cannot_run_are_refused_first(tmp_path, monkeypatch, recipe, world, extra, says):
    """Under a torchrun launch, before any process group or model: the family and the axis,
    or the keys to change."""
    from diffrl.build import build
    from diffrl.config import load_config

    monkeypatch.setenv("WORLD_SIZE", str(world))
    over = ["parallel.sp=2", "probe.mode=off", f"run.out_dir={tmp_path}", *extra]
    with pytest.raises(ConfigError, match=says):
        build(load_config(recipe, over))
    assert not dist.is_initialized()


def test_ltx2_plan_is_refused_by_name() -> None:
    """LTX-2 declares a _cp_plan (its record says so) whose audio stream is not split: refused,
    naming the family and the axis; the families diffrl train runs pass."""
    from diffrl.models.registry import family
    from diffrl.parallel.sp import check_family

    assert family("ltx2").sp_plan == "diffusers"
    with pytest.raises(ConfigError, match=r"parallel.sp=2: model family 'ltx2' on the sp axis"):
        check_family("ltx2", family("ltx2").sp_plan, 2)
    for name in ("minimax_h3", "wan", "flux", "qwen_image"):
        check_family(name, family(name).sp_plan, 2)


def _cli_overrides(out: Path) -> list[str]:
    return [
        "run.steps=1", "data.prompts_per_step=2", "rollout.group_size=2",
        "data.eval_prompts=2", "data.eval_samples_per_prompt=1", "probe.mode=off",
        f"run.out_dir={out}", "run.name=r", "run.tensorboard=false", "rollout.compile=false",
        "actor.compile=false", "run.threads=1", "run.eval_every=2", "run.save_every=1",
    ]  # fmt: skip


def test_sp_from_the_command_line(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m diffrl.cli train recipes/av_t2va_nft.yaml
    parallel.sp=2``: one sp group (one data-parallel rank), so the same samples as one process
    and its first step's loss and gradient norm (rel 1e-4: sums reordered by the shards)."""
    from diffrl.config import load_config
    from diffrl.controller.loop import train
    from diffrl.controller.run_dir import read_metrics

    one = read_metrics(asyncio.run(train(load_config(AV, _cli_overrides(tmp_path / "one")))))
    out = tmp_path / "sp"
    done = torchrun_train(WORLD, [AV, *_cli_overrides(out), "parallel.sp=2"], 600)
    console = done.stdout + done.stderr
    assert "sequence parallel: Ulysses over sp=2" in console
    assert "the rollout replicated" in console
    assert console.count("run directory:") == 1  # rank 0 alone
    rows = read_metrics(out / "r")
    assert [r["step"] for r in rows] == [0, 1]
    assert_same_first_step(rows, one)
