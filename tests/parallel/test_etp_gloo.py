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
from gloo_ranks import finish_rank, free_port, init_gloo, run_ranks

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
}


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
        diff=max((g - r).abs().max().item() for g, r in zip(got, ref, strict=True)),
        scale=min(r.abs().max().item() for r in ref),
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
