"""The rollout engine: reproducible, batching-invariant, grouped trajectories."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from stream_helpers import stream_parts

from diffrl.errors import ContractError, FieldError
from diffrl.rollout.engine import RolloutConfig, RolloutEngine, noise_from_seeds, sample_seeds
from diffrl.rollout.samplers import sigma_schedule
from diffrl.sync.weights import SyncError, WeightUpdate
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.types import images_to_uint8


@pytest.fixture
def prompt_set(tiny_model) -> PromptSet:
    prompts = [Prompt(p.text) for p in split_prompts("train")[:8]]
    return PromptSet(prompts, tiny_model.family.tokenize)


def engine(model, **kw) -> RolloutEngine:
    cfg = RolloutConfig(**{"group_size": 3, "num_steps": 3, **kw})
    return RolloutEngine(model, cfg, [], torch.device("cpu"))


def gen(eng, prompts, seed=0, **kw):
    return asyncio.run(eng.generate(prompts, seed, **kw))


def test_sample_seeds_and_noise() -> None:
    a, b = sample_seeds(7, 6), sample_seeds(7, 6)
    assert torch.equal(a, b) and len(set(a.tolist())) == 6
    assert not torch.equal(a, sample_seeds(8, 6))
    n = noise_from_seeds(a, (2, 3), "cpu")
    assert n.shape == (6, 2, 3)
    torch.testing.assert_close(noise_from_seeds(a[3:4], (2, 3), "cpu")[0], n[3])  # row-wise


def test_group_layout(tiny_model, prompt_set) -> None:
    prompts = prompt_set.batch([5, 2])
    traj = gen(
        engine(
            tiny_model,
        ),
        prompts,
        seed=1,
    )
    assert len(traj) == 6
    assert traj.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert traj.prompts.texts == (prompt_set.texts[5],) * 3 + (prompt_set.texts[2],) * 3
    assert traj.prompts.prompt_ids.tolist() == [5, 5, 5, 2, 2, 2]
    torch.testing.assert_close(traj.prompts.input_ids[:3], prompt_set.input_ids[[5, 5, 5]])
    assert traj.prompts.ids_hash[3] == prompt_set.hashes[2]
    assert len(set(traj.seeds.tolist())) == 6
    assert traj.seeds.tolist() == sample_seeds(1, 6).tolist()
    assert traj.x0.shape == (6, 3, 32, 32)
    torch.testing.assert_close(traj.sigmas, sigma_schedule(3))
    assert traj.policy_version == 0


def test_ode_matches_manual_euler_integration(tiny_model, prompt_set) -> None:
    prompts = prompt_set.batch([0, 1])
    traj = gen(engine(tiny_model, keep_latents=True), prompts, seed=3)
    noise = noise_from_seeds(traj.seeds, (4, 3, 32, 32), "cpu")
    x, ids = noise[:, 0], prompts.repeat(3).input_ids
    sig = torch.tensor([1.0, 2 / 3, 1 / 3, 0.0])
    with torch.no_grad():
        for i in range(3):
            x = x + tiny_model(x, sig[i].expand(6), ids) * (sig[i + 1] - sig[i])
    torch.testing.assert_close(traj.x0, x, rtol=0, atol=1e-5)
    assert traj.latents.shape == (6, 4, 3, 32, 32)
    torch.testing.assert_close(traj.latents[:, 0], noise[:, 0])
    torch.testing.assert_close(traj.latents[:, -1], traj.x0)
    assert traj.x0.abs().max() > 0.1  # the tiny model is not trivial
    assert not torch.allclose(traj.x0, noise[:, 0], atol=1e-3)


def test_generate_is_deterministic_per_seed(tiny_model, prompt_set) -> None:
    eng = engine(
        tiny_model,
    )
    prompts = prompt_set.batch([0, 3])
    a, b, c = gen(eng, prompts, 11), gen(eng, prompts, 11), gen(eng, prompts, 12)
    assert torch.equal(a.x0, b.x0)
    assert (a.x0 - c.x0).abs().max() > 1e-2


@pytest.mark.parametrize("sampler", ["ode", "sde"])
def test_batching_invariance(tiny_model, prompt_set, sampler) -> None:
    prompts = prompt_set.batch([0, 1, 2, 3, 4])
    big = gen(engine(tiny_model, max_batch=64, group_size=2, sampler=sampler), prompts, 5)
    small = gen(engine(tiny_model, max_batch=4, group_size=2, sampler=sampler), prompts, 5)
    assert torch.equal(big.seeds, small.seeds)
    assert torch.equal(big.group, small.group)
    assert big.prompts.texts == small.prompts.texts
    torch.testing.assert_close(small.x0, big.x0, rtol=0, atol=1e-5)
    torch.testing.assert_close(small.log_probs, big.log_probs, rtol=0, atol=1e-5)


def test_stream_yields_micro_batches_of_whole_groups(tiny_model, prompt_set) -> None:
    eng = engine(tiny_model, max_batch=4, group_size=2)  # 2 prompts per micro-batch
    prompts = prompt_set.batch([0, 1, 2, 3, 4])
    parts = stream_parts(eng, prompts, 9)
    assert [len(p) for p in parts] == [4, 4, 2]
    assert [p.group.tolist() for p in parts] == [[0, 0, 1, 1], [2, 2, 3, 3], [4, 4]]
    whole = gen(eng, prompts, 9)
    torch.testing.assert_close(torch.cat([p.x0 for p in parts]), whole.x0)


def test_ode_log_probs_are_zero(tiny_model, prompt_set) -> None:
    traj = gen(engine(tiny_model, num_steps=4), prompt_set.batch([0]), 0)
    assert traj.log_probs.shape == (3, 4)
    assert torch.equal(traj.log_probs, torch.zeros(3, 4))


def test_sde_log_probs_finite_nonzero(tiny_model, prompt_set) -> None:
    eng = engine(tiny_model, num_steps=4, sampler="sde")
    traj = gen(eng, prompt_set.batch([0, 1]), 0)
    assert traj.log_probs.shape == (6, 4)
    assert torch.isfinite(traj.log_probs).all()
    assert (traj.log_probs[:, :-1] != 0).all()
    assert (traj.log_probs[:, -1] == 0).all()  # the last step to sigma=0 is deterministic
    ode = gen(engine(tiny_model, num_steps=4), prompt_set.batch([0, 1]), 0)
    assert (traj.x0 - ode.x0).abs().max() > 1e-2
    again = gen(eng, prompt_set.batch([0, 1]), 0)
    assert torch.equal(traj.x0, again.x0) and torch.equal(traj.log_probs, again.log_probs)


def test_per_call_overrides(tiny_model, prompt_set) -> None:
    eng = engine(tiny_model, sampler="sde")
    traj = gen(eng, prompt_set.batch([0, 1]), 0, group_size=2, sampler="ode", num_steps=2)
    assert len(traj) == 4 and traj.sigmas.shape == (3,)
    assert torch.equal(traj.log_probs, torch.zeros(4, 2))


def test_image_field_is_uint8_hwc(tiny_model, prompt_set) -> None:
    eng = engine(
        tiny_model,
    )
    traj = gen(eng, prompt_set.batch([0, 1]), 0)
    assert set(traj.extra_fields) == eng.produces  # what the scorers' start-up check relies on
    img = traj.extra_fields["image"]
    assert img.dtype == torch.uint8 and img.shape == (6, 32, 32, 3)
    assert torch.equal(img, images_to_uint8(traj.x0))
    # independent conversion of one pixel: [-1, 1] -> [0, 255], channels last
    val = traj.x0[2, 1, 7, 9].clamp(-1, 1).item()
    assert img[2, 7, 9, 1].item() == round((val + 1) * 127.5)


def test_classifier_free_guidance(tiny_model, tok, prompt_set) -> None:
    eng = engine(tiny_model, cfg_scale=3.0)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sigma, ids = torch.full((2,), 0.5), prompt_set.input_ids[:2]
    null = torch.zeros_like(ids)
    null[:, 0] = tok.null_id
    with torch.no_grad():
        v_c, v_u = tiny_model(x, sigma, ids), tiny_model(x, sigma, null)
        out = eng.velocity(x, sigma, ids)
    torch.testing.assert_close(out, v_u + 3.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)
    assert (out - v_c).abs().max() > 1e-4


def test_engine_owns_a_frozen_copy(tiny_model) -> None:
    eng = engine(
        tiny_model,
    )
    assert eng.model is not tiny_model
    assert not any(p.requires_grad for p in eng.model.parameters())
    with torch.no_grad():
        next(tiny_model.parameters()).add_(1.0)
    assert not torch.equal(next(tiny_model.parameters()), next(eng.model.parameters()))


def test_stale_weight_version_raises(tiny_model) -> None:
    eng = engine(
        tiny_model,
    )
    eng.load_weights(WeightUpdate.build(3, "old", {}))
    assert eng.version == 3
    with pytest.raises(SyncError, match="stale"):
        eng.load_weights(WeightUpdate.build(2, "old", {}))
    assert eng.version == 3


def test_shared_initial_noise_within_groups(tiny_model, prompt_set) -> None:
    kw = dict(sampler="sde", keep_latents=True, group_size=3)
    shared = gen(engine(tiny_model, shared_init_noise=True, **kw), prompt_set.batch([0, 1]))
    start = shared.latents[:, 0]
    assert torch.equal(start[0], start[1]) and torch.equal(start[0], start[2])
    assert not torch.equal(start[0], start[3])
    assert not torch.equal(shared.x0[0], shared.x0[1])  # SDE noise still differs per sample
    own = gen(engine(tiny_model, **kw), prompt_set.batch([0, 1]))
    assert torch.equal(own.latents[0, 0], start[0]) and not torch.equal(own.latents[1, 0], start[1])


def test_trajectory_records_how_it_was_sampled(tiny_model, tok, prompt_set) -> None:
    eng = engine(
        tiny_model,
        sampler="sde",
        num_steps=5,
        sde_window=2,
        sde_window_mode="sliding",
        sde_step="cps",
        noise_level=0.4,
        cfg_scale=1.5,
    )
    t0 = gen(eng, prompt_set.batch([0]), iteration=0)
    t1 = gen(eng, prompt_set.batch([0]), iteration=1)
    assert t0.sde_mask.tolist() == [True, True, False, False, False]
    assert t1.sde_mask.tolist() == [False, True, True, False, False]  # slid by one step
    assert (t1.log_probs[:, 0] == 0).all() and (t1.log_probs[:, 1:3] != 0).all()
    assert t0.step_spec.kind == "cps" and t0.step_spec.noise_level == 0.4
    assert t0.step_spec.cfg_scale == 1.5
    assert t0.step_spec.null_ids == (tok.null_id,) + (tok.pad_id,) * (tok.max_len - 1)
    ode = gen(
        engine(
            tiny_model,
        ),
        prompt_set.batch([0]),
    )
    assert not ode.sde_mask.any()


def test_shared_prefix_runs_once_per_group(tiny_model, prompt_set) -> None:
    kw = dict(sampler="sde", keep_latents=True, group_size=3, num_steps=5, sde_window=1)
    kw.update(sde_window_mode="fixed", sde_window_start=2)
    eng = engine(tiny_model, shared_init_noise=True, **kw)
    sizes, velocity = [], eng.velocity
    eng.velocity = lambda x, s, ids, c=None: sizes.append(len(x)) or velocity(x, s, ids, c)
    traj = gen(eng, prompt_set.batch([0, 1]))
    assert sizes == [2, 2, 2, 6, 6]  # steps 0-2 (x still shared) once per group, then per sample
    lat = traj.latents
    assert torch.equal(lat[0, :3], lat[2, :3]) and not torch.equal(lat[0, 3], lat[1, 3])
    own = engine(tiny_model, **kw)  # the same Euler prefix, one forward per sample
    own_traj = gen(own, prompt_set.batch([0, 1]))
    torch.testing.assert_close(lat[0, :3], own_traj.latents[0, :3])  # member 0 = own noise


def test_tree_noise_branches_each_group_in_two_per_window_step(tiny_model, prompt_set) -> None:
    kw = dict(sampler="sde", keep_latents=True, group_size=8, num_steps=6, sde_window=3)
    kw.update(sde_window_start=1, shared_init_noise=True)
    eng = engine(tiny_model, tree_noise=True, **kw)
    sizes, velocity = [], eng.velocity
    eng.velocity = lambda x, s, ids, c=None: sizes.append(len(x)) or velocity(x, s, ids, c)
    traj = gen(eng, prompt_set.batch([0, 1]))
    # steps 0-1 once per group, step 2 once per half-group, step 3 per quarter, then per sample
    assert sizes == [2, 2, 4, 8, 16, 16]
    lat = traj.latents
    for step, runs in ((2, 4), (3, 2), (4, 1)):  # after SDE steps 1, 2, 3: copies in runs
        distinct = {tuple(lat[m, step].flatten()[:4].tolist()) for m in range(8)}
        assert len(distinct) == 8 // runs
        for m in range(0, 8, runs):
            assert all(torch.equal(lat[m, step], lat[m + r, step]) for r in range(runs))
    # every member is still an honest draw of the SDE: its recorded log-probs are its own
    plain = gen(engine(tiny_model, **kw), prompt_set.batch([0, 1]))
    torch.testing.assert_close(lat[0], plain.latents[0])  # member 0 keeps its own noise
    assert not torch.equal(lat[1, 2], plain.latents[1, 2])  # member 1 takes member 0's
    with pytest.raises(FieldError, match="group_size"):
        RolloutConfig(tree_noise=True, **{**kw, "group_size": 6}).validate()
    with pytest.raises(FieldError, match="tree_noise"):
        RolloutConfig(tree_noise=True, sampler="sde", sde_window=1).validate()
    with pytest.raises(FieldError, match="tree_noise"):
        RolloutConfig(tree_noise=True, antithetic_noise=True, **kw).validate()


def test_antithetic_noise_mirrors_pairs(tiny_model, prompt_set) -> None:
    kw = dict(sampler="sde", keep_latents=True, group_size=4, num_steps=3, shared_init_noise=True)
    traj = gen(engine(tiny_model, antithetic_noise=True, **kw), prompt_set.batch([0]))
    x1 = traj.latents[:, 1]  # after the first SDE step from the shared start: mu +- std * eps
    assert not torch.equal(x1[0], x1[1])
    torch.testing.assert_close(x1[0] + x1[1], x1[2] + x1[3])  # both pairs straddle the same mu
    plain = gen(engine(tiny_model, **kw), prompt_set.batch([0]))
    torch.testing.assert_close(plain.latents[0], traj.latents[0])  # even members unchanged
    # a call with odd groups of 3: members (0, 1) and (3, 4) are pairs; 2 and 5 keep their noise
    mirrored, own = (
        gen(
            engine(tiny_model, antithetic_noise=a, **kw),
            prompt_set.batch([0, 1]),
            group_size=3,
        )
        for a in (True, False)
    )
    y, z = mirrored.latents[:, 1], own.latents[:, 1]
    torch.testing.assert_close(y[[0, 2, 3, 5]], z[[0, 2, 3, 5]])
    assert not torch.allclose(y[[1, 4]], z[[1, 4]])
    with pytest.raises(FieldError, match="group_size"):
        RolloutConfig(group_size=3, antithetic_noise=True).validate()


def test_coarse_ode_tail(tiny_model, prompt_set) -> None:
    kw = dict(sampler="sde", keep_latents=True, group_size=2, num_steps=6, sde_window=1)
    kw.update(sde_window_start=1)
    coarse = gen(engine(tiny_model, ode_tail_steps=2, **kw), prompt_set.batch([0, 1]))
    full = gen(engine(tiny_model, **kw), prompt_set.batch([0, 1]))
    assert coarse.sde_mask.tolist() == [False, True, False, False]
    assert coarse.latents.shape[1] == len(coarse.sigmas) == 5 and coarse.log_probs.shape[1] == 4
    # the same path up to where the window lands (same seeds), then 2 Euler steps instead of 4
    torch.testing.assert_close(coarse.latents[:, :3], full.latents[:, :3])
    torch.testing.assert_close(coarse.log_probs[:, 1], full.log_probs[:, 1])
    torch.testing.assert_close(coarse.sigmas, torch.tensor([1.0, 5 / 6, 4 / 6, 2 / 6, 0.0]))
    x, sig = coarse.latents[:, 2], coarse.sigmas
    for i in (2, 3):
        v = tiny_model(x, sig[i].expand(len(x)), coarse.prompts.input_ids)
        x = x + v * (sig[i + 1] - sig[i])
    torch.testing.assert_close(coarse.x0, x, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(coarse.x0, full.x0)
    ode = gen(engine(tiny_model, ode_tail_steps=2, **kw), prompt_set.batch([0]), sampler="ode")
    assert len(ode.sigmas) == 7  # no SDE step (the held-out eval): the full grid
    with pytest.raises(FieldError, match="ode_tail_steps"):
        RolloutConfig(sampler="sde", ode_tail_steps=3).validate()  # no window to follow
    with pytest.raises(FieldError, match="ode_tail_steps"):
        RolloutConfig(ode_tail_steps=-1).validate()
    with pytest.raises(FieldError, match="changes nothing"):  # 7 ODE steps follow a window at 2
        RolloutConfig(
            sampler="sde", num_steps=10, sde_window=1, sde_window_start=2, ode_tail_steps=7
        ).validate()
    RolloutConfig(
        sampler="sde", num_steps=10, sde_window=1, sde_window_start=2, ode_tail_steps=6
    ).validate()


def test_sampling_with_drifted_ids_raises(tiny_model, prompt_set) -> None:
    """Contract 3: the ids the rollout samples with must hash to the PromptSet's hashes; a
    prompt re-tokenised on its way here (one id changed, the data stage's hashes kept) stops
    the rollout before any sample, naming the engine and the (repeated) rows."""
    prompts = prompt_set.batch([5, 2])
    ids = prompts.input_ids.clone()
    ids[1, 0] += 1
    drifted = dataclasses.replace(prompts, input_ids=ids)
    message = r"token drift at the rollout engine: input_ids of rows \[3, 4, 5\]"
    with pytest.raises(ContractError, match=message):
        gen(engine(tiny_model), drifted)
    gen(engine(tiny_model), prompts)  # the data stage's ids pass
