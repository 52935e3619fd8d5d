"""DiffusionNFT: implicit policies, the loss against independent re-computations, gradient
direction, optimality, prepare and the old-policy schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor

from diffrl.algorithms import diffusion_nft as nft
from diffrl.algorithms.registry import get_algorithm, registered_algorithms
from diffrl.types import PromptBatch, ScoredBatch, TrainBatch, Trajectory

B, SHAPE = 3, (3, 4, 4)


class FakePolicy:
    """Velocity under each adapter is a fixed function of (x, sigma); records every call."""

    def __init__(self, theta_fn, old_fn, ref_fn=None) -> None:
        self.fns = {"default": theta_fn, "old": old_fn, None: ref_fn}
        self.calls: list[tuple[str | None, Tensor, Tensor]] = []

    def velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        input_ids: Tensor,
        adapter: str | None = "default",
        cond: Tensor | None = None,
    ) -> Tensor:
        assert input_ids.shape == (x.shape[0], 5)
        self.calls.append((adapter, x.detach().clone(), sigma.detach().clone()))
        return self.fns[adapter](x, sigma)

    def draws(self) -> list[tuple[Tensor, Tensor]]:
        """(x, sigma) of each fresh noise draw (one 'default' call per draw)."""
        return [(x, s) for a, x, s in self.calls if a == "default"]


def theta_fn(x: Tensor, sigma: Tensor) -> Tensor:
    return 0.7 * x - 0.3 * sigma.view(-1, 1, 1, 1)


def old_fn(x: Tensor, sigma: Tensor) -> Tensor:
    return -0.2 * x + 0.5 + sigma.view(-1, 1, 1, 1) ** 2


def ref_fn(x: Tensor, sigma: Tensor) -> Tensor:
    return 0.1 * x


def make_batch(r, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    x0 = torch.rand((len(r), *SHAPE), generator=g) * 2 - 1
    return TrainBatch(
        input_ids=torch.ones(len(r), 5, dtype=torch.long),
        ids_hash=("h",) * len(r),
        x0=x0,
        optimality=torch.as_tensor(r, dtype=torch.float32),
        seeds=torch.arange(len(r)),
    )


def run_loss(policy, batch, **cfg_kw) -> tuple[Tensor, dict, nft.NFTConfig]:
    cfg = nft.NFTConfig(**cfg_kw)
    loss, metrics = nft.loss(policy, batch, cfg, torch.Generator().manual_seed(123))
    return loss, metrics, cfg


def reference_loss(
    policy: FakePolicy, x0: Tensor, r: Tensor, beta: float, per_sample_err
) -> Tensor:
    """Independent re-computation from the (x, sigma) the loss actually drew:
    v = (x - x0) / sigma, since x = (1 - sigma) x0 + sigma eps and v = eps - x0."""
    total = torch.zeros((), dtype=torch.float64)
    draws = policy.draws()
    for x, sigma in draws:
        x, x0d, s = x.double(), x0.double(), sigma.double().view(-1, 1, 1, 1)
        v = (x - x0d) / s
        v_theta = policy.fns["default"](x, sigma.double())
        v_old = policy.fns["old"](x, sigma.double())
        e_pos = per_sample_err(beta * v_theta + (1 - beta) * v_old, v, x, x0d, s)
        e_neg = per_sample_err((1 + beta) * v_old - beta * v_theta, v, x, x0d, s)
        total += ((r.double() * e_pos + (1 - r.double()) * e_neg) / beta).mean()
    return total / len(draws)


def uniform_err(v_pm, v, x, x0, s):
    return ((v_pm - v) ** 2).flatten(1).mean(1)


def adaptive_err(v_pm, v, x, x0, s):
    x0_hat = x - s * v_pm
    return ((x0_hat - x0) ** 2).flatten(1).mean(1) / (x0_hat - x0).abs().flatten(1).mean(1)


# --- implicit policies / optimality -----------------------------------------------------------


@pytest.mark.parametrize("beta", [0.1, 1.0, 3.0])
def test_implicit_policies(beta: float) -> None:
    g = torch.Generator().manual_seed(1)
    v_theta, v_old = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    v_pos, v_neg = nft.implicit_policies(v_theta, v_old, beta)
    torch.testing.assert_close(v_pos + v_neg, 2 * v_old)
    torch.testing.assert_close(v_pos - v_old, beta * (v_theta - v_old))
    torch.testing.assert_close(v_neg - v_old, -beta * (v_theta - v_old))


def test_implicit_policies_beta_one_is_theta() -> None:
    v_theta, v_old = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 4.0])
    v_pos, v_neg = nft.implicit_policies(v_theta, v_old, 1.0)
    assert v_pos.tolist() == [1.0, -2.0]
    assert v_neg.tolist() == [0.0, 10.0]  # 2 v_old - v_theta


def test_optimality_maps_and_clips() -> None:
    adv = torch.tensor([-10.0, -2.0, -1.0, 0.0, 1.0, 2.0, 10.0])
    r = nft.optimality(adv, 2.0)
    assert r.tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
    assert nft.optimality(torch.tensor([0.3]), 0.5).item() == pytest.approx(0.8)


# --- the loss ----------------------------------------------------------------------------------


def test_r1_beta1_uniform_is_plain_flow_matching() -> None:
    batch = make_batch([1.0] * B)
    policy = FakePolicy(theta_fn, old_fn)
    loss, _, _ = run_loss(policy, batch, beta=1.0, weighting="uniform", timesteps_per_sample=1)
    ((x, sigma),) = policy.draws()
    v = (x - batch.x0) / sigma.view(-1, 1, 1, 1)
    fm = ((theta_fn(x, sigma) - v) ** 2).mean()  # ||v_theta - v||^2 / beta, beta = 1
    assert loss.item() == pytest.approx(fm.item(), rel=1e-5)
    # the old policy enters only through v+, which equals v_theta at beta=1
    policy2 = FakePolicy(theta_fn, lambda x, s: old_fn(x, s) + 100.0)
    loss2, _, _ = run_loss(policy2, batch, beta=1.0, weighting="uniform", timesteps_per_sample=1)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize("beta", [0.3, 1.0, 2.0])
def test_r1_uniform_matches_positive_policy_regression(beta: float) -> None:
    batch = make_batch([1.0] * B)
    policy = FakePolicy(theta_fn, old_fn)
    loss, _, _ = run_loss(policy, batch, beta=beta, weighting="uniform", timesteps_per_sample=1)
    ((x, sigma),) = policy.draws()
    v = (x - batch.x0) / sigma.view(-1, 1, 1, 1)
    v_pos = beta * theta_fn(x, sigma) + (1 - beta) * old_fn(x, sigma)
    assert loss.item() == pytest.approx((((v_pos - v) ** 2).mean() / beta).item(), rel=1e-5)


@pytest.mark.parametrize("beta", [0.3, 1.0, 2.0])
def test_r0_uniform_is_negative_policy_regression(beta: float) -> None:
    batch = make_batch([0.0] * B)
    policy = FakePolicy(theta_fn, old_fn)
    loss, _, _ = run_loss(policy, batch, beta=beta, weighting="uniform", timesteps_per_sample=1)
    ((x, sigma),) = policy.draws()
    v = (x - batch.x0) / sigma.view(-1, 1, 1, 1)
    expected = (((1 + beta) * old_fn(x, sigma) - beta * theta_fn(x, sigma) - v) ** 2).mean() / beta
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize(
    ("weighting", "err"), [("uniform", uniform_err), ("adaptive", adaptive_err)]
)
def test_mixed_r_several_draws_matches_reference(weighting, err) -> None:
    r = torch.tensor([1.0, 0.0, 0.25])
    batch = make_batch(r)
    policy = FakePolicy(theta_fn, old_fn)
    loss, metrics, cfg = run_loss(
        policy, batch, beta=0.7, weighting=weighting, timesteps_per_sample=3
    )
    assert len(policy.draws()) == 3
    expected = reference_loss(policy, batch.x0, r, 0.7, err)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["nft/r_mean"] == pytest.approx(float(r.mean()))
    for _, _x, sigma in policy.calls:  # training sigmas come from U(sigma_min, sigma_max)
        assert ((sigma >= cfg.sigma_min) & (sigma <= cfg.sigma_max)).all()


def test_old_policy_is_evaluated_without_grad_and_on_the_same_input() -> None:
    batch = make_batch([0.0] * B)
    p = torch.zeros(1, requires_grad=True)
    policy = FakePolicy(lambda x, s: theta_fn(x, s) + p, lambda x, s: old_fn(x, s) + p)
    loss, _, _ = run_loss(policy, batch, weighting="uniform", timesteps_per_sample=1)
    adapters = [a for a, _, _ in policy.calls]
    assert adapters == ["old", "default"]
    torch.testing.assert_close(policy.calls[0][1], policy.calls[1][1])
    torch.testing.assert_close(policy.calls[0][2], policy.calls[1][2])
    loss.backward()
    # at r=0, beta=1 the loss is ||2 v_old - v_theta - v||^2; with grad through v_old the
    # p-gradient would be (2 - 1) * ...; without it only the -1 * ... of v_theta remains
    ((x, sigma),) = policy.draws()
    v = (x - batch.x0) / sigma.view(-1, 1, 1, 1)
    resid = 2 * old_fn(x, sigma) - theta_fn(x, sigma) - v  # p = 0
    expected_grad = (-2 * resid).mean()
    assert p.grad.item() == pytest.approx(expected_grad.item(), rel=1e-4)


def test_kl_anchor_adds_reference_term() -> None:
    batch = make_batch([1.0] * B)
    pol0 = FakePolicy(theta_fn, old_fn, ref_fn)
    base, m0, _ = run_loss(pol0, batch, weighting="uniform", timesteps_per_sample=1)
    assert "nft/kl" not in m0
    pol = FakePolicy(theta_fn, old_fn, ref_fn)
    loss, metrics, _ = run_loss(
        pol, batch, weighting="uniform", timesteps_per_sample=1, kl_coef=0.5
    )
    ((x, sigma),) = pol.draws()
    kl = ((theta_fn(x, sigma) - ref_fn(x, sigma)) ** 2).mean()
    assert metrics["nft/kl"] == pytest.approx(kl.item(), rel=1e-5)
    assert loss.item() == pytest.approx(base.item() + 0.5 * kl.item(), rel=1e-5)


@pytest.mark.parametrize("weighting", ["uniform", "adaptive"])
@pytest.mark.parametrize(("r", "moves_away"), [(0.0, True), (1.0, False)])
def test_gradient_step_direction(weighting: str, r: float, moves_away: bool) -> None:
    """With v_theta == v_old: at r=0 a descent step pushes v_theta away from the sample's
    velocity v, at r=1 toward it."""
    batch = make_batch([r] * B)
    g = torch.Generator().manual_seed(5)
    v_old = torch.randn((B, *SHAPE), generator=g)
    param = torch.nn.Parameter(v_old.clone())
    policy = FakePolicy(lambda x, s: param * 1.0, lambda x, s: v_old)
    loss, _, _ = run_loss(policy, batch, beta=1.0, weighting=weighting, timesteps_per_sample=1)
    loss.backward()
    ((x, sigma),) = policy.draws()
    v = (x - batch.x0) / sigma.view(-1, 1, 1, 1)
    before = (param.detach() - v).flatten(1).norm(dim=1)
    with torch.no_grad():
        param -= 0.05 * param.grad / param.grad.norm()
    after = (param.detach() - v).flatten(1).norm(dim=1)
    if moves_away:
        assert (after > before).all()
    else:
        assert (after < before).all()


def test_loss_is_finite_and_differentiable_with_real_sigmas_near_bounds() -> None:
    batch = make_batch([0.0, 0.5, 1.0])
    param = torch.nn.Parameter(torch.zeros(1))
    policy = FakePolicy(lambda x, s: theta_fn(x, s) + param, old_fn)
    loss, metrics, _ = run_loss(policy, batch, sigma_min=0.0, sigma_max=1e-3)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(param.grad).all()
    assert set(metrics) >= {"nft/loss_pos", "nft/loss_neg", "nft/r_mean"}


# --- prepare -------------------------------------------------------------------------------------


def make_scored(rewards, valid, g: int = 4) -> ScoredBatch:
    n = len(rewards)
    ids = torch.arange(n * 2).view(n, 2)
    prompts = PromptBatch(
        texts=tuple(f"t{i}" for i in range(n)),
        input_ids=ids,
        ids_hash=tuple(f"h{i}" for i in range(n)),
        prompt_ids=torch.arange(n) // g,
    )
    traj = Trajectory(
        prompts=prompts,
        group=torch.arange(n) // g,
        seeds=torch.arange(n) + 100,
        x0=torch.arange(n).float().view(n, 1, 1, 1).expand(n, 3, 2, 2).clone(),
        sigmas=torch.linspace(1, 0, 3),
        policy_version=0,
    )
    return ScoredBatch(traj, torch.tensor(rewards), {}, torch.tensor(valid))


def test_prepare_drops_invalid_and_maps_to_optimality() -> None:
    scored = make_scored(
        [1.0, 2.0, 3.0, float("nan"), 5.0, 5.0, 5.0, 5.0],
        [True, True, True, False, True, True, True, True],
    )
    batch = nft.prepare(scored, nft.NFTConfig(adv_clip=2.0))
    keep = [0, 1, 2, 4, 5, 6, 7]
    assert len(batch) == 7
    assert batch.ids_hash == tuple(f"h{i}" for i in keep)
    assert batch.seeds.tolist() == [100 + i for i in keep]
    assert batch.group.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert batch.x0[:, 0, 0, 0].tolist() == [float(i) for i in keep]
    torch.testing.assert_close(batch.input_ids, scored.traj.prompts.input_ids[keep])
    a = 1 / ((2 / 3) ** 0.5 + 1e-4)  # advantage of rewards 1 and 3 in the first group
    assert batch.optimality.tolist() == pytest.approx(
        [0.5 - a / 4, 0.5, 0.5 + a / 4] + [0.5] * 4, abs=1e-6
    )


def test_prepare_global_std_and_clip() -> None:
    scored = make_scored([0.0, 2.0, 0.0, 8.0], [True] * 4, g=2)  # centred: -1, 1 | -4, 4
    per_group = nft.prepare(scored, nft.NFTConfig(adv_clip=1.0))
    assert per_group.optimality.tolist() == pytest.approx([0.0, 1.0, 0.0, 1.0], abs=1e-3)
    batch = nft.prepare(scored, nft.NFTConfig(adv_clip=1.0, global_std=True))
    a = 1 / 8.5**0.5  # batch std of the centred rewards is sqrt(8.5)
    assert 4 * a > 1  # the second group's advantages are clipped
    assert batch.optimality.tolist() == pytest.approx(
        [0.5 - a / 2, 0.5 + a / 2, 0.0, 1.0], abs=1e-4
    )


def test_prepare_can_skip_uniform_groups() -> None:
    # group 0: informative; group 1: all equal; group 2: one valid distinct value only
    scored = make_scored(
        [0.0, 1.0, 1.0, 0.0, 3.0, 3.0, 3.0, 3.0, 2.0, 9.0, 9.0, 9.0],
        [True] * 8 + [True, False, False, False],
    )
    kept = nft.prepare(scored, nft.NFTConfig())
    assert kept.group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    skipped = nft.prepare(scored, nft.NFTConfig(skip_uniform_groups=True))
    assert skipped.group.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(skipped.optimality, kept.optimality[:4])  # advantages unchanged


def test_prepare_all_invalid_is_empty() -> None:
    batch = nft.prepare(make_scored([float("nan")] * 4, [False] * 4), nft.NFTConfig())
    assert len(batch) == 0 and batch.ids_hash == ()


# --- schedule / registry -------------------------------------------------------------------------


def test_weight_plan_copy_every_n() -> None:
    cfg = nft.NFTConfig(old_update="copy", old_every=3)
    plans = [nft.weight_plan(step, cfg) for step in range(1, 8)]
    assert [p.sync for p in plans] == [False, False, True, False, False, True, False]
    refreshes = [(step, p.refresh_old) for step, p in enumerate(plans, 1)]
    assert [(s, d) for s, d in refreshes if d is not None] == [(3, 0.0), (6, 0.0)]
    assert {p.rollout_adapter for p in plans} == {"old"}


def test_weight_plan_ema_every_step() -> None:
    cfg = nft.NFTConfig(old_update="ema", old_every=3, old_ema=0.9)
    for step in range(1, 4):
        plan = nft.weight_plan(step, cfg)
        assert plan.sync is True
        assert plan.refresh_old == 0.9


def test_registered_and_rollout_samples_with_old() -> None:
    assert "diffusion_nft" in registered_algorithms()
    algo = get_algorithm("diffusion_nft")
    assert algo.config_cls is nft.NFTConfig and algo.loss is nft.loss
    assert algo.weight_plan(1, nft.NFTConfig()).rollout_adapter == "old"
    assert algo.weight_plan is nft.weight_plan
    assert algo.needs_logprobs is False
    with pytest.raises(KeyError, match="nope"):
        get_algorithm("nope")


# --- shared noise (common random numbers within a group) ---------------------------------------


def test_group_key_is_each_groups_first_seed() -> None:
    traj = make_scored([0.0] * 8, [True] * 8).traj  # groups of 4, seeds 100..107
    assert nft.group_key(traj).tolist() == [100] * 4 + [104] * 4
    # groups need not be contiguous or in order: the key is the seed of the group's first row
    shuffled = Trajectory(
        prompts=traj.prompts.select(torch.arange(5)),
        group=torch.tensor([1, 1, 0, 2, 0]),
        seeds=torch.tensor([5, 6, 7, 8, 9]),
        x0=traj.x0[:5],
    )
    key = nft.group_key(shuffled)
    assert key.dtype == torch.int64 and key.tolist() == [5, 5, 7, 8, 7]


def test_prepare_keys_noise_on_the_group_even_when_its_first_row_is_dropped() -> None:
    scored = make_scored([float("nan"), 1.0, 2.0, 3.0, 4.0, 5.0], [False] + [True] * 5, g=3)
    batch = nft.prepare(scored, nft.NFTConfig())
    assert batch.group.tolist() == [0, 0, 1, 1, 1]
    assert batch.noise_key.tolist() == [100, 100, 103, 103, 103]


@pytest.mark.parametrize("j", [0, 1])
def test_shared_noise_draws_alike_within_a_group_and_apart_across(j: int) -> None:
    scored = make_scored([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [True] * 8, g=4)
    batch = nft.prepare(scored, nft.NFTConfig())
    assert len(set(batch.seeds.tolist())) == 8  # every sample has its own seed
    cfg = nft.NFTConfig(shared_noise=True)
    sigma, eps = nft.training_noise(batch, cfg, torch.Generator().manual_seed(0), j)
    assert sigma.shape == (8,) and eps.shape == (8, 3, 2, 2)
    for rows in ([0, 1, 2, 3], [4, 5, 6, 7]):  # a group: identical (sigma, eps)
        for r in rows[1:]:
            assert torch.equal(sigma[r], sigma[rows[0]]) and torch.equal(eps[r], eps[rows[0]])
    assert sigma[0] != sigma[4] and not torch.allclose(eps[0], eps[4])  # across groups: not
    assert ((sigma >= cfg.sigma_min) & (sigma <= cfg.sigma_max)).all()
    # the draws depend on the group's key, not on the generator or the batch's row order
    again, eps2 = nft.training_noise(
        batch.select(torch.tensor([7, 0])), cfg, torch.Generator().manual_seed(9), j
    )
    assert torch.equal(again, sigma[[7, 0]]) and torch.equal(eps2, eps[[7, 0]])
    # and every training timestep draws afresh
    other, _ = nft.training_noise(batch, cfg, torch.Generator().manual_seed(0), j + 1)
    assert not torch.equal(other, sigma)


def test_shared_noise_off_draws_per_sample() -> None:
    batch = nft.prepare(make_scored([0.0, 1.0, 2.0, 3.0], [True] * 4), nft.NFTConfig())
    sigma, eps = nft.training_noise(batch, nft.NFTConfig(), torch.Generator().manual_seed(0), 0)
    assert len(set(sigma.tolist())) == 4 and not torch.allclose(eps[0], eps[1])


def test_shared_noise_reaches_the_loss() -> None:
    """The loss noises every member of a group with the same (sigma, eps)."""
    scored = make_scored([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [True] * 6, g=3)
    batch = nft.prepare(scored, nft.NFTConfig())
    batch = replace(batch, input_ids=torch.ones(6, 5, dtype=torch.long))  # FakePolicy: L = 5
    policy = FakePolicy(
        lambda x, s: 0.7 * x - 0.3 * s.view(-1, 1, 1, 1), lambda x, s: -0.2 * x + 0.5
    )
    run_loss(policy, batch, shared_noise=True, timesteps_per_sample=2, weighting="uniform")
    for x, sigma in policy.draws():
        s = sigma.view(-1, 1, 1, 1)
        eps = (x - (1 - s) * batch.x0) / s
        assert torch.equal(sigma[:3], sigma[0].expand(3)) and sigma[0] != sigma[3]
        torch.testing.assert_close(eps[1], eps[0])
        torch.testing.assert_close(eps[2], eps[0])
        torch.testing.assert_close(eps[4], eps[3])
        assert not torch.allclose(eps[0], eps[3])


@pytest.mark.parametrize("old_rows", [1, 8, 64])
def test_batched_old_and_reference_forwards_give_the_per_step_loss(
    tiny_model, actor_factory, train_batch_factory, monkeypatch, old_rows
) -> None:
    """NFTConfig.old_rows: the old policy's (and the KL reference's) no-grad velocities for
    every timestep, computed up front in forwards of about old_rows samples, give the loss and
    gradient of one of each per timestep (old_rows=0), in fewer forwards."""
    cfg = nft.NFTConfig(timesteps_per_sample=3, kl_coef=0.2, weighting="uniform")
    actor = actor_factory(tiny_model, algo_cfg=cfg)
    with torch.no_grad():  # default, old and the reference all different
        g = torch.Generator().manual_seed(0)
        for layer in actor.layers.values():
            for adapter in ("default", "old"):
                layer.lora_B[adapter].weight.normal_(0, 0.05, generator=g)
    batch = train_batch_factory(4)
    forward, sizes = actor.velocity, []

    def counted(x, sigma, ids, adapter="default", cond=None):
        sizes.append((adapter, len(x)))
        return forward(x, sigma, ids, adapter=adapter, cond=cond)

    monkeypatch.setattr(actor, "velocity", counted)

    def loss_and_grad(c):
        actor.opt.zero_grad(set_to_none=True)
        value, m = nft.loss(actor, batch, c, torch.Generator().manual_seed(5))
        value.backward()
        return value.detach(), [p.grad.clone() for p in actor.params]

    each = loss_and_grad(replace(cfg, old_rows=0))
    assert sorted(map(str, sizes)) == sorted(map(str, [("old", 4), ("default", 4), (None, 4)] * 3))
    sizes.clear()
    batched = loss_and_grad(replace(cfg, old_rows=old_rows))
    frozen = {1: [4, 4, 4], 8: [8, 4], 64: [12]}[old_rows]  # whole timesteps per forward
    assert [n for a, n in sizes if a == "old"] == frozen
    assert [n for a, n in sizes if a is None] == frozen
    assert [n for a, n in sizes if a == "default"] == [4, 4, 4]
    torch.testing.assert_close(batched[0], each[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(batched[1], each[1], strict=True):
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-9
