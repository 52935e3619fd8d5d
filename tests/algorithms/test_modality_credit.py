"""Credit per modality (algorithm.modality_credit): the per-modality advantages against
independent math, DiffusionNFT's loss as the sum of two single-modality losses, FlowGRPO's
per-modality log-probs and clipping, the refusals, and the default path's numbers unchanged
(golden values computed by the code before modality credit existed)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import Tensor

from diffrl.algorithms import diffusion_nft as nft
from diffrl.algorithms import flow_grpo as grpo
from diffrl.algorithms.modality import check_family, credited_rewards, modality_advantages
from diffrl.config import load_config
from diffrl.errors import ConfigError, ContractError
from diffrl.rollout.samplers import modality_log_probs, sde_step_with_logprob, sigma_schedule
from diffrl.types import PromptBatch, ScoredBatch, StepSpec, TrainBatch, Trajectory

SPLIT = (7, 5)  # (n_video, n_audio) elements of the flat latent
D = sum(SPLIT)


def scored_batch(by: dict[str, list[float]], groups: list[int]) -> ScoredBatch:
    n = len(groups)
    x0 = torch.zeros(n, D)
    prompts = PromptBatch(
        texts=("p",) * n,
        input_ids=torch.ones(n, 3, dtype=torch.long),
        ids_hash=("h",) * n,
        prompt_ids=torch.tensor(groups),
    )
    traj = Trajectory(
        prompts, torch.tensor(groups), torch.arange(n) * 7 + 1, x0, modality_split=SPLIT
    )
    parts = {m: torch.tensor(v) for m, v in by.items()}
    total = sum(parts.values())
    return ScoredBatch(traj, total, {"s": total}, torch.ones(n, dtype=torch.bool), parts)


BY = {
    "video": [1.0, 0.0, 0.5, 0.0, 1.0, 1.0],
    "audio": [0.0, 1.0, 0.5, 0.25, 0.25, 0.0],
    "joint": [0.5, 0.0, 1.0, 1.0, 0.0, 0.5],
}
GROUPS = [0, 0, 0, 1, 1, 1]


def groupnorm(r: np.ndarray, groups: list[int], eps: float = 1e-4) -> np.ndarray:
    """Independent: (r - group mean) / (group population std + eps)."""
    g = np.array(groups)
    out = np.empty_like(r)
    for k in set(groups):
        m = g == k
        out[m] = (r[m] - r[m].mean()) / (r[m].std() + eps)
    return out


def pooled(cols: list[np.ndarray], groups: list[int], eps: float = 1e-4) -> list[np.ndarray]:
    """Independent: each column centred on its group mean, over one std per group pooled
    over both columns' centred values."""
    g = np.array(groups)
    out = [np.empty_like(c) for c in cols]
    for k in set(groups):
        m = g == k
        centred = [c[m] - c[m].mean() for c in cols]
        std = np.sqrt(np.mean(np.concatenate(centred) ** 2))
        for o, c in zip(out, centred, strict=True):
            o[m] = c / (std + eps)
    return out


def test_each_modality_is_credited_with_its_own_and_the_joint_rewards() -> None:
    scored = scored_batch(BY, GROUPS)
    v, a, j = (np.array(BY[m]) for m in ("video", "audio", "joint"))
    own = modality_advantages(scored, global_std=False, std="own")
    np.testing.assert_allclose(own[:, 0].numpy(), groupnorm(v + j, GROUPS), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(own[:, 1].numpy(), groupnorm(a + j, GROUPS), rtol=1e-5, atol=1e-6)
    adv = modality_advantages(scored, global_std=False)  # pooled, the default
    want_v, want_a = pooled([v + j, a + j], GROUPS)
    np.testing.assert_allclose(adv[:, 0].numpy(), want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv[:, 1].numpy(), want_a, rtol=1e-5, atol=1e-6)
    # the columns differ where the modalities disagree (group 0's first two samples swap)
    assert adv[0, 0] > adv[1, 0] and adv[0, 1] < adv[1, 1]
    # the batch's std with global_std: pooled over every valid entry of both columns
    glob = modality_advantages(scored, global_std=True)
    centred = np.zeros((len(GROUPS), 2))
    for k, col in enumerate((v + j, a + j)):
        for grp in set(GROUPS):
            m = np.array(GROUPS) == grp
            centred[m, k] = col[m] - col[m].mean()
    np.testing.assert_allclose(glob.numpy(), centred / (centred.std() + 1e-4), rtol=1e-5, atol=1e-6)
    # only joint rewards: both are the scalar advantage, under either std
    joint = {"video": [0.0] * 6, "audio": [0.0] * 6, "joint": BY["joint"]}
    for std in ("pooled", "own"):
        only = modality_advantages(scored_batch(joint, GROUPS), False, std)
        assert torch.equal(only[:, 0], only[:, 1])
        want = groupnorm(np.array(BY["joint"]), GROUPS)
        np.testing.assert_allclose(only[:, 0].numpy(), want, rtol=1e-5, atol=1e-6)
    # a batch that lost its rewards per modality on the way is refused, not read as joint
    lost = ScoredBatch(scored.traj, scored.rewards, scored.per_scorer, scored.valid)
    with pytest.raises(ContractError, match="no rewards per modality"):
        credited_rewards(lost)


def test_pooled_credit_separates_coupled_failures_and_opposite_moves() -> None:
    """Clip 3 loses its video and with it the sync (joint), as a broken ball does on AVBench:
    pooled charges the audio only the sync, own charges it in full. Group 1's modalities move
    in opposite directions with a constant total: no scalar signal, opposite credit."""
    by = {
        "video": [0.4, 0.4, 0.4, 0.2, 0.4, 0.2, 0.4, 0.2],
        "audio": [0.4, 0.4, 0.4, 0.4, 0.2, 0.4, 0.2, 0.4],
        "joint": [0.2, 0.2, 0.2, 0.0, 0.2, 0.2, 0.2, 0.2],
    }
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    scored = scored_batch(by, groups)
    own = modality_advantages(scored, False, "own")
    adv = modality_advantages(scored, False)
    assert own[3, 0] == pytest.approx(float(own[3, 1]), rel=2e-3)  # one outlier: -sqrt(3) in both
    assert adv[3, 0] == pytest.approx(-(3**0.5) * 2**0.5 * 0.4 / (0.4**2 + 0.2**2) ** 0.5, rel=1e-3)
    assert adv[3, 1] == pytest.approx(float(adv[3, 0]) / 2, rel=1e-3)  # the sync's 0.2 of the 0.4
    scalar = nft.prepare(scored, nft.NFTConfig()).optimality
    assert torch.equal(scalar[4:], torch.full((4,), 0.5))  # the scalar: no signal in group 1
    assert (adv[4:, 0] * adv[4:, 1] < 0).all() and adv[4:].abs().max() < 2


def test_nft_prepare_gives_r_per_modality() -> None:
    scored = scored_batch(BY, GROUPS)
    cfg = nft.NFTConfig(modality_credit=True, adv_clip=1.5)
    batch = nft.prepare(scored, cfg)
    want = nft.optimality(modality_advantages(scored, False), 1.5)
    assert torch.equal(batch.modality_optimality, want)
    assert batch.modality_split == SPLIT
    # without the key nothing per modality is made
    assert nft.prepare(scored, nft.NFTConfig()).modality_optimality is None


# --- DiffusionNFT's loss -------------------------------------------------------------------


class FlatPolicy:
    """Velocities over a flat (B, D) x under each adapter; records the default's inputs."""

    def __init__(self) -> None:
        self.w = torch.tensor(0.7, requires_grad=True)
        self.draws: list[tuple[Tensor, Tensor]] = []

    def velocity(self, x, sigma, input_ids, adapter="default", cond=None):
        if adapter == "default":
            self.draws.append((x.detach().clone(), sigma.detach().clone()))
            return self.w * x - 0.3 * sigma[:, None]
        return -0.2 * x + 0.5 + sigma[:, None] ** 2  # old


def nft_batch(r_m: Tensor) -> TrainBatch:
    n = len(r_m)
    x0 = torch.rand(n, D, generator=torch.Generator().manual_seed(3)) * 2 - 1
    return TrainBatch(
        input_ids=torch.ones(n, 5, dtype=torch.long),
        ids_hash=("h",) * n,
        x0=x0,
        seeds=torch.arange(n),
        optimality=r_m.mean(1),
        modality_optimality=r_m,
        modality_split=SPLIT,
    )


def single_modality_loss(policy, batch, k: int, beta: float, weighting: str) -> Tensor:
    """Independent: modality k's loss alone, the other modality's elements masked out of the
    error (zero), averaged over all D elements, weighted by that modality's r."""
    mask = torch.zeros(D, dtype=torch.bool)
    mask[: SPLIT[0]] = True
    if k == 1:
        mask = ~mask
    r = batch.modality_optimality[:, k]
    total = torch.zeros(())
    for x, sigma in policy.draws:
        x0 = batch.x0
        v = (x - (1 - sigma[:, None]) * x0) / sigma[:, None] - x0  # eps - x0
        v_theta = policy.w * x - 0.3 * sigma[:, None]
        v_old = -0.2 * x + 0.5 + sigma[:, None] ** 2
        errs = []
        for v_pm in (beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta):
            if weighting == "uniform":
                e = (v_pm - v) ** 2
            else:
                x0_hat = x - sigma[:, None] * v_pm
                scale = (x0_hat.detach() - x0).abs().mean(1).clamp(min=1e-5)
                e = (x0_hat - x0) ** 2 / scale[:, None]
            errs.append((e * mask).sum(1) / D)
        total = total + ((r * errs[0] + (1 - r) * errs[1]) / beta).mean()
    return total / len(policy.draws)


@pytest.mark.parametrize("weighting", ["adaptive", "uniform"])
def test_nft_loss_is_the_sum_of_two_single_modality_losses(weighting: str) -> None:
    r_m = torch.tensor([[0.9, 0.1], [0.2, 0.6], [0.5, 1.0]])
    batch, policy = nft_batch(r_m), FlatPolicy()
    cfg = nft.NFTConfig(modality_credit=True, weighting=weighting, beta=0.7)
    value, metrics = nft.loss(policy, batch, cfg, torch.Generator().manual_seed(5))
    (grad,) = torch.autograd.grad(value, policy.w)
    assert len(policy.draws) == cfg.timesteps_per_sample
    ref = sum(single_modality_loss(policy, batch, k, 0.7, weighting) for k in (0, 1))
    (ref_grad,) = torch.autograd.grad(ref, policy.w)
    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert metrics["nft/r_mean_video"] == pytest.approx(float(r_m[:, 0].mean()))

    # equal r for both modalities: the joint loss, as without the key
    same = nft_batch(torch.tensor([[0.9, 0.9], [0.2, 0.2], [0.5, 0.5]]))
    on, _ = nft.loss(FlatPolicy(), same, cfg, torch.Generator().manual_seed(5))
    off_cfg = nft.NFTConfig(weighting=weighting, beta=0.7)
    off, _ = nft.loss(FlatPolicy(), same, off_cfg, torch.Generator().manual_seed(5))
    torch.testing.assert_close(on, off, rtol=1e-6, atol=1e-7)


# --- FlowGRPO -------------------------------------------------------------------------------


class LinearPolicy:
    def __init__(self, w: float) -> None:
        self.w = torch.tensor(w, requires_grad=True)

    def velocity(self, x, sigma, ids, adapter="default", cond=None):
        return (self.w if adapter is not None else torch.tensor(0.5)) * x


def sde_rollout(policy: LinearPolicy, n: int, steps: int, split=None):
    """Trajectories over a flat latent sampled with the engine's step: sigmas, latents, the
    joint log-probs and, given ``split``, the per-modality ones as the rollout engine records."""
    g = torch.Generator().manual_seed(1)
    sig = sigma_schedule(steps)
    x = torch.randn(n, D, generator=g)
    lat, lps, lps_m = [x], [], []
    with torch.no_grad():
        for i in range(steps):
            v = policy.velocity(x, sig[i], None)
            noise = torch.randn(x.shape, generator=g)
            x, lp, mean, std = sde_step_with_logprob(
                x, v, sig[i], sig[i + 1], 0.7, float(sig[1]), noise=noise
            )
            lat.append(x)
            lps.append(lp)
            if split is not None:
                lps_m.append(modality_log_probs(x, mean, std, split))
    by = torch.stack(lps_m, 1) if split is not None else None
    return sig, torch.stack(lat, 1), torch.stack(lps, 1), by


def grpo_batch(policy: LinearPolicy, adv_m: Tensor, steps: int = 3) -> TrainBatch:
    sig, lat, lps, lps_m = sde_rollout(policy, len(adv_m), steps, SPLIT)
    n = len(adv_m)
    return TrainBatch(
        input_ids=torch.zeros(n, 2, dtype=torch.long),
        ids_hash=("",) * n,
        x0=lat[:, -1],
        advantages=adv_m.mean(1),
        modality_advantages=adv_m,
        seeds=torch.zeros(n, dtype=torch.long),
        latents=lat,
        log_probs=lps,
        sigmas=sig,
        sde_mask=torch.ones(steps, dtype=torch.bool),
        step_spec=StepSpec("flow_grpo", 0.7, 1.0, (1, 0)),
        modality_split=SPLIT,
        modality_log_probs=lps_m,
    )


def test_per_modality_log_probs_add_up_to_the_joint_one() -> None:
    batch = grpo_batch(LinearPolicy(0.9), torch.zeros(4, 2))
    lp_m, lp = batch.modality_log_probs, batch.log_probs
    joint = (SPLIT[0] * lp_m[..., 0] + SPLIT[1] * lp_m[..., 1]) / D
    torch.testing.assert_close(joint, lp, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(lp_m[..., 0], lp_m[..., 1])  # two different numbers


def test_grpo_with_equal_advantages_is_the_joint_loss() -> None:
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25])
    cfg_off = grpo.GRPOConfig(timestep_fraction=1.0, kl_coef=0.3, clip_range=10.0)
    cfg_on = replace(cfg_off, modality_credit=True)
    out = []
    for cfg in (cfg_on, cfg_off):
        policy = LinearPolicy(0.8)  # not the rollout's 0.9: ratios off 1, inside the clip
        batch = grpo_batch(LinearPolicy(0.9), adv[:, None].expand(-1, 2).clone())
        value, m = grpo.loss(policy, batch, cfg, torch.Generator().manual_seed(0))
        out.append((value, torch.autograd.grad(value, policy.w)[0], m))
    (v_on, g_on, m_on), (v_off, g_off, _) = out
    torch.testing.assert_close(g_on, g_off, rtol=1e-4, atol=1e-7)
    # the KL is a sum over elements: its per-modality shares add up to it
    torch.testing.assert_close(m_on["grpo/kl_video"] + m_on["grpo/kl_audio"], m_on["grpo/kl"])


def test_grpo_clips_each_modality_on_its_own() -> None:
    """The video's ratio pushed past the clip (A > 0): only the audio term has gradient."""
    adv_m = torch.tensor([[1.0, 0.5], [0.5, 1.0], [2.0, 1.0], [1.0, 1.0]])
    policy = LinearPolicy(0.9)
    batch = grpo_batch(LinearPolicy(0.9), adv_m, steps=2)
    lowered = batch.modality_log_probs.clone()
    lowered[..., 0] -= 1.0  # rollout video log-prob lower: rho_video = e > 1 + eps
    batch = TrainBatch(**{**batch.__dict__, "modality_log_probs": lowered})
    cfg = grpo.GRPOConfig(timestep_fraction=1.0, kl_coef=0.0, modality_credit=True)
    value, m = grpo.loss(policy, batch, cfg, torch.Generator().manual_seed(0))
    (grad,) = torch.autograd.grad(value, policy.w)
    assert m["grpo/clip_frac_video"] == 1.0 and m["grpo/clip_frac_audio"] == 0.0
    # independent: the audio's surrogate alone, -A_a rho_a weighed by its element share
    ref = torch.zeros(())
    for j in range(2):
        x, x_next = batch.latents[:, j], batch.latents[:, j + 1]
        sig = batch.sigmas
        v = policy.w * x
        _, _, mean, std = sde_step_with_logprob(
            x, v, sig[j], sig[j + 1], 0.7, float(sig[1]), x_next=x_next
        )
        lp_a = modality_log_probs(x_next, mean, std, SPLIT)[:, 1]
        rho = torch.exp(lp_a - batch.modality_log_probs[:, j, 1])
        ref = ref + (-adv_m[:, 1] * rho * SPLIT[1] / D).mean() / 2
    (ref_grad,) = torch.autograd.grad(ref, policy.w)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


# --- refusals and the default path ---------------------------------------------------------


def test_refused_without_two_modalities_and_by_dpo() -> None:
    from diffrl.models.families.tiny_dit import TinyDiTFamily

    image_only = TinyDiTFamily.__new__(TinyDiTFamily)
    with pytest.raises(ConfigError, match=r"algorithm\.modality_credit' = true: model family"):
        check_family(True, image_only)
    check_family(False, image_only)  # off: nothing to check
    with pytest.raises(ConfigError, match=r"algorithm\.modality_credit"):
        load_config("shapes_dpo.yaml", ["algorithm.modality_credit=true"])
    with pytest.raises(ConfigError, match=r"algorithm\.modality_std' = 'mean'"):
        load_config("shapes_nft.yaml", ["algorithm.modality_std=mean"])


# Golden values of the default path, computed on main before modality credit existed (commit
# 22ccd86): the NFT and FlowGRPO losses of the crafted batches above, bit for bit
GOLDEN = {
    "nft_adaptive": "0x1.06b5b80000000p+1",
    "nft_uniform": "0x1.48f4a60000000p+2",
    "grpo": "-0x1.e578b40000000p-5",
}


def default_losses() -> dict[str, str]:
    """The default path's losses on batches built from fields that predate modality credit
    (so the same function ran on main for ``GOLDEN``)."""
    r = torch.tensor([0.9, 0.2, 0.5])
    x0 = torch.rand(3, D, generator=torch.Generator().manual_seed(3)) * 2 - 1
    out = {}
    for weighting in ("adaptive", "uniform"):
        batch = TrainBatch(
            input_ids=torch.ones(3, 5, dtype=torch.long), ids_hash=("h",) * 3, x0=x0,
            seeds=torch.arange(3), optimality=r,
        )  # fmt: skip
        cfg = nft.NFTConfig(weighting=weighting, beta=0.7, kl_coef=0.1)
        value, _ = nft.loss(FlatPolicy(), batch, cfg, torch.Generator().manual_seed(5))
        out[f"nft_{weighting}"] = float(value.detach()).hex()
    sig, lat, lps, _ = sde_rollout(LinearPolicy(0.9), 4, 3)
    batch = TrainBatch(
        input_ids=torch.zeros(4, 2, dtype=torch.long), ids_hash=("",) * 4, x0=lat[:, -1],
        seeds=torch.zeros(4, dtype=torch.long), advantages=torch.tensor([1.0, -1.0, 0.5, -0.25]),
        latents=lat, log_probs=lps, sigmas=sig, sde_mask=torch.ones(3, dtype=torch.bool),
        step_spec=StepSpec("flow_grpo", 0.7, 1.0, (1, 0)),
    )  # fmt: skip
    cfg = grpo.GRPOConfig(clip_range=0.05)
    value, _ = grpo.loss(LinearPolicy(0.8), batch, cfg, torch.Generator().manual_seed(0))
    out["grpo"] = float(value.detach()).hex()
    return out


def test_default_path_numbers_are_unchanged() -> None:
    assert default_losses() == GOLDEN
