"""The run directory: runs/<name>/ with metrics.jsonl, TensorBoard events, sample grids (and
sample clips for video+audio tasks), the reward / accuracy curve and the resolved config.

metrics.jsonl is strict JSON, one row per logged step: a value that is not finite (a reward
mean that overflowed, a NaN loss) is written as ``null``, never as ``Infinity`` / ``NaN``. Each
row is fsynced; a line torn by a kill is skipped on reading and dropped on resume.
"""

from __future__ import annotations

import io
import json
import logging
import math
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from diffrl.controller import media
from diffrl.diskio import append_durably, write_atomic

log = logging.getLogger(__name__)


def read_metrics(root: Path) -> list[dict]:
    """The rows of ``root/metrics.jsonl`` (one per logged step), [] if nothing was logged;
    lines that are not JSON (torn by a kill) are skipped with a warning."""
    return [row for _, row in _rows(Path(root) / "metrics.jsonl")]


def _rows(path: Path) -> list[tuple[str, dict]]:
    """(line, parsed row) for each JSON line of ``path``."""
    if not path.exists():
        return []
    rows, bad = [], []
    for i, ln in enumerate(path.read_text().splitlines(), 1):
        if not ln.strip():
            continue
        try:
            rows.append((ln, json.loads(ln)))
        except ValueError:
            bad.append(i)
    if bad:
        log.warning("%s: lines %s are not JSON (torn by a kill?): skipped", path, bad)
    return rows


class RunDir:
    def __init__(self, root: Path, tensorboard: bool = True, purge_step: int | None = None) -> None:
        """``purge_step``: TensorBoard hides the events earlier writers logged at and after it
        (a resumed run redoes those steps)."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "samples").mkdir(exist_ok=True)
        self.metrics_path = root / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(root / "tb"), purge_step=purge_step)

    def write_config(self, text: str) -> None:
        _replace_atomically(self.root / "config.yaml", text)  # `diffrl eval RUN_DIR` reads it

    def truncate_after(self, step: int) -> None:
        """On resume: drop metrics logged after the checkpoint we resume from."""
        if not self.metrics_path.exists():
            return
        keep = [ln for ln, row in _rows(self.metrics_path) if row.get("step", 0) <= step]
        _replace_atomically(self.metrics_path, "".join(ln + "\n" for ln in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _num(v) for k, v in metrics.items()}}
        append_durably(self.metrics_path, (json.dumps(row, allow_nan=False) + "\n").encode())
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def read_metrics(self) -> list[dict]:
        return read_metrics(self.root)

    def save_grid(
        self,
        step: int,
        images: np.ndarray,
        texts: list[str],
        ok: list[bool | None],
        cols: int = 8,
        tile: int = 96,
    ) -> Path:
        """images (N, H, W, 3) uint8 -> samples/step_XXXXXX.png: every image as a ``tile``-px
        square, its caption wrapped in word order under it (nothing clipped), and a green/red
        border for pass/fail (grey where the task has no verdict)."""
        n = images.shape[0]
        chars = max(8, tile // 6)  # PIL's default bitmap font is about 6 px per character
        captions = [textwrap.wrap(t, chars) or [""] for t in texts]
        line_h = 11
        cell_w, cell_h = tile + 8, tile + 12 + line_h * max(len(c) for c in captions)
        rows = math.ceil(n / cols)
        canvas = Image.new("RGB", (cols * cell_w, rows * cell_h), (255, 255, 255))
        draw, font = ImageDraw.Draw(canvas), media.caption_font()
        small = images.shape[1] < tile  # upscale pixel art sharply, downscale real images smoothly
        for i in range(n):
            x, y = (i % cols) * cell_w, (i // cols) * cell_h
            border = media.VERDICT_COLOURS.get(ok[i], media.NO_VERDICT)
            draw.rectangle([x + 1, y + 1, x + tile + 6, y + tile + 6], fill=border)
            resample = Image.Resampling.NEAREST if small else Image.Resampling.LANCZOS
            canvas.paste(Image.fromarray(images[i]).resize((tile, tile), resample), (x + 4, y + 4))
            text = "\n".join(captions[i])
            draw.text((x + 2, y + tile + 9), text, fill=(0, 0, 0), font=font, spacing=1)
        return _save_png(self.root / "samples" / f"step_{step:06d}.png", canvas.save)

    def save_clips(
        self,
        step: int,
        video: np.ndarray,
        audio: np.ndarray,
        fps: np.ndarray,
        sample_rate: np.ndarray,
        captions: list[str],
        ok: list[bool | None],
    ) -> Path:
        """One held-out clip per prompt -> samples/clips/step_XXXXXX/clip_KK.{gif,wav,png}, and
        .mp4 with sound where ffmpeg is on the PATH. video (N, T, H, W, 3) uint8, audio (N, S)
        float in [-1, 1], fps (N,), sample_rate (N,); the PNG is the frames over the
        spectrogram, captioned, with the grid's pass/fail border."""
        n = len(captions)
        ok = list(ok) or [None] * n  # no verdicts: grey borders
        if np.ndim(audio) != 2 or len(video) != n or len(audio) != n or len(ok) != n:
            raise ValueError(
                f"clips: video {np.shape(video)}, audio {np.shape(audio)} (want (N, S)), "
                f"{len(captions)} captions and {len(ok)} verdicts must agree on N"
            )
        fps, sample_rate = np.broadcast_to(fps, (n,)), np.broadcast_to(sample_rate, (n,))
        out = self.root / "samples" / "clips" / f"step_{step:06d}"
        out.mkdir(parents=True, exist_ok=True)
        for k in range(n):
            stem = out / f"clip_{k:02d}"
            media.write_gif(stem.with_suffix(".gif"), video[k], fps[k])
            media.write_wav(stem.with_suffix(".wav"), audio[k], sample_rate[k])
            png = stem.with_suffix(".png")
            media.strip_png(png, video[k], audio[k], sample_rate[k], captions[k], ok[k])
            media.write_mp4(stem.with_suffix(".mp4"), video[k], audio[k], fps[k], sample_rate[k])
        return out

    def save_curves(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.read_metrics()
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
        tr = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
        ev = [(r["step"], r["eval/overall"]) for r in rows if "eval/overall" in r]
        if tr:
            ax[0].plot(*zip(*tr, strict=True), color="tab:blue")
        ax[0].set(title="train reward (mean)", xlabel="step")
        if ev:
            ax[1].plot(*zip(*ev, strict=True), marker="o", color="tab:green")
        ax[1].set(title="held-out ShapesBench accuracy", xlabel="step", ylim=(0, 1))
        for a in ax:
            a.grid(alpha=0.3)
        fig.tight_layout()
        try:
            return _save_png(self.root / "curves.png", lambda f, **kw: fig.savefig(f, dpi=90, **kw))
        finally:
            plt.close(fig)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class FollowerRunDir(RunDir):
    """The run directory as a rank other than 0 sees it under torchrun: it reads what rank 0
    writes (checkpoints, to resume from) and writes nothing."""

    def __init__(self, root: Path) -> None:
        self.root, self.metrics_path, self.tb = root, root / "metrics.jsonl", None

    def write_config(self, text: str) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def save_grid(self, step: int, *args: Any, **kw: Any) -> Path:
        return self.root / "samples" / f"step_{step:06d}.png"  # rank 0 writes it

    def save_clips(self, step: int, *args: Any, **kw: Any) -> Path:
        return self.root / "samples" / "clips" / f"step_{step:06d}"  # rank 0 writes them

    def save_curves(self) -> Path:
        return self.root / "curves.png"  # rank 0 writes it


def open_run_dir(
    root: Path, tensorboard: bool, primary: bool = True, purge_step: int | None = None
) -> RunDir:
    return RunDir(root, tensorboard, purge_step) if primary else FollowerRunDir(root)


def _save_png(path: Path, save) -> Path:
    """Render with ``save(file, format="png")`` in memory, then write the bytes atomically: a
    full disk leaves the old PNG whole, never a truncated one."""
    buf = io.BytesIO()
    save(buf, format="png")
    return write_atomic(path, buf.getvalue())


def _replace_atomically(path: Path, text: str) -> None:
    """Write ``path`` so that a kill or a full disk leaves either the old file or the new one,
    whole."""
    write_atomic(path, text.encode())


def _num(v):
    """A metric as JSON: numbers as floats, and None for a number that is not finite."""
    if isinstance(v, (int, float, np.floating, np.integer)):
        v = float(v)
        return v if math.isfinite(v) else None
    return v
