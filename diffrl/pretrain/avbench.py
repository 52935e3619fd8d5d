"""``diffrl pretrain task=avbench``: flow-matching pre-training of the AVBench base, a tiny
``MiniMaxH3Transformer3DModel`` (preset ``h3-avbench``), on AVBench's ground-truth clips.

One model serves both modes: each batch is split in chunks, and a chunk is conditioned on its
clips' own first and last frames (FL2VA) with probability ``cond_prob``, else text only (T2VA).
Loss: E ||v(x_sigma, sigma, c) - (eps - x0)||^2 on the joint (video, canonical audio) latent,
sigma logit-normal. H3's transformer shares one timestep table across its batch axis, so
every chunk of ``chunk`` clips takes one sigma (the net would otherwise run one call per clip).
Only the train split is seen; the budget leaves the base clearly imperfect on held-out prompts.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from tqdm import tqdm

from diffrl.build import pick_device
from diffrl.models.convention import noised
from diffrl.models.family import FamilyModel
from diffrl.models.registry import ModelConfig, builtin_path, load_model, save_weights
from diffrl.pretrain.common import (
    PretrainConfig,
    held_out_metrics,
    optimizer_step,
    start_process,
    warmup_cosine,
)
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.avbench import ClipSpec, render_batch, split_prompts

DEFAULT_PRESET = "h3-avbench"


def clip_bank(model: FamilyModel, per_prompt: int, seed: int, device) -> tuple:
    """Every train prompt's ``per_prompt`` ground-truth clips, encoded once: latents
    (P, n, D) and keyframe latents (P, n, 2, C, 1, h, w), on ``device``."""
    fam = model.family
    geo = fam.media_geometry()
    spec = ClipSpec(geo["frames"], geo["size"], geo["fps"], geo["sample_rate"])
    latents, keys = [], []
    for i, p in enumerate(split_prompts("train")):
        seeds = [seed * 100_003 + i * 1_000 + k for k in range(per_prompt)]
        video, audio = render_batch([p.text] * per_prompt, seeds, spec)
        v, a = torch.from_numpy(video).to(device), torch.from_numpy(audio).to(device)
        latents.append(fam.encode_clip(v, a))
        keys.append(fam.keyframe_latents(v[:, 0], v[:, -1]))
    return torch.stack(latents), torch.stack(keys)


def pretrain_avbench(cfg: PretrainConfig) -> Path:
    rng, device = start_process(cfg)
    preset = cfg.preset or DEFAULT_PRESET
    mcfg = ModelConfig(family="minimax_h3", preset=preset, weights=cfg.init)
    model = load_model(mcfg, device)
    train = PromptSet([Prompt(p.text) for p in split_prompts("train")], model.family.tokenize)
    bank, keys = clip_bank(model, cfg.bank_per_prompt, cfg.seed, device)
    ema = copy.deepcopy(model).requires_grad_(False)
    ema_params, params = list(ema.parameters()), list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, cfg.warmup, cfg.schedule_steps or cfg.steps)
    )
    null = model.family.null_ids()[None].to(device)
    ids_all = train.input_ids.to(device)
    chunk = max(1, min(cfg.chunk, cfg.batch))
    dv, da = model.net.dims
    weight = torch.cat([torch.ones(dv), torch.full((da,), float(cfg.audio_weight))]).to(device)
    weight = weight / weight.mean()  # audio_weight 1: the plain mean over all dims
    t0 = time.time()
    out = output_path(cfg)
    bar = tqdm(range(cfg.steps), desc="pretrain avbench")
    for step in bar:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(0, cfg.batch, chunk):
            n = min(chunk, cfg.batch - start)
            idx = torch.from_numpy(rng.integers(0, len(train), n)).to(device)
            pick = torch.from_numpy(rng.integers(0, cfg.bank_per_prompt, n)).to(device)
            x0 = bank[idx, pick]
            ids = ids_all[idx].clone()
            ids[torch.from_numpy(rng.random(n) < cfg.text_dropout).to(device)] = null
            cond = keys[idx, pick] if rng.random() < cfg.cond_prob else None
            sigma = torch.sigmoid(torch.randn(())).expand(n).to(device)  # one per chunk
            eps = torch.randn_like(x0)
            v = model(noised(x0, sigma, eps), sigma, ids, cond)
            loss = ((v - (eps - x0)).pow(2) * weight).mean() * (n / cfg.batch)
            loss.backward()
            total += float(loss.detach())
        optimizer_step(opt, sched, params, ema_params, step, cfg.ema)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{total:.4f}")
        if step + 1 in cfg.snapshots and step + 1 != cfg.steps:
            snap = out.with_name(f"{out.stem}_step{step + 1}{out.suffix}")
            save_and_score(ema, snap, cfg, preset, step + 1, time.time() - t0)
    return save_and_score(ema, out, cfg, preset, cfg.steps, time.time() - t0)


def output_path(cfg) -> Path:
    return Path(cfg.out) if cfg.out else builtin_path("builtin:avbench_h3")


def save_and_score(model, out: Path, cfg, preset: str, steps: int, seconds: float) -> Path:
    """Save, evaluate held-out T2VA and FL2VA, and store the scores in the file's metadata."""
    meta = {
        "preset": preset,
        "task": "avbench",
        "pretrain_steps": str(steps),
        "pretrain_s": f"{seconds:.0f}",
        "pretrain_batch": str(cfg.batch),
        "cond_prob": str(cfg.cond_prob),
        "audio_weight": str(cfg.audio_weight),
        "init": cfg.init,
    }
    save_weights(model, out, meta)
    scores = {}
    for task in ("avbench", "avbench_fl2va"):
        metrics = evaluate_av(str(out), task, cfg.eval_samples, 10, cfg.device, preset=preset)
        scores[task] = {k: round(v, 4) for k, v in metrics.items()}
    save_weights(model, out, {**meta, "avbench_eval": str(scores)})
    print(f"[{out.name}] steps={steps} {scores}")
    return out


def evaluate_av(
    weights: str,
    task_name: str = "avbench",
    samples_per_prompt: int = 4,
    num_steps: int = 10,
    device: str = "auto",
    seed: int = 1234,
    preset: str = DEFAULT_PRESET,
) -> dict[str, float]:
    """Held-out AVBench metrics of a base (no adapters) in one mode, sampled by the rollout
    engine with the data stage's conditions, exactly as a run's eval."""
    dev = pick_device(device)
    model = load_model(ModelConfig(family="minimax_h3", preset=preset, weights=weights), dev)
    return held_out_metrics(model, task_name, samples_per_prompt, num_steps, seed)
