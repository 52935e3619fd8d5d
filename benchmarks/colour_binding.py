"""How ShapesBench's colour-attribution samples fail: is the colour bound to the wrong shape?

For every colour-attribution prompt ("a red circle and a yellow square") of the train and the
held-out split, G samples with the run's eval sampler (ODE, 10 steps, fixed noise), each put in
one bucket: pass; swapped (the right two colours and shapes, bound the other way round: the
image of the prompt's *twin*, "a yellow circle and a red square"); same_shape; other_shape;
wrong_colour; unknown_shape; missing (under two objects); extra (over two). Each split is also
cut by whether the prompt's twin is a training prompt: a model that maps the bag of words to an
image, not the words' order, draws the trained twin's picture for a held-out prompt.

Usage: python benchmarks/colour_binding.py CHECKPOINT_OR_RUN_DIR [--samples G] [--device D]
  CHECKPOINT: builtin:shapes_dit or a tiny-DiT .safetensors from `diffrl pretrain`;
  RUN_DIR: a `diffrl train` run directory (its newest checkpoint, the adapter it evaluates).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
from pathlib import Path

import torch

from diffrl.build import pick_device, prompt_set
from diffrl.models.registry import ModelConfig, load_model
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import TaskConfig, build_task
from diffrl.tasks.base import Prompt
from diffrl.tasks.shapes.prompts import ShapesPrompt, parse_prompt, split_prompts
from diffrl.tasks.shapes.verify import Verdict, score_batch

BUCKETS = (
    "pass", "swapped", "same_shape", "other_shape", "wrong_colour", "unknown_shape", "missing",
    "extra",
)  # fmt: skip


def twin(p: ShapesPrompt) -> str:
    """The prompt with its two shapes exchanged: the same bag of words, the other binding."""
    a, b = p.objects
    return f"a {a.color} {b.shape} and a {b.color} {a.shape}"


def bucket(p: ShapesPrompt, v: Verdict) -> str:
    if v.overall:
        return "pass"
    want = [(o.color, o.shape) for o in p.objects]
    got = [(d.color, d.shape) for d in v.detected]
    if len(got) != 2:
        return "missing" if len(got) < 2 else "extra"
    if sorted(got) == sorted([(want[0][0], want[1][1]), (want[1][0], want[0][1])]):
        return "swapped"
    shapes = [g[1] for g in got]
    if "unknown" in shapes:
        return "unknown_shape"
    if shapes[0] == shapes[1]:
        return "same_shape"
    if {g[0] for g in got} != {w[0] for w in want}:
        return "wrong_colour"
    return "other_shape"


def load_engine(target: str, device: torch.device) -> tuple[RolloutEngine, object]:
    """(an engine that samples the target's policy, the model that tokenizes for it)."""
    if Path(target, "config.yaml").is_file():  # a run: its newest checkpoint's eval adapter
        from diffrl.controller.tools import load_run

        overrides = ["rollout.compile=false", "actor.compile=false", f"run.device={device.type}"]
        parts, _ = load_run(target, overrides)
        parts.evaluator.load_weights(parts.actor.export_weights(parts.actor.eval_adapter))
        return parts.evaluator, parts.evaluator.model
    model = load_model(ModelConfig(checkpoint=target), device)
    return RolloutEngine(model, RolloutConfig(), [], device), model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    engine, model = load_engine(args.target, pick_device(args.device))
    task = build_task(TaskConfig(task="shapes"))
    train_texts = {p.text for p in split_prompts("train")}
    print("| split | twin in train | samples | " + " | ".join(BUCKETS) + " |")
    print("|---" * (3 + len(BUCKETS)) + "|")
    for split in ("eval", "train"):
        prompts = [p for p in split_prompts(split) if p.category == "color_attr"]
        pset = prompt_set(task, model, [Prompt(p.text) for p in prompts])
        traj = asyncio.run(
            engine.generate(pset.all(), 1234, group_size=args.samples, sampler="ode", num_steps=10)
        )
        parsed = [parse_prompt(t) for t in traj.prompts.texts]
        verdicts = score_batch(traj.extra_fields["image"].numpy(), parsed)
        pairs = zip(parsed, verdicts, strict=True)
        rows = [(twin(p) in train_texts, bucket(p, v)) for p, v in pairs]
        for label, keep in (("all", None), ("yes", True), ("no", False)):
            got = [b for t, b in rows if keep is None or t == keep]
            if got:
                count = collections.Counter(got)
                shares = " | ".join(f"{count[b] / len(got):.2f}" for b in BUCKETS)
                print(f"| {split} | {label} | {len(got)} | {shares} |")


if __name__ == "__main__":
    main()
