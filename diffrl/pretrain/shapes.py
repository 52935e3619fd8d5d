"""``diffrl pretrain task=shapes``: flow-matching pre-training of the ShapesBench base (the tiny
DiT, or a diffusers preset such as sd3-shapes) on the task's renderer.

Loss: E ||v_theta(x_sigma, sigma, c) - (eps - x0)||^2 with x_sigma = (1-sigma) x0 + sigma eps,
sigma from a logit-normal (SD3), text dropped to "<null>" with probability ``text_dropout``
(so classifier-free guidance is available). Only the *train* prompt split is seen; the budget
is chosen so the base model is clearly imperfect on held-out prompts, leaving RL headroom.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from tqdm import tqdm

from diffrl.build import pick_device
from diffrl.models.convention import noised
from diffrl.models.families.tiny_dit import build, save_model
from diffrl.models.family import FamilyModel
from diffrl.models.registry import ModelConfig, builtin_path, load_model, save_weights
from diffrl.models.tiny_dit import TinyDiTConfig
from diffrl.pretrain.common import (
    PretrainConfig,
    held_out_metrics,
    optimizer_step,
    start_process,
    warmup_cosine,
)
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.bank import render_bank
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.tokenizer import WordTokenizer
from diffrl.types import images_from_uint8


def pretrain_shapes(cfg: PretrainConfig) -> Path:
    rng, device = start_process(cfg)
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
        model = load_model(ModelConfig(preset=cfg.preset, weights=cfg.init), device)
    elif cfg.init:
        model = load_model(ModelConfig(checkpoint=cfg.init), device)
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
    return builtin_path("builtin:shapes_sd3" if cfg.preset else "builtin:shapes_dit")


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
    dev = pick_device(device)
    mcfg = (
        ModelConfig(preset=preset, weights=checkpoint)
        if preset
        else ModelConfig(checkpoint=checkpoint)
    )
    return held_out_metrics(load_model(mcfg, dev), "shapes", samples_per_prompt, num_steps, seed)
