"""Old vs new verifier on the same held-out samples (issue 40): pass rates and agreement.

Issue 40 closed two holes. ShapesBench named any blob neither square- nor triangle-like a
circle (a plus sign passed "a red circle"); it now names a shape only by a positive test.
AVBench tracked the largest blob only (a clip with a second ball passed); it now counts objects.
This grades one set of samples with both, so a run's gains can be restated under the new one.
"Old" is the rule before issue 40, kept below (``legacy_blob_shape``, ``legacy_analyze_video``).

Usage:
  python benchmarks/verifier_agreement.py TARGET [--task shapes] [--samples G] [--prompts N]
      samples the held-out prompts (ODE, 10 steps, fixed noise, G per prompt) from TARGET:
      a run directory (its newest checkpoint's eval adapter; its task) or a checkpoint
      (builtin:shapes_dit_v2 or a tiny-DiT .safetensors; or, with --family and --preset, a
      diffusers family's weights, e.g. builtin:avbench_h3 --task avbench --family minimax_h3
      --preset h3-avbench);
  python benchmarks/verifier_agreement.py --grid RUN_DIR/samples/step_000080.png
      reads a saved ShapesBench eval grid back instead (the first sample of each held-out
      prompt, 32 px tiles drawn 3x with nearest-neighbour, so exact): no model needed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import textwrap
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
from PIL import Image
from scipy.signal import find_peaks

from diffrl.tasks.avbench import verify as av
from diffrl.tasks.shapes import verify as shapes
from diffrl.tasks.shapes.prompts import parse_prompt, split_prompts


def legacy_blob_shape(rows: np.ndarray, cols: np.ndarray) -> str:
    """ShapesBench's rule before issue 40: square by fill, triangle by fill or low mass, and
    anything else within the aspect bound a circle."""
    top, h = rows.min(), int(rows.max() - rows.min() + 1)
    w = int(cols.max() - cols.min() + 1)
    fill, aspect = rows.size / (h * w), max(h, w) / min(h, w)
    drop = (rows.mean() - top + 0.5) / h - 0.5
    if aspect > 1.6:
        return "unknown"
    if fill > 0.88:
        return "square"
    if fill < 0.62 or drop > 0.04:
        return "triangle"
    return "circle"


_analyze_video = av.analyze_video


def legacy_analyze_video(video: np.ndarray) -> av.BallTrack:
    """AVBench's tracking before issue 40: the largest blob is the ball from 6 px (at 32 px),
    whatever else the frame shows, so a second ball is unseen."""
    with mock.patch.object(av, "MIN_OBJECT_SHARE", 6 / av.BALL_AREA):
        track = _analyze_video(video)
    seen = np.isfinite(track.cy)
    contacts = np.zeros(0, dtype=np.int64)
    if seen.all():
        contacts, _ = find_peaks(track.cy, prominence=av.CONTACT_PROMINENCE * video.shape[1] / 32)
    return av.BallTrack(track.cy, np.asarray(contacts, np.int64), track.color_share, seen * 1)


@contextmanager
def legacy():
    with (
        mock.patch.object(shapes, "blob_shape", legacy_blob_shape),
        mock.patch.object(av, "analyze_video", legacy_analyze_video),
    ):
        yield


# --------------------------------------------------------------------------- samples


def read_grid(path: Path, texts: list[str], size: int = 32, cols: int = 8, tile: int = 96):
    """(N, size, size, 3) uint8: the images of a grid that ``RunDir.save_grid`` drew for
    ``texts`` (its layout: cells of tile + 8 px, a caption under each, 4 px borders)."""
    img = np.asarray(Image.open(path).convert("RGB"))
    lines = max(len(textwrap.wrap(t, max(8, tile // 6)) or [""]) for t in texts)
    cell_w, cell_h = tile + 8, tile + 12 + 11 * lines
    rows = -(-len(texts) // cols)
    if img.shape[:2] != (rows * cell_h, cols * cell_w) or tile % size:
        raise ValueError(f"{path}: {img.shape[:2]} is not a grid of {len(texts)} {size} px tiles")
    k = tile // size
    out = []
    for i in range(len(texts)):
        x, y = (i % cols) * cell_w + 4, (i // cols) * cell_h + 4
        out.append(img[y : y + tile, x : x + tile][k // 2 :: k, k // 2 :: k])
    return np.stack(out)


def sample(args: argparse.Namespace):
    """(the task, the held-out trajectory): G samples of each held-out prompt, ODE 10 steps."""
    from colour_binding import load_engine  # benchmarks/: its engine for a run or a checkpoint

    from diffrl.build import pick_device, prompt_set
    from diffrl.models.registry import ModelConfig, load_model
    from diffrl.rollout.engine import RolloutConfig, RolloutEngine
    from diffrl.tasks import TaskConfig, build_task

    target, task_name, device = args.target, args.task, pick_device(args.device)

    data = TaskConfig(task=task_name)
    if Path(target, "config.yaml").is_file():  # a run: its own task settings
        from diffrl.config import load_config

        data = load_config(Path(target, "config.yaml")).data
    if args.preset:
        cfg = ModelConfig(family=args.family, preset=args.preset, weights=target)
        model = load_model(cfg, device)
        engine = RolloutEngine(model, RolloutConfig(), [], device)
    else:
        engine, model = load_engine(target, device)
    task = build_task(data)
    prompts = task.prompts("test")[: args.prompts or None]
    pset = prompt_set(task, model, prompts)
    traj = asyncio.run(
        engine.generate(pset.all(), 1234, group_size=args.samples, sampler="ode", num_steps=10)
    )
    return task, traj


# --------------------------------------------------------------------------- reports


def shapes_report(images: np.ndarray, texts: list[str]) -> None:
    prompts = [parse_prompt(t) for t in texts]
    new = shapes.score_batch(images, prompts)
    with legacy():
        old = shapes.score_batch(images, prompts)
    o, n = np.array([v.overall for v in old]), np.array([v.overall for v in new])
    agree = (o == n).mean()
    print(
        f"ShapesBench, {len(o)} samples: old {o.mean():.1%}, new {n.mean():.1%}, agree {agree:.1%}"
    )
    names = collections.Counter(d.shape for v in new for d in v.detected)
    print(f"  new names: {dict(names)}; old passes that now fail: {int((o & ~n).sum())}")
    for v_old, v_new, t in zip(old, new, texts, strict=True):
        if v_old.overall != v_new.overall:
            was = "passed" if v_old.overall else "failed"
            print(f"    {t!r} ({was} before): {[(d.color, d.shape) for d in v_new.detected]}")


def av_report(traj, fl2va: bool) -> None:
    from diffrl.tasks.avbench import trajectory_checks

    new = trajectory_checks(traj, fl2va)
    with legacy():
        old = trajectory_checks(traj, fl2va)
    print(f"AVBench, {len(new.overall)} clips (pass rate old -> new):")
    for name in [*new.passed, "overall"]:
        o = old.overall if name == "overall" else old.passed[name]
        n = new.overall if name == "overall" else new.passed[name]
        print(f"  {name:12s} {o.mean():6.1%} -> {n.mean():6.1%}   agree {(o == n).mean():.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", nargs="?")
    ap.add_argument("--grid", type=Path, help="a saved ShapesBench eval grid (samples/step_*.png)")
    ap.add_argument("--task", default="shapes", help="for a checkpoint target")
    ap.add_argument("--samples", type=int, default=2, help="samples per held-out prompt")
    ap.add_argument("--prompts", type=int, default=0, help="the first N held-out prompts (0: all)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--family", default="", help="with --preset: a diffusers family's weights")
    ap.add_argument("--preset", default="")
    args = ap.parse_args()
    if args.grid:
        texts = [p.text for p in split_prompts("eval")][: args.prompts or None]
        shapes_report(read_grid(args.grid, texts), texts)
        return
    if not args.target:
        ap.error("give a run directory or checkpoint, or --grid")
    task, traj = sample(args)
    if task.name == "shapes":
        shapes_report(traj.extra_fields["image"].numpy(), list(traj.prompts.texts))
    else:
        av_report(traj, getattr(task, "fl2va", False))


if __name__ == "__main__":
    main()
