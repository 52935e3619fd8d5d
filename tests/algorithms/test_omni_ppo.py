"""Omni-PPO against its formulas, re-implemented here element by element in plain Python (not
the module's helpers): the token-level clipped surrogate with clip-higher, GSPO's sequence
ratio, the k3 KL to the reference, both aggregations, and prepare's group advantages and
DAPO's dynamic sampling."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.omni_ppo import OmniPPOConfig, loss, prepare, token_surrogate
from diffrl.errors import FieldError
from diffrl.models.family import NO_TOKEN
from diffrl.types import PromptBatch, ScoredBatch, StepSpec, TrainBatch, Trajectory, hash_rows

# 3 completions of up to 4 tokens; the second ends after 2 tokens, the third after 3
TOKENS = torch.tensor([[5, 6, 7, 8], [5, 9, NO_TOKEN, NO_TOKEN], [4, 4, 4, NO_TOKEN]])
OLD = torch.tensor([[-1.0, -0.5, -2.0, -1.2], [-0.7, -1.5, 0.0, 0.0], [-2.2, -0.3, -0.9, 0.0]])
NEW = torch.tensor([[-0.6, -0.55, -2.9, -1.0], [-1.3, -1.2, 0.0, 0.0], [-1.8, -0.3, -1.1, 0.0]])
REF = torch.tensor([[-1.1, -0.4, -2.0, -1.5], [-0.9, -1.0, 0.0, 0.0], [-2.0, -0.6, -0.8, 0.0]])
ADV = torch.tensor([1.5, -0.8, 0.4])


class FakePolicy:
    """Log-probs as given: a leaf for the policy (so its gradient can be read), REF for the
    reference (adapter None)."""

    def __init__(self) -> None:
        self.logp = NEW.clone().requires_grad_(True)

    def token_log_probs(self, tokens, temperature, input_ids, adapter="default", cond=None):
        assert temperature == 1.0 and torch.equal(tokens, TOKENS)
        return self.logp if adapter == "default" else REF.clone()


def _batch() -> TrainBatch:
    ids = torch.zeros(3, 2, dtype=torch.int64)
    return TrainBatch(
        input_ids=ids, ids_hash=hash_rows(ids), x0=TOKENS, cond=None, cond_hash=None,
        seeds=torch.zeros(3, dtype=torch.int64), group=torch.zeros(3, dtype=torch.int64),
        advantages=ADV, log_probs=OLD, step_spec=StepSpec("token", 1.0, 1.0, ()),
    )  # fmt: skip


def _tokens(i: int) -> list[int]:
    return [t for t in range(4) if TOKENS[i, t] != NO_TOKEN]


def _clipped_term(ratio: float, adv: float, lo: float, hi: float) -> float:
    return max(-adv * ratio, -adv * min(max(ratio, 1 - lo), 1 + hi))


def _k3(new: float, ref: float) -> float:
    return math.exp(ref - new) - (ref - new) - 1


def _reference(cfg: OmniPPOConfig) -> float:
    """The loss written out term by term, in Python floats."""
    new, old, ref, adv = NEW.tolist(), OLD.tolist(), REF.tolist(), ADV.tolist()
    lo, hi, beta = cfg.clip_low, cfg.clip_high, cfg.kl_beta
    pol: list[list[float]] = []  # per completion, its tokens' surrogate terms
    kls: list[list[float]] = []  # and their k3 KL terms
    for i in range(3):
        toks = _tokens(i)
        if cfg.ratio == "token":
            pol.append(
                [_clipped_term(math.exp(new[i][t] - old[i][t]), adv[i], lo, hi) for t in toks]
            )
        else:  # GSPO: the geometric mean of the token ratios, one term per completion
            s = math.exp(sum(new[i][t] - old[i][t] for t in toks) / len(toks))
            pol.append([_clipped_term(s, adv[i], lo, hi)])
        kls.append([_k3(new[i][t], ref[i][t]) for t in toks])

    def agg(terms: list[list[float]]) -> float:
        if cfg.loss_agg == "token_mean":
            return sum(map(sum, terms)) / sum(map(len, terms))
        return sum(sum(t) / len(t) for t in terms) / len(terms)

    policy = agg(pol) if cfg.ratio == "token" else sum(p[0] for p in pol) / 3
    return policy + beta * agg(kls)


@pytest.mark.parametrize(
    "cfg",
    [
        OmniPPOConfig(),
        OmniPPOConfig(clip_low=0.2, clip_high=0.28, kl_beta=0.0),  # DAPO clip-higher, no KL
        OmniPPOConfig(loss_agg="seq_mean", kl_beta=0.1),
        OmniPPOConfig(ratio="sequence", clip_low=0.1, clip_high=0.15, kl_beta=0.05),
    ],
    ids=["grpo", "clip_higher", "seq_mean", "gspo"],
)
def test_loss_matches_the_formula(cfg: OmniPPOConfig) -> None:
    policy = FakePolicy()
    total, metrics = loss(policy, _batch(), cfg, torch.Generator())
    assert float(total.detach()) == pytest.approx(_reference(cfg), rel=1e-5, abs=1e-6)
    total.backward()
    grad = policy.logp.grad
    assert grad is not None and (grad[TOKENS == NO_TOKEN] == 0).all()
    # the gradient against a finite difference of the formula, on one unclipped token
    eps, (i, t) = 1e-3, (2, 1)
    NEW[i, t] += eps
    up = _reference(cfg)
    NEW[i, t] -= 2 * eps
    down = _reference(cfg)
    NEW[i, t] += eps
    assert float(grad[i, t]) == pytest.approx((up - down) / (2 * eps), rel=1e-3, abs=1e-5)
    assert 0 <= float(metrics["ppo/clip_frac"]) <= 1


def test_clip_higher_lets_a_positive_advantage_rise_further() -> None:
    """A token whose ratio reached 1.25 under a positive advantage: the 1 + 0.2 ceiling stops
    its gradient, DAPO's 1 + 0.28 does not."""
    for hi, moves in [(0.2, False), (0.28, True)]:
        logp = torch.tensor([[math.log(1.25)]], requires_grad=True)
        term, clipped = token_surrogate(logp, torch.zeros(1, 1), torch.ones(1), 0.2, hi)
        term.sum().backward()
        assert bool(logp.grad != 0) == moves and bool(clipped) != moves


def _scored(rewards: list[float], valid: list[bool] | None = None) -> ScoredBatch:
    n = len(rewards)
    ids = torch.zeros(n, 2, dtype=torch.int64)
    prompts = PromptBatch(
        texts=("q",) * n, input_ids=ids, ids_hash=hash_rows(ids), prompt_ids=torch.arange(n) // 2
    )
    traj = Trajectory(
        prompts=prompts, group=torch.arange(n) // 2, seeds=torch.arange(n),
        x0=torch.ones(n, 3, dtype=torch.int64), log_probs=torch.zeros(n, 3),
        sde_mask=torch.ones(3, dtype=torch.bool), step_spec=StepSpec("token", 1.0, 1.0, ()),
    )  # fmt: skip
    ok = torch.tensor(valid if valid is not None else [True] * n)
    r = torch.tensor(rewards)
    return ScoredBatch(traj, r, {"qa": r}, ok)


def test_prepare_group_advantages_and_dynamic_sampling() -> None:
    scored = _scored([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.3, 9.0], [True] * 7 + [False])
    batch = prepare(scored, OmniPPOConfig())
    # groups: (1, 0), (1, 1), (0, 0.5), (0.3, invalid): A = (R - mean) / (std + 1e-4)
    want = [0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0, -0.25 / 0.2501, 0.25 / 0.2501, 0.0]
    torch.testing.assert_close(batch.advantages, torch.tensor(want), atol=1e-5, rtol=0)
    kept = prepare(scored, OmniPPOConfig(dynamic_sampling=True))
    assert kept.seeds.tolist() == [0, 1, 4, 5]  # the tied group and the lone valid row dropped


def test_prepare_refuses_a_diffusion_trajectory_and_greedy_samples() -> None:
    scored = _scored([1.0, 0.0])
    diffusion = ScoredBatch(
        Trajectory(scored.traj.prompts, scored.traj.group, scored.traj.seeds, torch.zeros(2, 3)),
        scored.rewards, scored.per_scorer, scored.valid,
    )  # fmt: skip
    with pytest.raises(ValueError, match="autoregressive"):
        prepare(diffusion, OmniPPOConfig())
    from dataclasses import replace

    greedy = replace(scored, traj=replace(scored.traj, sde_mask=torch.zeros(3, dtype=torch.bool)))
    with pytest.raises(ValueError, match="rollout.sampler=sde"):
        prepare(greedy, OmniPPOConfig())
    with pytest.raises(FieldError, match="ratio"):
        OmniPPOConfig(ratio="tokens").validate()
