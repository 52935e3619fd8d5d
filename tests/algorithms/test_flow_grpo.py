"""FlowGRPO: the clipped objective, step selection, and rollout/training log-prob parity."""

import torch

from diffrl.algorithms.flow_grpo import GRPOConfig, clipped_objective, loss, train_steps
from diffrl.rollout.samplers import sde_step_with_logprob, sigma_schedule
from diffrl.types import TrainBatch


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
    idx = train_steps(8, 3, cfg, gen)
    assert idx.shape == (3, 4)
    assert all(len(set(row.tolist())) == 4 for row in idx)  # distinct steps per sample
    ordered = train_steps(8, 2, GRPOConfig(timestep_fraction=0.5, timestep_order="ordered"), gen)
    assert ordered.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


class LinearPolicy:
    """v = w * x, with w trainable: enough to exercise the loss end to end."""

    def __init__(self, w: float) -> None:
        self.w = torch.tensor(w, requires_grad=True)

    def velocity(self, x, sigma, ids, adapter="default"):
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


def test_same_weights_give_ratio_one_and_zero_loss_gradient_sign():
    policy = LinearPolicy(0.9)
    sig, lat, lps = _rollout(policy)
    n = lat.shape[0]
    batch = TrainBatch(
        input_ids=torch.zeros(n, 2, dtype=torch.long),
        ids_hash=("",) * n,
        x0=lat[:, -1],
        weights=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        seeds=torch.zeros(n, dtype=torch.long),
        latents=lat,
        log_probs=lps,
        sigmas=sig,
    )
    cfg = GRPOConfig(timestep_fraction=1.0, kl_coef=0.0, clip_range=0.2)
    value, metrics = loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["grpo/ratio_dev"] < 1e-5  # rollout and training log-probs agree
    # at ratio 1 the surrogate is -mean(A) = -0.0 here
    assert abs(float(value) - float(-batch.weights.mean())) < 1e-5


def test_kl_term_is_zero_against_itself_and_positive_otherwise():
    policy = LinearPolicy(0.5)  # the "reference" in LinearPolicy is w=0.5 as well
    sig, lat, lps = _rollout(policy)
    n = lat.shape[0]
    batch = TrainBatch(
        input_ids=torch.zeros(n, 2, dtype=torch.long),
        ids_hash=("",) * n,
        x0=lat[:, -1],
        weights=torch.zeros(n),
        seeds=torch.zeros(n, dtype=torch.long),
        latents=lat,
        log_probs=lps,
        sigmas=sig,
    )
    cfg = GRPOConfig(timestep_fraction=1.0, kl_coef=1.0)
    _, m = loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    assert m["grpo/kl"] < 1e-10
    _, m = loss(LinearPolicy(0.8), batch, cfg, torch.Generator().manual_seed(0))
    assert m["grpo/kl"] > 1e-4
