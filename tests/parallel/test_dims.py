"""ParallelDims: every layout error names its key and the fix, before any process group exists;
dp_shard=-1 resolution; the world-size-1 path (no torchrun, no process group)."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from diffrl.errors import ConfigError
from diffrl.parallel.dims import AXES, MAIN_AXES, Meshes, ParallelDims, build_meshes


def raises(*fragments: str):
    """pytest.raises(ConfigError) whose message contains every fragment, in order."""
    return pytest.raises(ConfigError, match=".*".join(re.escape(f) for f in fragments))


# --- resolution ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "degrees, world, dp_shard",
    [
        (dict(), 1, 1),
        (dict(), 8, 8),
        (dict(tp=2), 8, 4),
        (dict(dp_replicate=2, sp=2), 8, 2),
        (dict(dp_replicate=2, sp=2, tp=2), 8, 1),
        (dict(tp=2, etp=4), 8, 4),  # etp is not on the main mesh: it takes nothing from dp_shard
    ],
)
def test_dp_shard_minus_one_takes_what_is_left(degrees: dict, world: int, dp_shard: int) -> None:
    dims = ParallelDims(**degrees, world_size=world)
    resolved = dims.validate()
    assert resolved.dp_shard == dp_shard
    assert resolved.dp == resolved.dp_replicate * dp_shard
    assert resolved.dp_replicate * resolved.dp_shard * resolved.sp * resolved.tp == world
    assert dims.dp_shard == -1  # frozen: validate returns a copy


def test_explicit_degrees_that_fill_the_world_pass() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=2, sp=1, tp=2, etp=2, world_size=8)
    assert dims.validate(dit_heads=8, encoder_heads=28, kv_heads=4, family_has_tp_plan=True) == dims


def test_from_env_reads_the_launchers_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert ParallelDims.from_env(tp=2).validate() == ParallelDims(dp_shard=2, tp=2, world_size=4)
    monkeypatch.delenv("WORLD_SIZE")
    assert ParallelDims.from_env().world_size == 1


# --- the errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["dp_replicate", "sp", "tp", "etp"])
@pytest.mark.parametrize("value", [0, -1, -3])
def test_degree_below_one(key: str, value: int) -> None:
    with raises(f"parallel.{key}={value}", "must be an integer >= 1"):
        ParallelDims(**{key: value}, world_size=4).validate()


@pytest.mark.parametrize("value", [0, -2])
def test_dp_shard_below_one_and_not_minus_one(value: int) -> None:
    with raises(f"parallel.dp_shard={value}", ">= 1, or -1"):
        ParallelDims(dp_shard=value, world_size=4).validate()


def test_non_integer_degree() -> None:
    with raises("parallel.tp=2.0", "integer"):
        ParallelDims(tp=2.0, world_size=4).validate()  # type: ignore[arg-type]


def test_world_size_below_one() -> None:
    with raises("world_size=0", ">= 1"):
        ParallelDims(world_size=0).validate()


def test_minus_one_unresolvable() -> None:
    # 6 ranks cannot hold tp=4: nothing is left for dp_shard to fill
    with raises(
        "parallel.dp_shard=-1 cannot be resolved",
        "world size 6 is not divisible by dp_replicate*sp*tp = 1*1*4 = 4",
        "divisors: [1, 2, 3, 6]",
    ):
        ParallelDims(tp=4, world_size=6).validate()


def test_degrees_that_do_not_multiply_to_the_world() -> None:
    with raises("dp_replicate*dp_shard*sp*tp = 1*2*1*2 = 4", "world size is 8", "dp_shard=-1"):
        ParallelDims(dp_shard=2, tp=2, world_size=8).validate()
    with raises("= 1*1*1*2 = 2", "world size is 1"):  # tp=2 on one process
        ParallelDims(dp_shard=1, tp=2).validate()
    with raises("world size 1 is not divisible by dp_replicate*sp*tp = 1*1*2 = 2"):
        ParallelDims(tp=2).validate()  # and with dp_shard=-1


def test_etp_must_tile_the_world() -> None:
    with raises("parallel.etp=4", "tile the world of 6", "one of [1, 2, 3, 6]"):
        ParallelDims(etp=4, world_size=6).validate()


def test_etp_must_divide_the_encoders_heads() -> None:
    # Qwen3-VL-like encoder: 28 query heads, 4 KV heads; 8 ranks, so etp=8 fails on 28
    dims = ParallelDims(etp=8, world_size=8)
    with raises("parallel.etp=8", "its 28 attention heads", "one of [1, 2, 4]", "[28, 4]"):
        dims.validate(encoder_heads=28, kv_heads=4)
    # GQA: 32 query heads split 8 ways, but only 4 KV heads
    with raises("parallel.etp=8", "its 4 key/value heads", "one of [1, 2, 4]"):
        dims.validate(encoder_heads=32, kv_heads=4)
    assert dims.validate(encoder_heads=32, kv_heads=8).etp == 8


def test_etp_checks_every_encoder() -> None:
    # SD3-like: CLIP-L (12), CLIP-G (20) and T5 (64) heads; etp=8 divides only T5's 64, and the
    # first encoder that rejects it is named; etp=4 divides all three
    with raises("parallel.etp=8", "its 12 attention heads", "one of [1, 2, 4]", "[12, 20, 64]"):
        ParallelDims(etp=8, world_size=8).validate(encoder_heads=(12, 20, 64))
    assert ParallelDims(etp=4, world_size=8).validate(encoder_heads=(12, 20, 64)).etp == 4


def test_tp_needs_a_family_tp_plan() -> None:
    dims = ParallelDims(tp=2, world_size=4)
    with raises("parallel.tp=2", "declares no TP plan", "set parallel.tp=1"):
        dims.validate(family_has_tp_plan=False)
    assert dims.validate(family_has_tp_plan=True).tp == 2
    # tp=1 needs no plan
    assert ParallelDims(world_size=4).validate(family_has_tp_plan=False).dp_shard == 4


def test_tp_must_divide_the_dit_heads() -> None:
    with raises("parallel.tp=4", "the DiT's 6 attention heads", "one of [1, 2, 3, 6]"):
        ParallelDims(tp=4, world_size=4).validate(dit_heads=6)


def test_sp_must_divide_the_dit_heads() -> None:
    # Ulysses all-to-all over heads: 24 heads, sp=5 (world 5) cannot split them
    with raises("parallel.sp=5", "Ulysses", "24 attention heads", "sp must divide 24", "[1, 2, 3"):
        ParallelDims(sp=5, world_size=5).validate(dit_heads=24)
    assert ParallelDims(sp=4, world_size=4).validate(dit_heads=24).sp == 4


def test_sp_divides_the_heads_left_on_each_tp_rank() -> None:
    # 24 heads, tp=4 leaves 6 per TP rank; sp=4 divides 24 but not 6
    dims = ParallelDims(sp=4, tp=4, world_size=16)
    with raises("parallel.sp=4", "24 attention heads (6 per TP rank at tp=4)", "[1, 2, 3, 6]"):
        dims.validate(dit_heads=24)
    assert ParallelDims(sp=3, tp=4, world_size=12).validate(dit_heads=24).sp == 3


def test_model_checks_only_run_when_given_their_facts() -> None:
    # the config loader calls validate() bare: tp and sp pass on degrees alone
    assert ParallelDims(sp=5, tp=2, etp=5, world_size=10).validate().dp_shard == 1


# --- world size 1 ----------------------------------------------------------------------------


def test_world_size_one_needs_no_process_group() -> None:
    assert not dist.is_initialized()
    meshes = build_meshes(ParallelDims(), "cpu")
    assert not dist.is_initialized()  # nothing was started
    assert isinstance(meshes, Meshes)
    assert meshes.main is None and meshes.etp is None and meshes.fsdp_mesh is None
    assert meshes.dims == ParallelDims(dp_shard=1)
    assert meshes.dp_size == 1 and meshes.dp_rank == 0
    for axis in AXES:
        assert meshes.size(axis) == 1
        assert meshes.rank_in(axis) == 0
        assert meshes.group(axis) is None
    assert MAIN_AXES == ("dp_replicate", "dp_shard", "sp", "tp")


def test_unknown_axis_names_the_axes() -> None:
    meshes = build_meshes(ParallelDims(), "cpu")
    with pytest.raises(KeyError, match=r"unknown mesh axis 'pp'.*'dp_replicate'"):
        meshes.rank_in("pp")


def test_build_meshes_validates_first() -> None:
    with raises("parallel.dp_shard=-1 cannot be resolved", "world size 1"):
        build_meshes(ParallelDims(tp=2), "cpu")
    assert not dist.is_initialized()
