"""``diffrl pretrain``: flow-matching pre-training of the tiny DiT on a task's renderer.

Loss: E ||v_theta(x_sigma, sigma, c) - (eps - x0)||^2 with x_sigma = (1-sigma) x0 + sigma eps,
sigma from a logit-normal (SD3), text dropped to "<null>" with probability ``text_dropout``
(so classifier-free guidance is available). Only the *train* prompt split is seen; the budget
is chosen so the base model is clearly imperfect on held-out prompts, leaving RL headroom.
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm import tqdm

from diffrl.data.shapes import ShapesPrompt, all_prompts, render, split_prompts
from diffrl.data.tokenizer import WordTokenizer
from diffrl.errors import ConfigError, check
from diffrl.models.convention import noised
from diffrl.models.families.tiny_dit import BUILTIN, build, save_model
from diffrl.models.family import FamilyModel
from diffrl.models.registry import BUILTIN_WEIGHTS, ModelConfig, load_model, save_weights
from diffrl.models.tiny_dit import TinyDiTConfig
from diffrl.tasks import Prompt, PromptSet
from diffrl.types import images_from_uint8


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
    # binding is hard to learn (benchmarks/BENCHMARKS.md, colour binding)
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
    # h3-avbench unless set, written to builtin:avbench_h3; diffrl/models/pretrain_av.py)
    task: str = "shapes"
    cond_prob: float = 0.5  # avbench: share of chunks conditioned on their first/last frames
    chunk: int = 32  # avbench: clips per transformer call (one sigma each)
    # avbench: weight of the audio latent's dims in the loss against the video's (1 = the plain
    # mean over all dims); AVBench's beeps fill ~0.3% of the audio dims, so the plain mean barely
    # sees them (benchmarks/BENCHMARKS.md, the AVBench base)
    audio_weight: float = 1.0
    # start from these weights instead of a random init ("" = random): a .safetensors written by
    # an earlier `diffrl pretrain` or a built-in (builtin:avbench_h3, ...). The optimizer, LR
    # schedule and EMA start afresh; the file's metadata records the init
    init: str = ""

    def validate(self) -> None:
        check(self.task in ("shapes", "avbench"), "task", self.task, "shapes | avbench")
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
    from diffrl.config import mergeable_schema, validate_tree

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


def near_misses(prompt: ShapesPrompt) -> list[ShapesPrompt]:
    """Prompts of the same category whose text differs from ``prompt`` in exactly one word."""
    words = prompt.text.split()
    return [
        q
        for q in all_prompts()
        if q.category == prompt.category
        and q != prompt
        and len(qw := q.text.split()) == len(words)
        and sum(a != b for a, b in zip(words, qw, strict=True)) == 1
    ]


def _render_many(args) -> np.ndarray:
    prompt, n, seed, noise = args
    rng = np.random.default_rng(seed)
    misses = near_misses(prompt) if noise > 0 else []
    drawn = [
        misses[rng.integers(len(misses))] if misses and rng.random() < noise else prompt
        for _ in range(n)
    ]
    return np.stack([render(p, rng) for p in drawn])


def render_bank(
    prompts, per_prompt: int, seed: int, workers: int, caption_noise: float = 0.0
) -> torch.Tensor:
    """(len(prompts), per_prompt, H, W, 3) uint8 images for each caption, rendered in parallel
    once so the training loop is not bound by the (CPU) renderer."""
    jobs = [(p, per_prompt, seed * 100_003 + i, caption_noise) for i, p in enumerate(prompts)]
    workers = workers or os.cpu_count() or 1
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(_render_many, jobs, chunksize=4))
    else:
        parts = [_render_many(j) for j in jobs]
    return torch.from_numpy(np.stack(parts))


def pretrain(cfg: PretrainConfig) -> Path:
    from diffrl.controller.engines import pick_device

    if cfg.task == "avbench":
        from diffrl.models.pretrain_av import pretrain_avbench

        return pretrain_avbench(cfg)

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    device = pick_device(cfg.device)
    tok = WordTokenizer()
    shapes = split_prompts("train")
    arch = TinyDiTConfig(
        hidden=cfg.hidden,
        depth=cfg.depth,
        heads=cfg.heads,
        patch=cfg.patch,
        vocab_size=tok.vocab_size,
        max_text_len=tok.max_len,
    )
    if cfg.preset:  # seeded random init; the frozen text encoders are saved with the weights
        model = load_model(ModelConfig(preset=cfg.preset, weights=cfg.init, probe=False), device)
    elif cfg.init:
        model = load_model(ModelConfig(checkpoint=cfg.init, probe=False), device)
    else:
        model = build(arch).to(device)
        if cfg.text_embed_std:
            torch.nn.init.normal_(model.net.tok_emb.weight, std=cfg.text_embed_std)
    train = PromptSet([Prompt(p.text) for p in shapes], model.family.tokenize)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, cfg.warmup, cfg.schedule_steps or cfg.steps)
    )
    ema_params, params = list(ema.parameters()), list(model.parameters())
    bank = render_bank(shapes, cfg.bank_per_prompt, cfg.seed, cfg.workers, cfg.caption_noise)
    null = model.family.null_ids()[None]
    t0 = time.time()
    bar = tqdm(range(cfg.steps), desc="pretrain")
    for step in bar:
        idx = rng.integers(0, len(train), cfg.batch)
        pick = rng.integers(0, cfg.bank_per_prompt, cfg.batch)
        x0 = model.family.encode_pixels(images_from_uint8(bank[idx, pick]).to(device))
        ids = train.input_ids[idx].clone()
        drop = torch.from_numpy(rng.random(cfg.batch) < cfg.text_dropout)
        ids[drop] = null
        sigma = torch.sigmoid(torch.randn(cfg.batch)).to(device)  # logit-normal(0, 1)
        eps = torch.randn_like(x0)
        loss = (model(noised(x0, sigma, eps), sigma, ids.to(device)) - (eps - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        optimizer_step(opt, sched, params, ema_params, step, cfg.ema)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if step + 1 in cfg.snapshots and step + 1 != cfg.steps:
            out = output_path(cfg)
            save_and_score(
                ema,
                out.with_name(f"{out.stem}_step{step + 1}{out.suffix}"),
                cfg,
                step + 1,
                time.time() - t0,
            )
    return save_and_score(ema, output_path(cfg), cfg, cfg.steps, time.time() - t0)


def output_path(cfg: PretrainConfig) -> Path:
    if cfg.out:
        return Path(cfg.out)
    return BUILTIN_WEIGHTS["builtin:shapes_sd3"] if cfg.preset else BUILTIN["builtin:shapes_dit"]


def save_and_score(
    model: FamilyModel, out: Path, cfg: PretrainConfig, steps: int, seconds: float
) -> Path:
    """Save, evaluate on held-out prompts, and store the score in the file's metadata."""
    meta = {
        "pretrain_steps": str(steps),
        "pretrain_s": f"{seconds:.0f}",
        "pretrain_batch": str(cfg.batch),
        "caption_noise": str(cfg.caption_noise),
        "text_embed_std": str(cfg.text_embed_std),
        "init": cfg.init,
    }
    save = (
        (lambda m, o, x: save_weights(m, o, {"preset": cfg.preset, **x}))
        if cfg.preset
        else save_model
    )
    save(model, out, meta)
    metrics = evaluate_checkpoint(str(out), cfg.eval_samples, 10, cfg.device, preset=cfg.preset)
    save(model, out, {**meta, "shapes_eval": str({k: round(v, 4) for k, v in metrics.items()})})
    print(f"[{out.name}] steps={steps} " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
    return out


def evaluate_checkpoint(
    checkpoint: str,
    samples_per_prompt: int = 2,
    num_steps: int = 10,
    device: str = "auto",
    seed: int = 1234,
    preset: str = "",
) -> dict[str, float]:
    """Held-out ShapesBench accuracy of a base checkpoint (no adapters): a tiny-DiT file, or
    with ``preset`` a ``model.weights`` file of that preset."""
    from diffrl.controller.engines import pick_device

    dev = pick_device(device)
    mcfg = (
        ModelConfig(preset=preset, weights=checkpoint)
        if preset
        else ModelConfig(checkpoint=checkpoint)
    )
    return held_out_metrics(load_model(mcfg, dev), "shapes", samples_per_prompt, num_steps, seed)


def held_out_metrics(
    model: FamilyModel, task_name: str, samples_per_prompt: int, num_steps: int, seed: int
) -> dict[str, float]:
    """A base model's (no adapters) held-out metrics on ``task_name``, sampled by the rollout
    engine with ODE steps from the data stage's prompt set, as a run's eval samples them."""
    from diffrl.controller.engines import prompt_set
    from diffrl.rollout.engine import RolloutConfig, RolloutEngine
    from diffrl.tasks import TaskConfig, build_task

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
