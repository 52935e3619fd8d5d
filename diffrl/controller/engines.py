"""Assemble the engines from a config (shared by the controllers and the CLI)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch

from diffrl.actor.engine import ActorConfig, ActorEngine
from diffrl.algorithms.registry import Algorithm, get_algorithm
from diffrl.config import Config
from diffrl.data.prompts import PromptSet, PromptSource, build_data
from diffrl.data.shapes import render, split_prompts
from diffrl.data.tokenizer import WordTokenizer
from diffrl.errors import ConfigError
from diffrl.models.convention import ProbeReport, probe_convention
from diffrl.models.registry import load_model, lora_targets
from diffrl.reward.pool import RewardPool
from diffrl.rollout.engine import RolloutEngine
from diffrl.types import images_from_uint8


@dataclass
class Parts:
    cfg: Config
    device: torch.device
    tokenizer: WordTokenizer
    prompts: PromptSource
    eval_set: PromptSet
    rollout: RolloutEngine
    evaluator: RolloutEngine  # samples with the trained adapter for held-out eval
    rewards: RewardPool
    actor: ActorEngine
    algorithm: Algorithm
    probe: ProbeReport | None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"config key 'run.device' = {name!r}: CUDA is not available here")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def probe_data(tok: WordTokenizer, n: int = 16, seed: int = 0):
    """Renderer ground truth for the convention probe: x0 (n,3,H,W) in [-1,1] and ids."""
    rng = np.random.default_rng(seed)
    prompts = split_prompts("train")[:n]
    x0 = images_from_uint8(torch.from_numpy(np.stack([render(p, rng) for p in prompts])))
    return x0, tok.encode([p.text for p in prompts])


def build(cfg: Config) -> Parts:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    device = pick_device(cfg.run.device)
    tok, source, eval_set = build_data(cfg.data, cfg.run.seed)
    base = load_model(cfg.model, device)
    if base.net.cfg.vocab_size < tok.vocab_size:
        raise ConfigError(
            f"model vocab ({base.net.cfg.vocab_size}) is smaller than the "
            f"tokenizer's ({tok.vocab_size})"
        )
    probe = None
    if cfg.model.probe:
        x0, ids = probe_data(tok)
        probe = probe_convention(base, x0.to(device, next(base.parameters()).dtype), ids.to(device))
    targets = list(cfg.actor.lora.targets) or list(lora_targets(cfg.model.family))
    algorithm = get_algorithm(cfg.algorithm.name)
    check_rollout_for(algorithm, cfg)
    rollout_targets = _expanded_targets(base, targets)
    rollout = RolloutEngine(base, cfg.rollout, rollout_targets, tok.null_id, device)
    # held-out eval measures the policy itself: its own guidance, full precision, and independent
    # initial noise for every sample even when the rollout shares it within a group (DanceGRPO)
    eval_rollout = dataclasses.replace(
        cfg.rollout,
        cfg_scale=cfg.rollout.eval_cfg_scale,
        shared_init_noise=False,
        antithetic_noise=False,
        tree_noise=False,
        ode_dtype="float32",
    )
    evaluator = RolloutEngine(base, eval_rollout, rollout_targets, tok.null_id, device)
    rewards = RewardPool(cfg.reward)
    rewards.check_inputs(produced=set(rollout.produces))
    actor_cfg = actor_with_horizon(cfg)
    actor = ActorEngine(base, actor_cfg, targets, algorithm, cfg.algorithm, device, cfg.run.seed)
    return Parts(
        cfg, device, tok, source, eval_set, rollout, evaluator, rewards, actor, algorithm, probe
    )


def actor_with_horizon(cfg: Config) -> ActorConfig:
    """``actor.lr_horizon`` = 0 decays the learning rate over the whole run: run.steps RL steps
    of ``actor.minibatches`` optimizer steps each."""
    actor = cfg.actor
    if actor.lr_schedule == "constant" or actor.lr_horizon:
        return actor
    horizon = cfg.run.steps * actor.minibatches
    if horizon and actor.lr_warmup >= horizon:
        raise ConfigError(
            f"config key 'actor.lr_warmup' = {actor.lr_warmup}: must be < the schedule's "
            f"horizon, run.steps x actor.minibatches = {horizon} (or set actor.lr_horizon)"
        )
    return dataclasses.replace(actor, lr_horizon=horizon)


def check_rollout_for(algorithm: Algorithm, cfg: Config) -> None:
    """An algorithm that trains on per-step log-probs needs stochastic, kept trajectories; one
    that trains on the final samples must not get them from a coarse ODE tail."""
    if not algorithm.needs_logprobs:
        if cfg.rollout.ode_tail_steps:
            raise ConfigError(
                f"config key 'rollout.ode_tail_steps' = {cfg.rollout.ode_tail_steps}: "
                f"{algorithm.name} trains on the final samples, so a coarse ODE tail would train "
                "it on rougher images; the option is for the GRPO family (set it to 0)"
            )
        return
    r, name = cfg.rollout, algorithm.name
    for key, ok, want in (
        ("rollout.sampler", r.sampler == "sde", "sde"),
        ("rollout.keep_latents", r.keep_latents, "true"),
        ("rollout.noise_level", r.noise_level > 0, "> 0"),
    ):
        if not ok:
            value = getattr(r, key.split(".")[1])
            raise ConfigError(
                f"config key '{key}' = {value!r}: {name} trains on per-step log-probs of "
                f"stochastic trajectories; set {key}={want}"
            )


def _expanded_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """Suffix targets ("attn.qkv") -> the full module names the rollout must receive."""
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in targets)
    ]
    if not names:
        raise ConfigError(f"LoRA targets {targets} match no Linear module of the model")
    return names
