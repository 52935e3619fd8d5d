"""``parallel.etp`` in the training path (``parallel/etp.py``), on CPU over 2 gloo ranks: a tiny
preset's text encoders sharded over the ETP mesh and encoded at start-up give the one-process
outputs; the cache is sealed after (a new prompt raises, naming it); ranks that would encode
different rows are stopped before they hang; a family without an ETP plan is refused.

Every rank builds the preset from ``torch.manual_seed(0)`` (the same random weights everywhere),
encodes the prompts whole first (world 1), then shards and encodes through ``encode_all``.
Tolerance fp32: atol 1e-5 on outputs of magnitude ~1 (the sharded matmuls only reorder sums).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import finish_rank, free_port, init_gloo, run_ranks, torchrun_train

from diffrl.errors import ConfigError, ContractError

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)
pytest.importorskip("diffusers")

WORLD = 2
ATOL = 1e-5
DEADLINE_S = 120.0
TEXTS = ["a red circle on the left", "two blue squares", "a green triangle"]
# the tiny presets whose text encoders have an ETP plan: (family, preset, the sharded ones)
PRESETS = {
    "sd35-tiny": ("sd3", ["t5"]),  # CLIP-L and CLIP-G stay whole (no plan)
    "h3-tiny": ("minimax_h3", ["text_encoder"]),  # Qwen3-VL
    "flux1-tiny": ("flux", ["t5"]),
    "wan-tiny": ("wan", ["text_encoder"]),  # UMT5
    "qwen-image-tiny": ("qwen_image", ["text_encoder"]),  # Qwen2.5-VL: 4 heads, 2 KV heads
}
# ltx2-tiny's Gemma-3 has one KV head: refused at etp=2 (test_tp_gloo.py, preset_gemma3), its
# plan's parity run on a 2-KV-head Gemma-3 there


def _load(family: str, preset: str):
    from diffrl.models.registry import ModelConfig, load_model

    torch.manual_seed(0)
    return load_model(ModelConfig(family=family, preset=preset), torch.device("cpu"))


def _worker(rank: int, port: int, family: str, preset: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from diffrl.models.registry import family as family_spec
    from diffrl.parallel.dims import ParallelDims, build_meshes
    from diffrl.parallel.etp import encode_all, shard_encoders, text_encoders

    init_gloo(rank, WORLD, port, DEADLINE_S)
    model = _load(family, preset)
    ids = model.family.tokenize(TEXTS).input_ids
    null = model.family.null_ids()
    every = torch.cat([ids, null[None]])
    ref = model.net._encode(every)  # world 1: the whole encoders (the cache untouched)
    meshes = build_meshes(ParallelDims(etp=WORLD, world_size=WORLD), "cpu")
    sharded = shard_encoders(model, family_spec(family), meshes.etp)
    # duplicates (a row in both sets) and the empty prompt; 2 rows per call: 2 calls
    n = encode_all(model, [ids, ids[:1], null], meshes.group("etp"), chunk=2)

    def no_encode(_):
        raise AssertionError("encoded after encode_all")

    rows = model.net.cache.get(every, no_encode)
    got = [torch.stack(parts) for parts in zip(*rows, strict=True)]
    frac = {}
    for name, m in text_encoders(model).items():
        d = [p for p in m.parameters() if isinstance(p, DTensor)]
        frac[name] = sum(p.to_local().numel() for p in d) / max(1, sum(p.numel() for p in d))
    new = model.family.tokenize(["a purple star"]).input_ids
    from diffrl.types import hash_rows

    try:
        model.net.conditions(new)
        sealed = ""
    except ContractError as e:
        sealed = str(e)
    try:  # each rank a different row: refused on every rank before any encode
        encode_all(model, [ids[rank : rank + 1]], meshes.group("etp"), chunk=2)
        differ = ""
    except ContractError as e:
        differ = str(e)
    result = dict(
        n=n,
        # (a mask among the outputs, Qwen2.5-VL's: compared as numbers, a flipped entry is 1)
        diff=max(
            (g.double() - r.double()).abs().max().item() for g, r in zip(got, ref, strict=True)
        ),
        scale=min(r.double().abs().max().item() for r in ref),
        sharded=sharded,
        frac=frac,
        sealed=sealed,
        new_hash=hash_rows(new)[0],
        differ=differ,
    )
    finish_rank(Path(out), rank, result)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_sharded_encoders_encode_the_prompts_as_one_process(tmp_path, preset):
    family, want_sharded = PRESETS[preset]
    run_ranks(_worker, WORLD, (free_port(), family, preset, str(tmp_path)), DEADLINE_S)
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["n"] == len(TEXTS) + 1  # the distinct rows: the prompts and the empty one
        assert r["scale"] > 1e-3  # outputs that could show a broken shard
        assert r["diff"] < ATOL, r
        assert r["sharded"] == want_sharded
        for name, frac in r["frac"].items():  # each rank holds about half of a sharded one
            assert (0.3 < frac < 0.7) if name in want_sharded else frac == 0, (name, frac)
        assert r["new_hash"] in r["sealed"] and "sealed" in r["sealed"]
        assert "different prompt rows" in r["differ"]


def test_a_family_without_encoder_plans_is_refused_naming_it():
    """The record's plans do not cover the loaded encoders: refused naming the family and each
    encoder with its model type (no process group needed: the check comes first)."""
    from diffrl.models.registry import family as family_spec
    from diffrl.parallel.etp import encoder_plans

    model = _load("sd3", "sd35-tiny")
    spec = dataclasses.replace(family_spec("sd3"), etp_plans={"umt5": {}})
    with pytest.raises(ConfigError, match=r"parallel.etp=2: model family 'sd3'.*t5 \(T5Encoder"):
        encoder_plans(model, spec, 2)
    assert list(encoder_plans(model, family_spec("sd3"), 2)) == ["t5"]


RECIPE = "recipes/shapes_sd3_nft.yaml"  # sd3-shapes: CLIP-L, CLIP-G and a 4-head T5
TINY = [
    "run.steps=1", "data.prompts_per_step=2", "rollout.group_size=2", "rollout.num_steps=2",
    "rollout.eval_num_steps=2", "data.eval_prompts=4", "data.eval_samples_per_prompt=1",
    "run.eval_every=1", "run.tensorboard=false", "rollout.compile=false", "actor.compile=false",
    "run.threads=1", "algorithm.timesteps_per_sample=1",
    # a continuous reward: the base's two samples of a prompt can tie under the verifier, and
    # a tied group's first NFT gradient is exactly 0 (r = 1/2, v_theta = v_old), so the
    # gradients would compare nothing
    "reward.scorers=[{name: jpeg_incompressibility}]",
]  # fmt: skip


def _torchrun(out: Path, *extra: str) -> tuple[list[dict], str]:
    """``torchrun --nproc-per-node 2 -m diffrl.cli train`` as a user runs it (CPU, gloo)."""
    from diffrl.controller.run_dir import read_metrics

    done = torchrun_train(2, [RECIPE, *TINY, f"run.out_dir={out}", *extra], 300)
    return read_metrics(out / "shapes_sd3_nft"), done.stderr


def test_train_with_sharded_encoders_is_the_data_parallel_run(tmp_path):
    """``parallel.etp=2`` beside data parallelism 2 (the same 2 ranks): the T5 sharded, every
    prompt encoded at start-up, and the run's metrics those of the DP-only run: the samples,
    rewards and evals equal, the loss and gradient norm to fp32 rounding (the encoder's sums
    are only reordered)."""
    dp, said = _torchrun(tmp_path / "dp")
    etp, says = _torchrun(tmp_path / "etp", "parallel.etp=2")
    assert "ETP:" not in said
    # sd3-shapes: 212 training + 4 held-out prompts (distinct) + the empty one
    assert "ETP: text encoder(s) t5 sharded over 2 ranks; 217 prompt rows encoded" in says
    assert [r["step"] for r in etp] == [r["step"] for r in dp] == [0, 1]
    for a, b in zip(dp, etp, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if k.startswith(("reward/", "eval/")):
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7), k
            elif k.startswith(("actor/loss", "actor/grad_norm", "nft/")):
                assert b[k] == pytest.approx(a[k], rel=1e-5), k
    assert etp[1]["actor/grad_norm"] > 0


def test_a_prompt_universe_larger_than_the_cache_is_refused_at_start_up():
    """Every row is kept once encoded: more distinct rows than the cache holds is a ConfigError
    before any collective (no process group needed to see it)."""
    from diffrl.parallel.etp import encode_all

    model = _load("sd3", "sd35-tiny")
    model.net.cache.capacity = 2
    ids = model.family.tokenize(TEXTS).input_ids
    with pytest.raises(ConfigError, match=r"parallel.etp: .* 3 distinct rows .* cache's 2"):
        encode_all(model, [ids], None, chunk=2)
    assert not model.net.cache.store and not model.net.cache.sealed
