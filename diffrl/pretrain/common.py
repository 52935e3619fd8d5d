"""What both pre-training recipes share: the ``diffrl pretrain`` config, its loader, the LR
schedule, the optimizer+EMA step, and the held-out evaluation of a base model."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from diffrl.build import pick_device, prompt_set
from diffrl.config import mergeable_schema, validate_tree
from diffrl.errors import ConfigError, check
from diffrl.models.family import FamilyModel
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import TaskConfig, build_task


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 9000  # the shipped base: 9000 x 256 on one H200 (~3 min alone)
    schedule_steps: int = 12000  # length of the cosine LR schedule (0 = steps); the shipped
    # base is the step-9000 point of a 12000-step schedule, deliberately stopped early
    batch: int = 256
    lr: float = 1e-3
    warmup: int = 200
    ema: float = 0.999
    text_dropout: float = 0.1
    # std of the tiny DiT's token-embedding init; 0 = nn.Embedding's N(0, 1), which the shipped
    # base used. At N(0, 1) a token's embedding (norm ~11 at width 128) dwarfs its position's
    # (init std 0.02), so the text reaches the blocks nearly as a bag of words and colour-shape
    # binding is hard to learn
    text_embed_std: float = 0.0
    hidden: int = 128
    depth: int = 6
    heads: int = 4
    patch: int = 4
    seed: int = 0
    device: str = "auto"
    threads: int = 0
    eval_samples: int = 4  # per held-out prompt, for the score stored with the checkpoint
    # fraction of training images drawn for a near-miss prompt (one word changed: count,
    # colour, shape or position) while keeping the original caption, like loosely captioned
    # web data: the base model learns image quality but follows prompts only partly.
    caption_noise: float = 0.0
    bank_per_prompt: int = 128  # ground-truth renders per train prompt, drawn once up front
    workers: int = 0  # processes rendering the bank; 0 = all cores
    snapshots: list[int] = field(default_factory=list)  # also save+eval at these steps
    out: str = ""  # "" = the built-in base of the model below (what the package ships)
    # "" = the tiny DiT (the fields above set its size); else a diffusers-family preset built with
    # seeded random weights and pre-trained through that family's adapter, e.g. sd3-shapes
    preset: str = ""
    # "shapes" (the tiny DiT or `preset` on ShapesBench) | "avbench" (the AVBench base: preset
    # h3-avbench unless set, written to builtin:avbench_h3; diffrl/pretrain/avbench.py)
    task: str = "shapes"
    cond_prob: float = 0.5  # avbench: share of chunks conditioned on their first/last frames
    chunk: int = 32  # avbench: clips per transformer call (one sigma each)
    # avbench: weight of the audio latent's dims in the loss against the video's (1 = the plain
    # mean over all dims); AVBench's beeps fill ~0.3% of the audio dims, so the plain mean barely
    # sees them
    audio_weight: float = 1.0
    # start from these weights instead of a random init ("" = random): a .safetensors written by
    # an earlier `diffrl pretrain` or a built-in (builtin:avbench_h3, ...). The optimizer, LR
    # schedule and EMA start afresh; the file's metadata records the init
    init: str = ""

    def validate(self) -> None:
        tasks = ("shapes", "avbench", "shapes_qa")
        check(self.task in tasks, "task", self.task, " | ".join(tasks))
        check(0 <= self.cond_prob <= 1, "cond_prob", self.cond_prob, "in [0, 1]")
        check(self.chunk >= 1, "chunk", self.chunk, "must be >= 1")
        check(self.audio_weight > 0, "audio_weight", self.audio_weight, "must be > 0")
        check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        check(self.batch >= 1, "batch", self.batch, "must be >= 1")
        check(self.text_embed_std >= 0, "text_embed_std", self.text_embed_std, "must be >= 0")
        fresh_tiny_dit = not (self.preset or self.init)
        check(
            not self.text_embed_std or fresh_tiny_dit,
            "text_embed_std",
            self.text_embed_std,
            "sets a fresh tiny DiT's init: leave it 0 with init= or preset=",
        )
        check(0 <= self.text_dropout < 1, "text_dropout", self.text_dropout, "in [0, 1)")
        check(0 <= self.caption_noise < 1, "caption_noise", self.caption_noise, "in [0, 1)")


def load_pretrain_config(overrides: list[str]) -> PretrainConfig:
    try:
        schema = mergeable_schema(PretrainConfig)
        merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(overrides))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"pretrain: {e}") from None
    validate_tree(cfg)
    return cfg


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up, then cosine decay to ``floor``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_step(opt, sched, params: list, ema_params: list, step: int, ema: float) -> None:
    """Clip the gradient to norm 1, step optimizer and schedule, and move the EMA copy
    (decay warmed up as min(ema, (1 + step) / (10 + step)))."""
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    decay = min(ema, (1 + step) / (10 + step))
    with torch.no_grad():
        torch._foreach_lerp_(ema_params, params, 1 - decay)


def held_out_metrics(
    model: FamilyModel, task_name: str, samples_per_prompt: int, num_steps: int, seed: int
) -> dict[str, float]:
    """A base model's (no adapters) held-out metrics on ``task_name``, sampled by the rollout
    engine with ODE steps from the data stage's prompt set, as a run's eval samples them."""
    device = next(model.parameters()).device
    engine = RolloutEngine(model, RolloutConfig(), [], device)
    task = build_task(TaskConfig(task=task_name))
    eval_set = prompt_set(task, model, task.prompts("test"))

    async def run():
        traj = await engine.generate(
            eval_set.all(), seed, group_size=samples_per_prompt, sampler="ode", num_steps=num_steps
        )
        return (await task.evaluate(traj)).metrics

    return asyncio.run(run())


def start_process(cfg: PretrainConfig) -> tuple[np.random.Generator, torch.device]:
    """Threads and seeds as the config says; returns the data RNG and the device."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    return np.random.default_rng(cfg.seed), pick_device(cfg.device)
