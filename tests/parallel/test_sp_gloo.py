"""Ulysses sequence parallelism on CPU over gloo (``diffrl/parallel/sp.py``).

Each parity test spawns 2 ranks (``spawn``, a free TCP port on 127.0.0.1). Every rank builds the
same full inputs from fixed seeds, keeps its contiguous slice of the sequence, runs the sharded
path, and writes the largest difference from the unsharded reference to ``tmp_path``; the parent
asserts on it. Tolerances, fp32: outputs atol 1e-5, gradients atol 2e-5. The all-to-alls only
move numbers, so the diffs seen are 0 (bitwise) for every output and for the op's gradients;
Wan's parameter gradients, summed over the ranks in another order, differ by ~4e-6 (max ~26).
The op's test also records how far the answer is from attending *within* a shard only, so a
tolerance far below it cannot pass by accident; Wan's records the sequence its blocks see.

Diffusers' path (``enable_ulysses``) divides by ``torch.accelerator.device_count()`` once (see
``sp.py``'s docstring); on a machine with none, ``enable_ulysses`` reports one device for that
call only, and the Wan test checks the count is 0 again afterwards. Its transformer, through
the ``_cp_plan`` hooks and diffrl's Ulysses attention on gloo, gives the unsharded output and,
summed over ranks, the unsharded parameter gradients. The actor over it: test_sp_train_gloo.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_ranks import finish_rank, free_port, init_gloo, run_ranks

from diffrl.errors import ConfigError
from diffrl.parallel import sp

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

WORLD = 2
ATOL = 1e-5  # outputs (magnitudes ~1)
GRAD_ATOL = 2e-5  # gradients
DEADLINE_S = 40.0  # a hang (a rank stuck in a collective) fails here, not at pytest's timeout


def _spawn(fn, *args) -> None:
    """Run ``fn(rank, port, *args)`` in WORLD fresh processes; re-raise a rank's failure."""
    run_ranks(fn, WORLD, (free_port(), *args), DEADLINE_S)


def _init(rank: int, port: int) -> None:
    init_gloo(rank, WORLD, port, DEADLINE_S)


def _read(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _error_of(fn, kind=ConfigError) -> str:
    try:
        fn()
    except kind as e:
        return str(e)
    return ""


# --- the op: ulysses_attention ----------------------------------------------------------------

# (name, B, S_q, S_kv, H, D, causal). 18 and 10 tokens are 9 and 5 a rank: odd shards; 19 and
# 7 are cut unevenly (10 + 9, 4 + 3), as ``tensor_split`` cuts them.
CASES = [
    ("self, 4 heads, 18 tokens", 2, 18, 18, 4, 8, False),
    ("causal, 4 heads, 10 tokens", 1, 10, 10, 4, 8, True),
    ("cross, 8 heads, 6 queries on 14 keys", 2, 6, 14, 8, 4, False),
    ("uneven, 4 heads, 19 queries on 7 keys", 2, 19, 7, 4, 8, False),
]


def _sdpa(q, k, v, causal):  # (B, S, H, D) in and out
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


def _attention_rank(rank: int, port: int, out: Path) -> None:
    _init(rank, port)
    group = dist.group.WORLD
    results = {}
    for name, b, s_q, s_kv, h, d, causal in CASES:
        g = torch.Generator().manual_seed(len(results))
        q, k, v = (torch.randn(b, s, h, d, generator=g) for s in (s_q, s_kv, s_kv))
        probe = torch.randn(b, s_q, h, d, generator=g)
        # The reference: SDPA on the whole sequence, and its input gradients.
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        ref = _sdpa(q, k, v, causal)
        ref_grads = torch.autograd.grad((ref * probe).sum(), (q, k, v))

        def cut(x):  # this rank's contiguous slice of the sequence
            return x.tensor_split(WORLD, dim=1)[rank]

        def mine(x):
            return cut(x.detach()).clone().requires_grad_()

        q_l, k_l, v_l = mine(q), mine(k), mine(v)
        got = sp.ulysses_attention(q_l, k_l, v_l, group, is_causal=causal)
        got_grads = torch.autograd.grad((got * cut(probe)).sum(), (q_l, k_l, v_l))
        ref_l = cut(ref.detach())
        within_shard = _sdpa(q_l, k_l, v_l, causal).detach()  # what no communication would give
        results[name] = dict(
            shape=list(got.shape),
            diff=(got - ref_l).abs().max().item(),
            within_shard=(within_shard - ref_l).abs().max().item(),
            grad_diff=max(
                (gg - cut(rg)).abs().max().item()
                for gg, rg in zip(got_grads, ref_grads, strict=True)
            ),
        )
    # 3 heads over 2 ranks: refused before any all-to-all, so no rank hangs.
    x = torch.randn(1, 4, 3, 8)
    results["error"] = _error_of(lambda: sp.ulysses_attention(x, x, x, group))
    finish_rank(out, rank, results)


def test_ulysses_attention_on_shards_equals_full_attention(tmp_path):
    t0 = time.monotonic()
    _spawn(_attention_rank, tmp_path)
    ranks = _read(tmp_path)
    for name, b, s_q, _, h, d, _ in CASES:
        for rank, r in enumerate(ranks):
            c = r[name]
            assert c["shape"] == [b, (s_q + WORLD - 1 - rank) // WORLD, h, d], (rank, name)
            assert c["diff"] <= ATOL, (rank, name, c)
            assert c["grad_diff"] <= GRAD_ATOL, (rank, name, c)
        # The shards did talk (on some rank: under a causal mask rank 0 needs only its own).
        assert max(r[name]["within_shard"] for r in ranks) > 100 * ATOL, (name, ranks)
    for r in ranks:
        assert "parallel.sp=2" in r["error"] and "must divide 3" in r["error"], r["error"]
    assert time.monotonic() - t0 < DEADLINE_S


def test_heads_not_divisible_by_sp_is_refused_before_any_group():
    sp.check_heads(12, 4)  # divides: no error
    with pytest.raises(
        ConfigError, match=r"parallel\.sp=5: .*12 attention heads.*\[1, 2, 3, 4, 6, 12\]"
    ):
        sp.check_heads(12, 5)


# --- diffusers' path: enable_ulysses ----------------------------------------------------------


def test_enable_ulysses_refuses_a_family_without_cp_plan():
    from diffusers import SD3Transformer2DModel

    from diffrl.models.families import sd3

    dit = SD3Transformer2DModel.from_config(sd3.PRESETS["sd35-tiny"]["transformer"])
    # The family is checked first, so no group is needed to hear it.
    with pytest.raises(ConfigError, match=r"SD3Transformer2DModel declares no .*_cp_plan"):
        sp.enable_ulysses(dit, None)


def _wan_rank(rank: int, port: int, out: Path) -> None:
    from diffusers import WanTransformer3DModel

    from diffrl.models.families import wan
    from diffrl.models.families._diffusers import init_weights, random_component
    from diffrl.parallel.dims import ParallelDims, build_meshes

    _init(rank, port)
    meshes = build_meshes(ParallelDims(sp=2, world_size=WORLD), "cpu")
    torch.manual_seed(0)
    cfg = wan.PRESETS["wan-tiny"]["transformer"]
    dit = random_component(WanTransformer3DModel, cfg, torch.float32, torch.device("cpu"))
    init_weights(dit, std=0.1)  # at 0.02 a tiny DiT's blocks barely move the output
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 3, 4, 4, generator=g)  # (B, C, F, h, w): 3 * 2 * 2 = 12 tokens
    txt = torch.randn(2, 8, cfg["text_dim"], generator=g)  # (B, L, text_dim)
    t = torch.tensor([250.0, 900.0])
    probe = torch.randn(x.shape, generator=g)

    def forward():
        return dit(x, t, txt, return_dict=False)[0]

    def grads(loss) -> dict:
        dit.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in dit.named_parameters() if p.grad is not None}

    ref = forward()
    ref_grads = grads((ref * probe).sum())
    seen = []  # the sequence length the first block's self-attention sees
    dit.blocks[0].attn1.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        forward()

    result = dict(no_accelerator=torch.accelerator.device_count() == 0)
    sp.enable_ulysses(dit, meshes.main)
    result["count_after"] = torch.accelerator.device_count()
    got = forward()
    got_grads = grads((got * probe).sum())
    for p in got_grads.values():  # each rank holds its tokens' share
        dist.all_reduce(p, group=meshes.group("sp"))
    result.update(
        seen=seen,
        shape=list(got.shape),
        diff=(got - ref).abs().max().item(),
        grad_diff=max((got_grads[n] - gr).abs().max().item() for n, gr in ref_grads.items()),
        grad_scale=max(gr.abs().max().item() for gr in ref_grads.values()),
        same_grads=sorted(got_grads) == sorted(ref_grads),
    )
    finish_rank(out, rank, result)


def test_wan_with_diffusers_ulysses_over_2_ranks_equals_unsharded(tmp_path):
    t0 = time.monotonic()
    _spawn(_wan_rank, tmp_path)
    for r in _read(tmp_path):
        if r["no_accelerator"]:  # the one device reported inside enable_ulysses only
            assert r["count_after"] == 0, r
        assert r["seen"] == [12, 12 // WORLD], r  # unsharded, then each rank's half
        assert r["shape"] == [2, 16, 3, 4, 4]
        assert r["diff"] <= ATOL, r
        assert r["same_grads"], r
        assert r["grad_diff"] <= GRAD_ATOL, r
    assert time.monotonic() - t0 < DEADLINE_S


def test_a_split_length_shorter_than_sp_is_refused_naming_the_rows():
    """Every rank must hold a row of every length the plan splits (diffusers would fail an
    assert deep in the forward): checked, before any collective, from the forward's inputs."""
    from diffusers import WanTransformer3DModel

    from diffrl.models.families import wan

    dit = WanTransformer3DModel.from_config(wan.PRESETS["wan-tiny"]["transformer"])
    sp.check_lengths(dit, 2, {"hidden_states": torch.zeros(1, 16, 1, 2, 4)})  # 2 tokens: fine
    with pytest.raises(
        ConfigError, match=r"parallel.sp=2: WanTransformer3DModel's .* video tokens \(1 x 1 x 1\)"
    ):
        sp.check_lengths(dit, 2, {"hidden_states": torch.zeros(1, 16, 1, 2, 2)})


def test_an_attention_mask_over_more_than_the_keys_is_refused():
    """diffrl's stand-in for diffusers' Ulysses-anything attention takes a mask over this rank's
    keys only; another (a (B, H, S_q, S_kv) mask) raises, naming the key, before any
    collective."""
    q = torch.zeros(1, 3, 4, 8)
    for mask in (torch.ones(1, 4, 3, 3, dtype=torch.bool), torch.ones(1, 1, 1, 5)):
        with pytest.raises(NotImplementedError, match=r"parallel.sp: .*mask over this rank's"):
            sp._UlyssesAnything.apply(q, q, q, mask, 0.0, False, None, False, False, None, None)
