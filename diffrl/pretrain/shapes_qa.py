"""The ShapesQA base (``builtin:shapes_omni``): the tiny Qwen2.5-Omni thinker trained by
teacher forcing on the train split's (question, image) -> answer pairs, stopped short of
perfect so Omni-PPO has held-out accuracy to gain.

Each step draws fresh renders of the train split's scenes (the RL task's items are one render
per scene; the held-out scenes are never drawn). The file's metadata keeps the held-out
accuracy it reached (greedy answers, scored by the task's own evaluator). The loss is the
answer tokens' negative log-likelihood, computed by the family's own forward (the one the RL
actor differentiates), end-of-turn included.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from diffrl.build import prompt_set
from diffrl.models.family import NO_TOKEN
from diffrl.models.registry import ModelConfig, builtin_path, load_model, save_weights
from diffrl.pretrain.common import PretrainConfig, start_process, warmup_cosine
from diffrl.rollout.ar import ARRolloutEngine
from diffrl.rollout.engine import RolloutConfig
from diffrl.tasks import TaskConfig, build_task
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.tasks.shapes_qa import answer, questions

PRESET = "qwen-omni-tiny"
ANSWER_TOKENS = 4  # the recipe's rollout.num_steps: one word and the end-of-turn fit


def pretrain_shapes_qa(cfg: PretrainConfig) -> Path:
    rng, device = start_process(cfg)
    model = load_model(ModelConfig(preset=cfg.preset or PRESET, weights=cfg.init), device)
    fam = model.family
    scenes = split_prompts("train")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, cfg.warmup, cfg.schedule_steps or cfg.steps)
    )
    t0 = time.time()
    bar = tqdm(range(cfg.steps), desc="pretrain shapes_qa")
    for _ in bar:
        questions, images, answers = fresh_items(scenes, cfg.batch, fam.image_size, rng)
        tokens = answer_tokens(fam, answers).to(device)
        cond = fam.encode_conditions([{"image": i} for i in images]).to(device)
        logp = model(tokens, 1.0, fam.tokenize(questions).input_ids.to(device), cond)
        loss = -logp.sum() / (tokens != NO_TOKEN).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    metrics = held_out_accuracy(model, device)
    out = Path(cfg.out) if cfg.out else builtin_path("builtin:shapes_omni")
    meta = {
        "preset": cfg.preset or PRESET,
        "steps": str(cfg.steps),
        "batch": str(cfg.batch),
        "lr": str(cfg.lr),
        "seed": str(cfg.seed),
        "train_s": f"{time.time() - t0:.0f}",
        "final_loss": f"{loss.item():.4f}",
        "shapes_qa_eval": str({k: round(v, 4) for k, v in metrics.items()}),
    }
    save_weights(model, out, meta)
    print(f"wrote {out}: final loss {loss.item():.4f}, held-out {metrics}")
    return out


def fresh_items(scenes: list, n: int, size: int, rng: np.random.Generator):
    """``n`` new (question, image, answer) triples: a fresh render of a random train scene and
    one of the questions it answers. Fresh renders every step (the task's items are one render
    per scene) keep the base from memorising images instead of reading them."""
    questions_, images, answers = [], [], []
    for k in rng.choice(len(scenes), size=n):
        image = render(scenes[k], rng, size)
        asked = questions(scenes[k])
        q = asked[rng.integers(len(asked))]
        questions_.append(q)
        images.append(image)
        answers.append(answer(q, image))
    return questions_, images, answers


def answer_tokens(fam, answers: list[str]) -> torch.Tensor:
    """(N, ANSWER_TOKENS) int64: each answer's ids and the end-of-turn, NO_TOKEN after."""
    out = torch.full((len(answers), ANSWER_TOKENS), NO_TOKEN, dtype=torch.int64)
    for i, a in enumerate(answers):
        ids = [*fam.tokenizer(a, add_special_tokens=False)["input_ids"], fam.eos_id]
        out[i, : len(ids)] = torch.tensor(ids)
    return out


def held_out_accuracy(model, device: torch.device) -> dict[str, float]:
    """The base's held-out metrics: greedy answers to every test question, graded by the
    task's evaluator (what a run's step-0 eval reports)."""
    task = build_task(TaskConfig(task="shapes_qa"))
    test = prompt_set(task, model, task.prompts("test"))
    rollout = RolloutConfig(num_steps=ANSWER_TOKENS, max_batch=64)
    engine = ARRolloutEngine(model, rollout, [], device)

    async def run():
        traj = await engine.generate(test.all(), 0, group_size=1, sampler="ode")
        return (await task.evaluate(traj)).metrics

    return asyncio.run(run())
