"""FlowGRPO: the clipped objective, step selection, and rollout/training log-prob parity."""

import asyncio
from dataclasses import replace

import pytest
import torch

from diffrl.actor.engine import host_floats
from diffrl.algorithms.flow_grpo import (
    GRPOConfig,
    clipped_objective,
    consistency,
    loss,
    prepare,
    shared_rows,
    train_steps,
)
from diffrl.algorithms.registry import get_algorithm
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.rollout.samplers import sde_step_with_logprob, sigma_schedule
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.types import ScoredBatch, StepSpec, TrainBatch


def test_clipped_objective_gradient_vanishes_outside_clip_range():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    # positive advantage above 1+eps and negative advantage below 1-eps: clipped, no gradient
    ratio = torch.tensor([1.5, 0.9, 0.5, 1.1], requires_grad=True)
    clipped_objective(ratio, adv, 0.2).sum().backward()
    assert ratio.grad[0] == 0 and ratio.grad[2] == 0
    # inside the range the surrogate is -A * rho: gradient -A
    assert ratio.grad[1] == -1.0 and ratio.grad[3] == 1.0


def test_train_steps_fraction_and_order():
    gen = torch.Generator().manual_seed(0)
    cfg = GRPOConfig(timestep_fraction=0.5)
    idx = train_steps(torch.arange(8), 3, cfg, gen)
    assert idx.shape == (3, 4)
    assert all(len(set(row.tolist())) == 4 for row in idx)  # distinct steps per sample
    assert len({tuple(row.tolist()) for row in idx}) > 1  # drawn per sample
    assert torch.equal(idx, idx.sort(1).values)  # each in step order (shared inputs line up)
    ordered = GRPOConfig(timestep_fraction=0.5, timestep_order="ordered")
    assert train_steps(torch.arange(8), 2, ordered, gen).tolist() == [[0, 1, 2, 3]] * 2
    # an SDE window: only its steps are ever trained
    window = torch.tensor([3, 4, 5])
    idx = train_steps(window, 50, GRPOConfig(timestep_fraction=1.0), gen)
    assert idx.tolist() == [[3, 4, 5]] * 50  # all of them: the same order for every sample
    assert train_steps(window, 1, ordered, gen).tolist() == [[3, 4]]


class LinearPolicy:
    """v = w * x, with w trainable: enough to exercise the loss end to end."""

    def __init__(self, w: float) -> None:
        self.w = torch.tensor(w, requires_grad=True)

    def velocity(self, x, sigma, ids, adapter="default", cond=None):
        return (self.w if adapter is not None else torch.tensor(0.5)) * x


def _rollout(policy: LinearPolicy, n: int = 4, steps: int = 5, a: float = 0.7):
    """Sample a trajectory with the same step function the engine uses."""
    g = torch.Generator().manual_seed(1)
    sig = sigma_schedule(steps)
    x = torch.randn(n, 3, 4, 4, generator=g)
    lat, lps = [x], []
    with torch.no_grad():
        for i in range(steps):
            v = policy.velocity(x, sig[i], None)
            x, lp, _, _ = sde_step_with_logprob(
                x, v, sig[i], sig[i + 1], a, float(sig[1]), noise=torch.randn(x.shape, generator=g)
            )
            lat.append(x)
            lps.append(lp)
    return sig, torch.stack(lat, 1), torch.stack(lps, 1)


def _rollout_batch(policy: LinearPolicy, advantages: torch.Tensor) -> TrainBatch:
    """A FlowGRPO batch of 4 trajectories sampled by ``policy``, every step stochastic."""
    sig, lat, lps = _rollout(policy)
    n = lat.shape[0]
    return TrainBatch(
        input_ids=torch.zeros(n, 2, dtype=torch.long),
        ids_hash=("",) * n,
        x0=lat[:, -1],
        advantages=advantages,
        seeds=torch.zeros(n, dtype=torch.long),
        latents=lat,
        log_probs=lps,
        sigmas=sig,
        sde_mask=torch.ones(lps.shape[1], dtype=torch.bool),
        step_spec=StepSpec("flow_grpo", 0.7, 1.0, (1, 0)),
    )


def test_same_weights_give_ratio_one_and_zero_loss_gradient_sign():
    policy = LinearPolicy(0.9)
    batch = _rollout_batch(policy, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    cfg = GRPOConfig(timestep_fraction=1.0, kl_coef=0.0, clip_range=0.2)
    value, metrics = loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["grpo/ratio_dev"] < 1e-5  # rollout and training log-probs agree
    # at ratio 1 the surrogate is -mean(A) = -0.0 here
    assert abs(float(value.detach()) - float(-batch.advantages.mean())) < 1e-5


def test_kl_term_is_zero_against_itself_and_positive_otherwise():
    policy = LinearPolicy(0.5)  # the "reference" in LinearPolicy is w=0.5 as well
    batch = _rollout_batch(policy, torch.zeros(4))
    cfg = GRPOConfig(timestep_fraction=1.0, kl_coef=1.0)
    _, m = loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    assert m["grpo/kl"] < 1e-10
    _, m = loss(LinearPolicy(0.8), batch, cfg, torch.Generator().manual_seed(0))
    assert m["grpo/kl"] > 1e-4


def _engine_batch(model, rollout: RolloutConfig, rewards=None):
    """A real SDE rollout of 3 prompts x 4, prepared for FlowGRPO."""
    engine = RolloutEngine(model, rollout, [], torch.device("cpu"))
    texts = [Prompt(p.text) for p in split_prompts("train")[:3]]
    prompts = PromptSet(texts, model.family.tokenize).all()
    traj = asyncio.run(engine.generate(prompts, seed=5, iteration=0))
    n = len(traj)
    rewards = torch.linspace(0, 1, n) if rewards is None else rewards
    scored = ScoredBatch(traj, rewards, {"r": rewards}, torch.ones(n, dtype=torch.bool))
    return traj, prepare(scored, GRPOConfig())


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"sde_step": "cps", "noise_level": 0.5},
        {"cfg_scale": 2.5, "sde_window": 3, "sde_window_start": 2},
        {"sde_window": 1, "sde_window_start": 1, "ode_tail_steps": 2, "shared_init_noise": True},
        {"sde_window": 2, "sde_window_start": 1, "ode_dtype": "bfloat16"},
    ],
    ids=["flow_grpo", "cps", "cfg+window", "branch+coarse_tail", "window+bf16_ode"],
)
def test_rollout_and_training_log_probs_agree(tiny_model, actor_factory, kw) -> None:
    """The consistency metric: training recomputes the rollout's log-probs exactly (fp32)."""
    rollout = RolloutConfig(group_size=4, num_steps=6, sampler="sde", keep_latents=True, **kw)
    actor = actor_factory(tiny_model, algorithm=get_algorithm("flow_grpo"), algo_cfg=GRPOConfig())
    traj, batch = _engine_batch(tiny_model, rollout)
    if rollout.ode_tail_steps:  # steps 0-1 as sampled, then 2 tail steps instead of 4
        assert len(traj.sigmas) == 5 and traj.latents.shape[1] == 5
    if rollout.ode_dtype == "bfloat16":  # the ODE steps ran in bf16: close to fp32, not equal
        fp32 = _engine_batch(tiny_model, replace(rollout, ode_dtype="float32"))[0]
        assert not torch.equal(traj.x0, fp32.x0)
        torch.testing.assert_close(traj.x0, fp32.x0, rtol=0, atol=0.1)
    m = consistency(actor, batch, GRPOConfig())
    assert m["grpo/logp_diff_max"] < 1e-6 and m["grpo/logp_diff_mean"] < 1e-6
    # and the actor reports it before its first update
    assert actor.train_step(batch)["grpo/logp_diff_max"] < 1e-6
    # weights that differ from the rollout's show up (log-probs are means over dimensions,
    # so the numbers are small: ~5e-5 for this perturbation)
    with torch.no_grad():
        for layer in actor.layers.values():
            layer.lora_B["default"].weight.normal_(
                0.0, 0.05, generator=torch.Generator().manual_seed(0)
            )
    assert consistency(actor, batch, GRPOConfig())["grpo/logp_diff_max"] > 1e-5


def test_window_trajectory_trains_only_inside_the_window(tiny_model, actor_factory) -> None:
    rollout = RolloutConfig(
        group_size=4,
        num_steps=6,
        sampler="sde",
        keep_latents=True,
        sde_window=2,
        sde_window_start=1,
    )
    traj, batch = _engine_batch(tiny_model, rollout)
    assert traj.sde_mask.tolist() == [False, True, True, False, False, False]
    assert (traj.log_probs[:, ~traj.sde_mask] == 0).all()
    assert (traj.log_probs[:, traj.sde_mask] != 0).all()
    # ODE steps outside the window are Euler steps of the same model
    x1 = traj.latents[:, 0] + tiny_model(
        traj.latents[:, 0], traj.sigmas[0].expand(len(traj)), traj.prompts.input_ids
    ) * (traj.sigmas[1] - traj.sigmas[0])
    torch.testing.assert_close(traj.latents[:, 1], x1, rtol=1e-4, atol=1e-5)
    _, m = loss(
        actor_factory(tiny_model),
        batch,
        GRPOConfig(timestep_fraction=1.0),
        torch.Generator().manual_seed(0),
    )
    assert m["grpo/ratio_dev"] < 1e-4


def test_prepare_refuses_ode_trajectories(tiny_model) -> None:
    with pytest.raises(ValueError, match="rollout.sampler=sde"):
        _engine_batch(tiny_model, RolloutConfig(group_size=2, num_steps=4, keep_latents=True))


@pytest.mark.parametrize("tree", [False, True])
def test_a_group_sharing_its_input_runs_one_forward_with_the_same_gradient(
    tiny_model, actor_factory, monkeypatch, tree
) -> None:
    """Flow-GRPO-Fast's branching step: a group shares x up to and at its SDE step, so training
    runs one forward per group there; the loss and gradient are those of one per member. With
    tree noise the second window step has two distinct inputs per group: two forwards."""
    rollout = RolloutConfig(
        group_size=4,
        num_steps=6,
        sampler="sde",
        keep_latents=True,
        shared_init_noise=True,
        sde_window=2,  # step 1 is the branch (shared input), step 2 is not (members differ)
        sde_window_start=1,
        tree_noise=tree,
    )
    _, batch = _engine_batch(tiny_model, rollout)
    batch = batch.select(torch.randperm(len(batch), generator=torch.Generator().manual_seed(1)))
    # ref_rows=0: the reference's forward beside the policy's at each step, counted below
    cfg = GRPOConfig(timestep_fraction=1.0, timestep_order="ordered", kl_coef=0.1, ref_rows=0)
    actor = actor_factory(tiny_model, algorithm=get_algorithm("flow_grpo"), algo_cfg=cfg)
    with torch.no_grad():  # weights unlike the rollout's, so the ratio and the KL move
        for layer in actor.layers.values():
            layer.lora_B["default"].weight.normal_(
                0, 0.02, generator=torch.Generator().manual_seed(0)
            )
    sizes = []
    forward = actor.velocity

    def counted(x, sigma, ids, adapter="default", cond=None):
        sizes.append(len(x))
        return forward(x, sigma, ids, adapter=adapter)

    def loss_and_grad():
        actor.opt.zero_grad(set_to_none=True)
        value, m = loss(actor, batch, cfg, torch.Generator().manual_seed(0))
        value.backward()
        return value.detach(), host_floats(m), [p.grad.clone() for p in actor.params]

    monkeypatch.setattr(actor, "velocity", counted)
    once = loss_and_grad()
    # step 1 (policy, reference): one row per group; step 2: all, or one per half-group (tree)
    assert sizes == ([3, 3, 6, 6] if tree else [3, 3, 12, 12])
    monkeypatch.setattr("diffrl.algorithms.flow_grpo.shared_rows", lambda *a: None)
    sizes.clear()
    each = loss_and_grad()
    assert sizes == [12, 12, 12, 12]
    # the loss is a mean of O(1) terms -A * ratio that nearly cancel (advantages sum to 0 per
    # group): another summation order moves it by float32 rounding of those terms, ~1e-8
    torch.testing.assert_close(once[0], each[0], rtol=1e-5, atol=1e-6)
    assert once[1] == pytest.approx(each[1], rel=1e-4, abs=1e-8)
    for a, b in zip(once[2], each[2], strict=True):  # summed in another order: float noise only
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-9
    assert any(g.abs().sum() > 0 for g in once[2])


def test_shared_rows_only_merges_bitwise_equal_inputs() -> None:
    def partition(shared):  # which rows run together, e.g. [[0, 1], [2, 3]]
        first, inverse = shared
        assert torch.equal(inverse[first], torch.arange(len(first)))  # each run's first row
        return sorted(
            sorted(i for i in range(len(inverse)) if inverse[i] == u) for u in inverse.unique()
        )

    x = torch.randn(4, 3)
    ids = torch.ones(4, 2, dtype=torch.long)
    key = torch.tensor([7, 7, 9, 9])
    assert shared_rows(x, ids, key) is None  # same key, different inputs: no merging
    x[1], x[3] = x[0], x[2]
    assert partition(shared_rows(x, ids, key)) == [[0, 1], [2, 3]]
    assert shared_rows(x, ids, torch.arange(4)) is None  # every key distinct
    ids[3, 1] = 5  # another prompt: row 3 runs alone, rows 0 and 1 still share
    assert partition(shared_rows(x, ids, key)) == [[0, 1], [2], [3]]
    x[1, 0] = x[0, 0] * (1 + 2**-20) + 1e-30  # a bit or so apart
    assert shared_rows(x, ids, key) is None  # all four inputs differ now


def test_rows_are_searched_for_shared_inputs_only_where_the_rollout_shares(
    tiny_model, actor_factory, monkeypatch
) -> None:
    """StepSpec.shares_inputs is the rollout's shared_init_noise or tree_noise: without either,
    the loss never calls shared_rows (its torch.unique waits for the GPU every pass)."""
    calls = []
    real = shared_rows
    monkeypatch.setattr(
        "diffrl.algorithms.flow_grpo.shared_rows", lambda *a: calls.append(1) or real(*a)
    )
    cfg = GRPOConfig(timestep_fraction=1.0)
    actor = actor_factory(tiny_model, algorithm=get_algorithm("flow_grpo"), algo_cfg=cfg)
    for shared, searched in ((False, False), (True, True)):
        rollout = RolloutConfig(
            group_size=2, num_steps=4, sampler="sde", keep_latents=True, shared_init_noise=shared
        )
        _, batch = _engine_batch(tiny_model, rollout)
        assert batch.step_spec.shares_inputs is shared
        calls.clear()
        loss(actor, batch, cfg, torch.Generator().manual_seed(0))
        assert bool(calls) is searched


@pytest.mark.parametrize("ref_rows", [1, 12, 64])
def test_batched_reference_forwards_give_the_per_step_loss_and_gradient(
    tiny_model, actor_factory, monkeypatch, ref_rows
) -> None:
    """GRPOConfig.ref_rows: the KL reference's means for every trained step, computed up front
    in no-grad forwards of about ref_rows samples each, give the loss and gradient of one
    reference forward per step (ref_rows=0), in fewer forwards."""
    rollout = RolloutConfig(
        group_size=2, num_steps=5, sampler="sde", keep_latents=True, cfg_scale=2.0
    )
    _, batch = _engine_batch(tiny_model, rollout)  # 6 samples, 4 SDE steps
    cfg = GRPOConfig(timestep_fraction=1.0, kl_coef=0.5)
    actor = actor_factory(tiny_model, algorithm=get_algorithm("flow_grpo"), algo_cfg=cfg)
    with torch.no_grad():  # a policy unlike the reference, so the KL and its gradient move
        for layer in actor.layers.values():
            layer.lora_B["default"].weight.normal_(
                0, 0.02, generator=torch.Generator().manual_seed(0)
            )
    forward, ref_sizes = actor.velocity, []

    def counted(x, sigma, ids, adapter="default", cond=None):
        if adapter is None:
            ref_sizes.append(len(x))
        return forward(x, sigma, ids, adapter=adapter, cond=cond)

    monkeypatch.setattr(actor, "velocity", counted)

    def loss_and_grad(c):
        actor.opt.zero_grad(set_to_none=True)
        value, m = loss(actor, batch, c, torch.Generator().manual_seed(0))
        value.backward()
        return value.detach(), host_floats(m), [p.grad.clone() for p in actor.params]

    each = loss_and_grad(replace(cfg, ref_rows=0))
    assert ref_sizes == [12] * 4  # one forward per step: 6 samples x CFG
    ref_sizes.clear()
    batched = loss_and_grad(replace(cfg, ref_rows=ref_rows))
    want = {1: [12] * 4, 12: [24, 24], 64: [48]}[ref_rows]  # at least one step per forward
    assert ref_sizes == want
    torch.testing.assert_close(batched[0], each[0], rtol=1e-5, atol=1e-7)
    assert batched[1] == pytest.approx(each[1], rel=1e-4, abs=1e-8)
    assert each[1]["grpo/kl"] > 0
    for a, b in zip(batched[2], each[2], strict=True):
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-9
