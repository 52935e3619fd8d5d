"""rollout.packed: requests of different resolutions and step counts share one forward through
sequence packing (block-diagonal attention), with FlowGRPO's SDE steps and log-probs, and give
what sampling each request alone gives, on the tiny DiT and on SD3's tiny configuration (joint
attention, SD3.5's dual attention, CFG).

Tolerance: fp32, atol 1e-5 on latents and log-probs (magnitude ~1). A packed forward's
attention batches the segments of one length together, and its linears run over every sample's
tokens at once: matmul rounding only."""

from __future__ import annotations

import pytest
import torch
from sd3_tiny import sd3_tiny

from diffrl.errors import ConfigError, FieldError
from diffrl.models.family import FamilyModel
from diffrl.models.packed import Packing, attend
from diffrl.rollout.engine import RolloutConfig, RolloutEngine, sample_seeds
from diffrl.rollout.scheduled import step_plan, training_request
from diffrl.rollout.scheduler import Finished, tokens
from diffrl.tasks.shapes.prompts import split_prompts

CPU = torch.device("cpu")


def mixed(eng: RolloutEngine, shapes, steps, g: int = 2):
    """A stream of FlowGRPO requests cycling through ``shapes`` and ``steps``."""
    texts = [p.text for p in split_prompts("train")[:6]]
    ids = eng.family.tokenize(texts).input_ids
    out = []
    for k in range(6):
        sigmas, mask = step_plan(eng, steps[k % len(steps)], "sde", iteration=0, seed=3)
        seeds = sample_seeds(100 + k, g)
        shape = shapes[k % len(shapes)]
        out.append(training_request(eng, ids[k], seeds, shape, sigmas, mask, rid=k))
    return out


def run(eng: RolloutEngine, reqs, budget: int, packed: bool) -> tuple[dict[int, Finished], int]:
    b = eng.batcher(token_budget=budget, packed=packed)
    for r in reqs:
        b.submit(r)
    return {f.request.rid: f for f in b.run()}, b.forwards


def alone(eng: RolloutEngine, req) -> Finished:
    (got,) = run(eng, [req], 1, packed=False)[0].values()
    return got


@pytest.mark.parametrize("family", ["tiny_dit", "sd3"])
def test_mixed_shapes_share_a_forward_and_match_sampling_alone(tiny_model, family) -> None:
    model = tiny_model if family == "tiny_dit" else sd3_tiny()
    cfg = RolloutConfig(
        keep_latents=True, noise_level=0.8, cfg_scale=1.0 if family == "tiny_dit" else 2.0
    )
    eng = RolloutEngine(model, cfg, [], CPU)
    c = model.family.latent_shape()[0]
    sides = [(32, 32), (16, 16), (24, 16)] if family == "tiny_dit" else [(8, 8), (4, 4), (4, 8)]
    shapes = [(c, *s) for s in sides]
    reqs = mixed(eng, shapes, [3, 2])
    budget = sum(r.cost() for r in reqs)  # the whole stream fits: every shape in each forward
    packed, forwards = run(eng, mixed(eng, shapes, [3, 2]), budget, packed=True)
    _, bucketed = run(eng, mixed(eng, shapes, [3, 2]), budget, packed=False)
    assert forwards == 3 < bucketed  # one forward per step, however many shapes
    for r in reqs:
        want, got = alone(eng, r), packed[r.rid]
        assert got.x0.shape[1:] == r.shape and got.media["image"].shape[0] == 2
        for name in ("x0", "latents", "log_probs"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=1e-5)
        assert (got.log_probs[:, :-1] != 0).all()  # FlowGRPO: every step but the last is SDE


def test_block_diagonal_attention_is_attention_per_segment() -> None:
    torch.manual_seed(0)
    lengths = [5, 3, 5, 2]
    q, k, v = (torch.randn(sum(lengths), 2, 4) for _ in range(3))
    mask = torch.rand(sum(lengths)) > 0.2
    mask[[0, 5, 8, 13]] = True  # every segment keeps a key
    pack = Packing.of(lengths, "cpu")
    out = attend(q, k, v, pack, mask)
    at = 0
    for n in lengths:
        s = slice(at, at + n)
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[s].transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask[s][None, None, None]
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[s], ref, rtol=0, atol=1e-6)
        at += n
    assert pack.cu.tolist() == [0, 5, 8, 13, 15] and pack.seg.tolist()[5:9] == [1, 1, 1, 2]
    # the same attention read from (and written to) a permuted layout, through ``order``
    perm = torch.randperm(len(q))
    src = [torch.empty_like(t) for t in (q, k, v)]
    for s_, t in zip(src, (q, k, v), strict=True):
        s_[perm] = t  # packed position p lives at row perm[p]
    m = torch.empty_like(mask)
    m[perm] = mask
    got = attend(src[0], src[1], src[2], pack, m, order=perm)  # the mask in that layout too
    torch.testing.assert_close(got[perm], out, rtol=0, atol=1e-6)


def test_packed_needs_the_scheduler_and_a_shared_budget(tiny_model) -> None:
    with pytest.raises(FieldError, match="packed"):
        RolloutConfig(packed=True).validate()
    with pytest.raises(FieldError, match="compile=false"):
        RolloutConfig(engine="scheduler", packed=True, compile=True).validate()

    class Plain(torch.nn.Module):  # a net with no packed forward (FLUX's, Wan's, ...)
        def __init__(self, net) -> None:
            super().__init__()
            self.inner = net

        def forward(self, *a):
            return self.inner(*a)

    plain = FamilyModel(Plain(tiny_model.net), tiny_model.family)
    with pytest.raises(ConfigError, match="no packed forward"):
        RolloutEngine(plain, RolloutConfig(engine="scheduler", packed=True), [], CPU)
    eng = RolloutEngine(tiny_model, RolloutConfig(), [], CPU)
    small, big = (3, 16, 16), (3, 32, 32)
    reqs = mixed(eng, [big, small], [2])
    # room for one big request's rows: the small one waits (FIFO under one budget)
    done, forwards = run(eng, reqs[:2], 2 * tokens(big), packed=True)
    assert sorted(done) == [0, 1] and forwards == 4
