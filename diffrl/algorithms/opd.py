"""On-policy distillation to a teacher (DiffusionOPD: "A Unified Perspective of On-Policy
Distillation in Diffusion Models", arXiv:2605.15055; verl-omni's "diffusion OPD").

The student (the policy) samples; at the states x_j its own trajectory visited, the frozen
teacher's velocity is the target. With d = v_S(x_j, sigma_j) - v_T(x_j, sigma_j), mean over
dimensions, for a trained step j of each sample:

    v   (velocity):         L = ||d||^2
    x0  (clean estimate):   L = sigma_j^2 ||d||^2                 (x0_hat = x - sigma v)
    xt  (ODE step's mean):  L = (sigma_{j+1} - sigma_j)^2 ||d||^2  (mu = x + v d_sigma)
    kl  (SDE step's KL):    L = KL(N(mu_S, std^2) || N(mu_T, std^2)) = ||mu_S - mu_T||^2 / (2 std^2)

with mu = x + [v + s^2 / (2 sigma) (x + (1 - sigma) v)] d_sigma and std = s sqrt(-d_sigma)
(FlowGRPO's step, the rollout's own: ``rollout.sampler=sde``, its SDE steps only). Steps are
drawn from the first ``timestep_fraction`` of the trajectory's steps, ``steps_per_sample`` per
sample per update. No reward enters the loss (the reward pool still scores, for the logs).

The teacher is a model of its own, ``algorithm.teacher`` (a model config: the tiny DiT's
``checkpoint``, or a diffusers family's local ``path`` / ``preset`` + ``weights``), plus
optionally ``algorithm.teacher_lora``, a LoRA file as ``diffrl export`` writes it (the scale
folded into B) merged into its weights: so an RL'd run's checkpoint can teach a fresh student.
It loads from local files only (never a hub name), once per process, on the actor's device, in
``teacher.dtype``; it is frozen (no gradients, no optimizer state, eval mode) and its bytes are
the ``opd/teacher_mib`` metric. It is a second copy of the network in the actor's memory: the
run's "tensors held after the first update" line counts it (it loads in that update; the
tiny DiT's: 38.8 MiB for NFT, 46.2 for OPD, the teacher's 7.1 among the parameters), while
``diffrl plan``'s estimate does not add it yet. The
teacher must share the student's latent shape and tokenizer (the same ``input_ids``).

What the reference does that diffrl does differently:
- Its teachers are LoRA adapters on the student's own base, swapped in per teacher, several
  teachers routed by dataset; diffrl's teacher is one whole model (any weights of the family,
  LoRA merged), which costs a second copy of the network but lets the student's base differ.
- It labels every sample's states in a no-grad first pass; diffrl runs the teacher beside the
  student at each trained step (the same numbers, one pass).
- Its ``xt`` target under an SDE divides by the transition variance; here that is ``kl``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from diffrl.algorithms.registry import (
    Algorithm,
    AlgorithmConfig,
    Backward,
    Metrics,
    Policy,
    Setup,
    TrainCost,
    WeightPlan,
    add_part,
    register_algorithm,
)
from diffrl.errors import ConfigError, check, check_choice
from diffrl.models.family import FamilyModel
from diffrl.models.registry import ModelConfig, load_model
from diffrl.rollout.samplers import sde_mean, sde_std
from diffrl.types import ScoredBatch, TrainBatch, host_to_device, train_batch

log = logging.getLogger(__name__)
TARGETS = ("v", "x0", "xt", "kl")


@dataclass(frozen=True)
class OPDConfig(AlgorithmConfig):
    name: str = "opd"
    # the teacher: a model config of its own (the family's loader; local files only)
    teacher: ModelConfig = field(default_factory=ModelConfig)
    teacher_lora: str = ""  # a `diffrl export` LoRA file merged into the teacher ("" = none)
    target: str = "v"  # what is matched: v | x0 | xt | kl (see the docstring)
    timestep_fraction: float = 0.99  # distill the first fraction of the trajectory's steps
    steps_per_sample: int = 2  # trajectory steps trained per sample per update

    def validate(self) -> None:
        check_choice("target", self.target, TARGETS)
        check(
            0 < self.timestep_fraction <= 1,
            "timestep_fraction",
            self.timestep_fraction,
            "must be in (0, 1]",
        )
        check(self.steps_per_sample >= 1, "steps_per_sample", self.steps_per_sample, "must be >= 1")
        check(
            not self.teacher.path or Path(self.teacher.path).is_dir(),
            "teacher.path",
            self.teacher.path,
            "must be a local diffusers directory (the teacher loads from local files only)",
        )
        check(
            not self.modality_credit,
            "modality_credit",
            self.modality_credit,
            "opd distils whole samples and trains on no reward; set it false",
        )


@dataclass(frozen=True)
class Distillation(Algorithm[OPDConfig]):
    """What OPD needs of the rollout, beyond every algorithm's rules: the student's states
    (``keep_latents``), and for the ``kl`` target stochastic steps."""

    def validate(self, cfg: Setup) -> None:
        super().validate(cfg)
        r, algo = cfg.rollout, cfg.algorithm
        if not r.keep_latents:
            raise ConfigError(
                f"config key 'rollout.keep_latents' = {r.keep_latents}: opd trains on the states "
                "the student's trajectory visited; set rollout.keep_latents=true"
            )
        if isinstance(algo, OPDConfig) and algo.target == "kl":
            for key, ok, want in (
                ("sampler", r.sampler == "sde", "sde"),
                ("noise_level", r.noise_level > 0, "> 0"),
            ):
                if not ok:
                    raise ConfigError(
                        f"config key 'rollout.{key}' = {getattr(r, key)!r}: algorithm.target=kl "
                        f"matches stochastic steps' Gaussians; set rollout.{key}={want} (or "
                        "algorithm.target=v)"
                    )


# --- the teacher --------------------------------------------------------------------------
_TEACHER: dict[tuple, FamilyModel] = {}  # the loaded teacher, by (config, lora, device)


def teacher_model(cfg: OPDConfig, device: torch.device) -> FamilyModel:
    """The frozen teacher on ``device``, loaded on first use and kept for the process."""
    key = (cfg.teacher, cfg.teacher_lora, str(device))
    if key not in _TEACHER:
        _TEACHER.clear()  # one teacher at a time
        model = load_model(cfg.teacher, device)
        if cfg.teacher_lora:
            merge_lora(model, cfg.teacher_lora)
        model.requires_grad_(False).eval()
        _TEACHER[key] = model
        log.info(
            "opd teacher %s%s: %.1f MiB frozen on %s",
            cfg.teacher.checkpoint if cfg.teacher.resolved_family == "tiny_dit" else cfg.teacher,
            f" + {cfg.teacher_lora}" if cfg.teacher_lora else "",
            model_mib(model),
            device,
        )
    return _TEACHER[key]


def model_mib(model: torch.nn.Module) -> float:
    """The bytes a model's parameters and buffers hold, in MiB."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


@torch.no_grad()
def merge_lora(model: FamilyModel, spec: str) -> int:
    """W <- W + B @ A for each (``<module>.lora_A.weight``, ``<module>.lora_B.weight``) of a
    ``diffrl export`` file (scale folded into B); module names are the model's, or its net's.
    Returns the number of layers merged; refuses a file that matches no layer, or only some."""
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"config key 'algorithm.teacher_lora' = {spec!r}: no file there (write one with "
            "`diffrl export RUN --out DIR`: DIR/pytorch_lora_weights.safetensors)"
        )
    state = load_file(str(path))
    modules = {name: m for name, m in model.named_modules()}
    net = {name: m for name, m in model.net.named_modules()}
    names = sorted({k.rsplit(".lora_", 1)[0] for k in state if ".lora_" in k})
    missing = [n for n in names if n not in modules and n not in net]
    if not names or missing or len(state) != 2 * len(names):
        raise ConfigError(
            f"config key 'algorithm.teacher_lora' = {spec!r}: not a LoRA of the teacher "
            f"({len(names)} layers; not in the teacher: {missing[:3]})"
        )
    for name in names:
        layer = modules.get(name, net.get(name))
        a, b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        weight = layer.weight  # type: ignore[union-attr]
        if (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise ConfigError(
                f"config key 'algorithm.teacher_lora' = {spec!r}: {name} is {tuple(weight.shape)} "
                f"in the teacher, the LoRA's delta {(b.shape[0], a.shape[1])}"
            )
        weight += (b.float() @ a.float()).to(weight)
    return len(names)


# --- the loss -----------------------------------------------------------------------------
def prepare(scored: ScoredBatch, cfg: OPDConfig) -> TrainBatch:
    """Every sample (no reward is needed: a failed scorer leaves the sample trainable)."""
    if scored.traj.latents is None:
        raise ValueError("opd trains on the student's states: set rollout.keep_latents=true")
    return train_batch(scored)


def trained_steps(batch: int, candidates: Tensor, k: int, gen: torch.Generator) -> Tensor:
    """(batch, k') step indices per sample, k' = min(k, len(candidates)), drawn without
    replacement from ``candidates`` (in step order within a sample)."""
    k = min(k, len(candidates))
    draws = [torch.randperm(len(candidates), generator=gen)[:k].sort().values for _ in range(batch)]
    return candidates[torch.stack(draws)]


def distill_error(
    v_s: Tensor,
    v_t: Tensor,
    x: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    target: str,
    noise_level: float = 0.0,
    sigma_cap: float = 0.0,
) -> Tensor:
    """(B,) the per-sample distillation loss of one step (mean over dimensions)."""
    if target == "kl":
        s = sde_std(sigma, noise_level, sigma_cap).to(x)
        gap = sde_mean(x, v_s, sigma, sigma_next, s) - sde_mean(x, v_t, sigma, sigma_next, s)
        var = s.pow(2) * (sigma - sigma_next).to(x)  # std^2 of the step, per sample
        return gap.pow(2).flatten(1).mean(1) / (2 * var)
    err = (v_s - v_t).pow(2).flatten(1).mean(1)
    if target == "x0":
        return sigma.to(x).pow(2) * err
    if target == "xt":
        return (sigma_next - sigma).to(x).pow(2) * err
    return err


def loss(
    policy: Policy,
    batch: TrainBatch,
    cfg: OPDConfig,
    gen: torch.Generator,
    backward: Backward | None = None,
) -> tuple[Tensor, Metrics]:
    x, sigmas = batch.latents, batch.sigmas
    assert x is not None and sigmas is not None, "prepare keeps the student's states"
    device, n_steps = x.device, len(sigmas) - 1
    teacher = teacher_model(cfg, device)
    if tuple(teacher.family.latent_shape()) != tuple(x.shape[2:]):
        raise ConfigError(
            f"config key 'algorithm.teacher': its latents are {teacher.family.latent_shape()}, "
            f"the student's {tuple(x.shape[2:])}; the teacher must share the student's latent space"
        )
    noise_level, cap = 0.0, float(sigmas[1])
    candidates = torch.arange(max(1, round(cfg.timestep_fraction * n_steps)))
    if cfg.target == "kl":
        spec, mask = batch.step_spec, batch.sde_mask
        if spec is None or mask is None or spec.kind != "flow_grpo":
            raise ValueError("algorithm.target=kl matches FlowGRPO SDE steps (rollout.sde_step)")
        noise_level = spec.noise_level
        candidates = candidates[mask[: len(candidates)].cpu()]
    steps = trained_steps(len(x), candidates, cfg.steps_per_sample, gen)  # (B, k)
    sig = host_to_device(sigmas, device, x.dtype)
    rows = torch.arange(len(x), device=device)
    ids, cond = batch.input_ids, batch.cond
    teacher_ids = ids.to(teacher.ids_device(device))
    total = x.new_zeros(())
    metrics: Metrics = {"opd/teacher_mib": model_mib(teacher)}
    k = steps.shape[1]
    for i in range(k):
        j = host_to_device(steps[:, i], device)
        x_t, sigma, sigma_next = x[rows, j], sig[j], sig[j + 1]
        v_s = policy.velocity(x_t, sigma, ids, cond=cond)
        with torch.no_grad():
            v_t = teacher(x_t, sigma, teacher_ids, cond).to(v_s.dtype)
        per = distill_error(v_s, v_t, x_t, sigma, sigma_next, cfg.target, noise_level, cap)
        total = add_part(total, per.mean() / k, backward)
        gap = (v_s.detach() - v_t).pow(2).flatten(1).mean(1).mean()
        metrics["opd/v_gap"] = metrics.get("opd/v_gap", 0.0) + gap / k
    return total, metrics


def train_cost(cfg: OPDConfig, batch: TrainBatch) -> TrainCost:
    """Per trained step: the student's forward and backward and the teacher's forward (one
    student forward's worth when the teacher is the same network; more for a larger one)."""
    k = cfg.steps_per_sample
    return TrainCost(forwards=2 * k, backwards=k)


def weight_plan(step: int, cfg: OPDConfig) -> WeightPlan:
    """On policy: the student samples with its current weights, synced every update."""
    return WeightPlan("default")


ALGORITHM = register_algorithm(
    Distillation(
        name="opd",
        config_cls=OPDConfig,
        prepare=prepare,
        loss=loss,
        weight_plan=weight_plan,
        train_cost=train_cost,
        needs_logprobs=False,
        partial_backward=True,
        needs_groups=False,  # each sample is distilled alone
    )
)
