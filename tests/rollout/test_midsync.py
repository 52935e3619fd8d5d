"""Rollouts that survive a weight sync (``run.async_sync=step``): an update offered mid-rollout
is applied at the next denoising-step boundary, the steps before it are those of a run without
the sync and the steps after it those of a run that switches weights there; each step records
its version; FlowGRPO weighs the older steps by truncated importance sampling."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_actor, make_tiny_model

from diffrl.algorithms import flow_grpo
from diffrl.algorithms.registry import WeightPlan, get_algorithm
from diffrl.config import load_config
from diffrl.controller.async_ import Clock, publish
from diffrl.controller.midsync import bound_version, check_midsync, step_staleness
from diffrl.errors import ConfigError
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.rollout.samplers import noise_from_seeds, sigma_schedule
from diffrl.sync.weights import SyncError
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.tokenizer import WordTokenizer, hash_ids
from diffrl.types import PromptBatch, StepSpec, TrainBatch, Trajectory

CPU = torch.device("cpu")
ASYNC_STEP = ["run.mode=async", "run.async_sync=step"]
STEPS, NOISE = 4, 0.7
CFG = RolloutConfig(sampler="sde", num_steps=STEPS, noise_level=NOISE, keep_latents=True)


@pytest.fixture
def setup(tiny_model, actor_factory, train_batch_factory, lora_names):
    """(rollout at v0, the update v1 of an actor trained one step, ids, seeds, sigmas, mask)."""
    base, names = copy.deepcopy(tiny_model), lora_names(tiny_model)  # before the actor wraps it

    def fresh() -> RolloutEngine:
        return RolloutEngine(copy.deepcopy(base), CFG, names, CPU)

    rollout = fresh()
    rollout.fresh = fresh  # type: ignore[attr-defined]
    actor = actor_factory(tiny_model, lr=5e-2)
    batch = train_batch_factory(4, seed=1)
    actor.train_step(batch)
    assert actor.version == 1
    sigmas = sigma_schedule(STEPS, CFG.shift)
    mask = rollout.sde_mask("sde", STEPS, 0, 0)
    return rollout, actor, batch.input_ids, torch.arange(4) + 11, sigmas, mask


def offer_before_step(engine: RolloutEngine, k: int, update) -> None:
    """Make ``update`` arrive while step k - 1 runs: offered just before boundary k."""
    inner, calls = engine._apply_offered, [0]

    def apply_offered() -> None:
        if calls[0] == k:
            engine.offer(update)
        calls[0] += 1
        inner()

    engine._apply_offered = apply_offered  # type: ignore[method-assign]


@torch.no_grad()
def manual_run(engines, switch: int, ids, seeds, sigmas, mask):
    """Independent sampler: engine 0's weights before step ``switch``, engine 1's from it."""
    shape = tuple(engines[0].family.latent_shape())
    noise = noise_from_seeds(seeds, (STEPS + 1, *shape), CPU)
    x, xs, lps = noise[:, 0], [noise[:, 0]], []
    cap = float(sigmas[1])
    for i in range(STEPS):
        s, s_next = sigmas[i], sigmas[i + 1]
        v = engines[int(i >= switch)].model(x, s.expand(len(x)), ids)
        if mask[i]:
            safe = cap if s >= 1 else float(s)
            a = NOISE * math.sqrt(safe / (1 - safe))
            mean = x + (v + a**2 / (2 * s) * (x + (1 - s) * v)) * (s_next - s)
            std = a * math.sqrt(s - s_next)
            x = mean + std * noise[:, i + 1]
            lps.append(hand_logp(x, mean, std))
        else:
            x = x + (s_next - s) * v
            lps.append(torch.zeros(len(x)))
        xs.append(x)
    return torch.stack(xs, 1), torch.stack(lps, 1)


def hand_logp(x, mean, std) -> torch.Tensor:
    lp = -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def test_sync_mid_rollout_resumes_at_the_step_boundary(setup) -> None:
    rollout, actor, ids, seeds, sigmas, mask = setup
    k = 2
    plain = rollout.fresh()
    _, lat_plain, lp_plain, v_plain = plain._sample(ids, seeds, sigmas, mask, 1)
    assert v_plain == [0] * STEPS

    offer_before_step(rollout, k, actor.export_weights("default"))
    _, lat, lp, versions = rollout._sample(ids, seeds, sigmas, mask, 1)
    assert versions == [0] * k + [1] * (STEPS - k) and rollout.version == 1
    assert rollout.take_synced()["sync/receipt_frac"] >= 0  # verified, and reported once
    assert rollout.take_synced() == {}
    # up to the boundary: the run without a sync, bit for bit
    assert torch.equal(lat[:, : k + 1], lat_plain[:, : k + 1])
    assert torch.equal(lp[:, :k], lp_plain[:, :k])
    assert not torch.allclose(lat[:, k + 1 :], lat_plain[:, k + 1 :])  # the new weights count
    # after it: an independent run that switches weights at step k
    switched = rollout.fresh()
    switched.load_weights(actor.export_weights("default"))
    lat_hand, lp_hand = manual_run((plain, switched), k, ids, seeds, sigmas, mask)
    torch.testing.assert_close(lat, lat_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, lp_hand, rtol=1e-5, atol=1e-5)


def test_load_supersedes_an_older_offer(setup) -> None:
    rollout, actor, *_ = setup
    update = actor.export_weights("default")
    rollout.offer(update)
    rollout.load_weights(update)  # e.g. the actor synced it itself between batches
    rollout._apply_offered()  # nothing left: a second load of v1 would be refused as stale
    assert rollout.version == 1 and rollout.take_synced() == {}
    shared = RolloutEngine(rollout.model, CFG, [], CPU, serving_layout=False, share_model=True)
    with pytest.raises(SyncError, match="run.async_sync=batch"):
        shared.offer(update)


def test_trajectory_records_step_versions_and_joins_micro_batches(setup) -> None:
    rollout, actor, *_ = setup
    texts = tuple(p.text for p in split_prompts("train")[:2])
    pids = WordTokenizer().encode(list(texts))
    prompts = PromptBatch(texts, pids, tuple(hash_ids(pids)), torch.arange(2), None, None)
    rollout.cfg = dataclasses.replace(CFG, group_size=2, max_batch=2)  # 2 micro-batches
    offer_before_step(rollout, 2, actor.export_weights("default"))  # micro-batch 1, step 2
    traj = asyncio.run(rollout.generate(prompts, seed=3))  # the micro-batches joined
    assert traj.step_versions.tolist() == [[0, 0, 1, 1]] * 2 + [[1] * STEPS] * 2
    assert traj.policy_version == 0  # the oldest
    assert bound_version(traj, per_step=True) == 0 and bound_version(traj, per_step=False) == 1
    assert step_staleness(traj, 1) == pytest.approx(4 / 16)


def test_bound_version_rules() -> None:
    versions = torch.tensor([[3, 3, 4, 4], [3, 4, 4, 4]])
    traj = Trajectory(
        prompts=None,  # type: ignore[arg-type]
        group=torch.zeros(2),
        seeds=torch.zeros(2),
        x0=torch.zeros(2, 1),
        policy_version=3,
        sde_mask=torch.tensor([True, True, True, False]),
        step_versions=versions,
    )
    assert bound_version(traj, per_step=True) == 3  # the oldest SDE step
    assert bound_version(traj, per_step=False) == 4  # the final step, which x0 comes from
    window = dataclasses.replace(
        traj,
        sde_mask=torch.tensor([False, True, True, False]),
        step_versions=torch.tensor([[3, 5, 5, 5], [4, 5, 5, 5]]),
    )
    assert bound_version(window, per_step=True) == 5  # only the window's steps are trained
    assert step_staleness(traj, 4) == pytest.approx(3 / 8)
    assert bound_version(dataclasses.replace(traj, step_versions=None), True) == 3


def grpo_batch(rollout, actor, ids, seeds, sigmas, mask, versions, adv):
    _, lat, lp, _ = rollout._sample(ids, seeds, sigmas, mask, 1)
    return TrainBatch(
        input_ids=ids,
        ids_hash=tuple(hash_ids(ids)),
        x0=lat[:, -1],
        seeds=seeds,
        advantages=adv,
        latents=lat,
        log_probs=lp,
        sigmas=sigmas,
        sde_mask=mask,
        step_spec=StepSpec("flow_grpo", NOISE, 1.0, rollout.null_ids, shares_inputs=False),
        step_versions=versions,
        prox_version=1,
    )


def test_flow_grpo_truncated_is_weights_match_independent_math(setup) -> None:
    rollout, _, ids, seeds, sigmas, mask = setup
    cap = 1.0  # the smallest cap: every step whose ratio is above 1 is truncated
    cfg = flow_grpo.GRPOConfig(
        kl_coef=0.0, timestep_fraction=1.0, timestep_order="ordered", tis_cap=cap, clip_range=0.2
    )
    with torch.random.fork_rng():  # the LoRA init draws from the global RNG: fixed here
        torch.manual_seed(0)
        actor = make_actor(make_tiny_model(0), algorithm=get_algorithm("flow_grpo"), algo_cfg=cfg)
    with torch.no_grad():  # the actor's policy (pi_prox) moved off the rollout's v0 weights
        g = torch.Generator().manual_seed(5)
        for layer in actor.layers.values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    # rows 0-1: a sync before step 2 (steps 0, 1 by v0, behind); rows 2-3: every step current
    versions = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    batch = grpo_batch(rollout, actor, ids, seeds, sigmas, mask, versions, adv)
    total, m = flow_grpo.loss(actor, batch, cfg, torch.Generator().manual_seed(0))

    # independent math: pi_prox's log-probs by hand from the actor's velocity, mu the rollout's
    trained = mask.nonzero().flatten().tolist()
    ws, objs, truncated, kept = [], [], 0, 0
    with torch.no_grad():
        for j in trained:
            x, x_next, s, s_next = (
                batch.latents[:, j],
                batch.latents[:, j + 1],
                sigmas[j],
                sigmas[j + 1],
            )
            v = actor.velocity(x, s.expand(4), ids)
            safe = float(sigmas[1]) if s >= 1 else float(s)
            a = NOISE * math.sqrt(safe / (1 - safe))
            mean = x + (v + a**2 / (2 * s) * (x + (1 - s) * v)) * (s_next - s)
            lp = hand_logp(x_next, mean, a * math.sqrt(s - s_next))
            ratio = torch.exp(lp - batch.log_probs[:, j])
            behind = versions[:, j] < 1
            w = torch.where(behind, ratio.clamp(max=cap), torch.ones(4))
            truncated += int((behind & (ratio > cap)).sum())
            kept += int((behind & (ratio < cap)).sum())
            # behind: the PPO ratio anchors on pi_prox (1 in value); current: on mu
            rho = torch.where(behind, torch.ones(4), ratio)
            clipped = torch.maximum(-adv * rho, -adv * rho.clamp(0.8, 1.2))
            ws.append(w)
            objs.append((w * clipped).mean())
    assert truncated and kept  # the cap both bit and did not: the check can tell
    w_all = torch.stack(ws)
    torch.testing.assert_close(m["grpo/tis_weight_mean"], w_all.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["grpo/tis_weight_max"], w_all.max(), rtol=1e-5, atol=1e-6)
    stale = (versions[:, trained] < 1).float().mean()
    torch.testing.assert_close(m["grpo/tis_stale_frac"], stale)
    torch.testing.assert_close(total, torch.stack(objs).mean(), rtol=1e-5, atol=1e-6)

    # every step current (staleness 0): the plain loss, bit for bit
    fresh = dataclasses.replace(batch, step_versions=torch.ones_like(versions))
    plain = dataclasses.replace(batch, prox_version=None, step_versions=None)
    t_fresh, m_fresh = flow_grpo.loss(actor, fresh, cfg, torch.Generator().manual_seed(0))
    t_plain, _ = flow_grpo.loss(actor, plain, cfg, torch.Generator().manual_seed(0))
    assert torch.equal(t_fresh, t_plain) and float(m_fresh["grpo/tis_weight_mean"]) == 1.0


@pytest.mark.parametrize(
    ("recipe", "overrides", "says"),
    [
        ("shapes_nft", ["run.async_sync=sometimes"], "'run.async_sync'"),
        ("shapes_nft", ["run.async_sync=step", "run.async_weights=fixed"], "'run.async_weights'"),
        ("shapes_grpo", [*ASYNC_STEP, "actor.minibatches=2"], "'actor.minibatches' = 2"),
        ("shapes_grpo", ["algorithm.tis_cap=0.5"], "tis_cap"),
        ("shapes_grpo", ["algorithm.tis_cap=inf"], "tis_cap"),
    ],
)
def test_midsync_config_errors(recipe, overrides, says) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(f"recipes/{recipe}.yaml", overrides)


def test_midsync_config_accepts() -> None:
    cfg = load_config("recipes/shapes_grpo.yaml", ASYNC_STEP)
    assert (cfg.run.async_sync, cfg.algorithm.tis_cap) == ("step", 2.0)
    # NFT has no truncated importance weights: its minibatches are not constrained
    nft = load_config("recipes/shapes_nft.yaml", [*ASYNC_STEP, "actor.minibatches=2"])
    assert nft.actor.minibatches == 2
    assert load_config("recipes/shapes_nft.yaml").run.async_sync == "batch"


@pytest.mark.parametrize("midsync", [True, False])
def test_publish_offers_to_a_busy_rollout_only_with_step(midsync) -> None:
    """``publish`` after an update while the rollout samples: with async_sync=step the update
    is offered (applied at the rollout's next step boundary), else left pending to the batch
    end, as before."""
    offered: list[int] = []
    update = SimpleNamespace(version=7)
    parts = SimpleNamespace(
        cfg=SimpleNamespace(algorithm=None),
        algorithm=SimpleNamespace(weight_plan=lambda step, cfg: WeightPlan("default")),
        actor=SimpleNamespace(version=7, export_weights=lambda adapter: update),
        rollout=SimpleNamespace(offer=lambda u: offered.append(u.version)),
    )
    clock = Clock(updates=6, version=6, max_staleness=1, steps=10, rollout_busy=True)
    clock.midsync = midsync
    assert asyncio.run(publish(parts, clock, 7)) == {}
    assert (clock.updates, clock.version) == (7, 7)
    assert offered == ([7] if midsync else [])
    assert clock.pending is (None if midsync else update)


def test_check_midsync_refuses_what_cannot_take_an_offer(setup) -> None:
    rollout = setup[0]
    step = load_config("recipes/shapes_nft.yaml", ASYNC_STEP)
    check_midsync(step, rollout, fixed=False)  # a local engine with its own copy: fine
    check_midsync(load_config("recipes/shapes_nft.yaml"), object(), fixed=True)  # batch: no rule
    with pytest.raises(ConfigError, match="as fixed"):  # auto under torchrun
        check_midsync(step, rollout, fixed=True)
    with pytest.raises(ConfigError, match=r"rollout \(object\) takes no weights"):
        check_midsync(step, object(), fixed=False)
    shared = RolloutEngine(rollout.model, CFG, [], CPU, serving_layout=False, share_model=True)
    with pytest.raises(ConfigError, match="shared or TP-sharded"):
        check_midsync(step, shared, fixed=False)
