"""AVBench as a task: "a red ball bounces twice, high beeps", short clips with sound, graded by
exact verifiers (text-audio, audio-video sync, visual, and for FL2VA the given first/last
frames). See docs/avbench.md.

Four registered tasks share this module; ``cfg.task`` picks the mode:

- ``avbench``: text to video+audio (T2VA);
- ``avbench_i2av``: the same prompts plus the first frame as a condition (I2AV; LTX-2). It is
  graded by the T2VA checks: a family that holds the given frame (LTX-2 replaces the first
  latent frame) passes a first-frame check by construction, so it would measure the VAE, not
  the policy;
- ``avbench_ref2va``: the same prompts plus a reference image and a reference soundtrack
  (Ref2VA, diffrl's definition over AVBench): the canonical clip's middle frame and its
  waveform (seed ``condition_seed``), graded as T2VA;
- ``avbench_fl2va``: the same prompts plus first/last frame conditions (FL2VA).
  ``Prompt.frames`` holds file paths, so the conditions are served as arrays instead, by
  ``task.conditions(text, seed)``. Evaluation grades a clip against the frames the rollout
  carried in ``extra_fields["first_frame"]`` / ``["last_frame"]`` ((B, H, W, 3) uint8), and
  against ``conditions(text, task.condition_seed)`` when the trajectory has none.
"""

from __future__ import annotations

import numpy as np
import torch

from diffrl.tasks.avbench.prompts import AVPrompt, parse_prompt, split_prompts
from diffrl.tasks.avbench.render import (
    DEFAULT_SPEC,
    FPS,
    SAMPLE_RATE,
    ClipSpec,
    conditions,
    render,
    render_batch,
)
from diffrl.tasks.avbench.verify import VERIFIERS, Checks, verify_clips
from diffrl.tasks.base import EvalResult, ProbeData, Prompt, TaskConfig, first_of_each_prompt
from diffrl.types import Trajectory

MODES = {
    "avbench": "t2va",
    "avbench_fl2va": "fl2va",
    "avbench_i2av": "i2av",
    "avbench_ref2va": "ref2va",
}


def _rates(traj: Trajectory, key: str, default: int) -> np.ndarray:
    """(B,) fps or sample rate from ``extra_fields``, the renderer's where absent."""
    if key in traj.extra_fields:
        return traj.extra_fields[key].detach().cpu().numpy().reshape(-1)
    return np.full(len(traj.prompts), default)


def trajectory_checks(traj: Trajectory, fl2va: bool = False, condition_seed: int = 0) -> Checks:
    """Every verifier on a trajectory's "video" (B, T, H, W, 3) uint8 and "audio" (B, samples)
    float; with ``fl2va`` also ``frames``, against the carried or the canonical conditions."""
    video = traj.extra_fields["video"].detach().cpu().numpy()
    audio = traj.extra_fields["audio"].detach().cpu().float().numpy()
    if audio.ndim == 3:  # (B, C, S): the verifiers read mono
        audio = audio.mean(axis=1)
    prompts = [parse_prompt(t) for t in traj.prompts.texts]
    first = last = None
    if fl2va:
        if "first_frame" in traj.extra_fields and "last_frame" in traj.extra_fields:
            first = traj.extra_fields["first_frame"].detach().cpu().numpy()
            last = traj.extra_fields["last_frame"].detach().cpu().numpy()
        else:  # the canonical conditions, rendered at the clip's own geometry
            fps, sr = _rates(traj, "fps", FPS), _rates(traj, "sample_rate", SAMPLE_RATE)
            spec = ClipSpec(video.shape[1], video.shape[2], float(fps[0]), int(sr[0]))
            conds = [conditions(p, condition_seed, spec) for p in prompts]
            first = np.stack([c["first_frame"] for c in conds])
            last = np.stack([c["last_frame"] for c in conds])
    fps, sample_rate = _rates(traj, "fps", FPS), _rates(traj, "sample_rate", SAMPLE_RATE)
    return verify_clips(video, audio, prompts, fps, sample_rate, first, last)


class AVBenchTask:
    """ShapesTask's shape: prompts per split, a verifier-based held-out eval, no probe data."""

    def __init__(self, cfg: TaskConfig) -> None:
        if cfg.task not in MODES:
            raise ValueError(f"AVBench task {cfg.task!r}: must be one of {sorted(MODES)}")
        self.cfg, self.name = cfg, cfg.task
        self.fl2va = MODES[cfg.task] == "fl2va"
        self.i2av = MODES[cfg.task] == "i2av"
        self.ref2va = MODES[cfg.task] == "ref2va"
        # first/last frames (FL2VA), the first (I2AV), or a reference image and soundtrack
        # (Ref2VA), per prompt (prompt_conditions)
        self.needs_conditions = self.fl2va or self.i2av or self.ref2va
        self.condition_seed = 0  # the seed of each prompt's canonical FL2VA conditions

    def prompts(self, split: str) -> list[Prompt]:
        return [Prompt(p.text) for p in split_prompts(split)]

    def prompt_conditions(self, prompts: list[Prompt], geometry: dict) -> list[dict] | None:
        """FL2VA: each prompt's canonical first/last frames (seed ``condition_seed``) at the
        model's ``geometry`` (frames, size, fps, sample_rate); I2AV: the first of them; Ref2VA: a
        reference image and soundtrack; None for T2VA (text only)."""
        if not self.needs_conditions:
            return None
        spec = ClipSpec(
            int(geometry["frames"]),
            int(geometry["size"]),
            float(geometry["fps"]),
            int(geometry["sample_rate"]),
        )
        if self.ref2va:
            return [ref2va_conditions(p.text, self.condition_seed, spec) for p in prompts]
        conds = [conditions(p.text, self.condition_seed, spec) for p in prompts]
        return [{"first_frame": c["first_frame"]} for c in conds] if self.i2av else conds

    def conditions(
        self, prompt_text: str, seed: int = 0, spec: ClipSpec = DEFAULT_SPEC
    ) -> dict[str, np.ndarray]:
        """{"first_frame", "last_frame"}: (H, W, 3) uint8 ground truth, fixed per (text, seed);
        ``spec`` renders them at a model's own size and frame count."""
        return conditions(prompt_text, seed, spec)

    async def evaluate(self, traj: Trajectory, rewards=None) -> EvalResult:
        """eval/<check> and eval/<verifier> accuracies, eval/overall (all checks pass); the
        grid shows the middle frame of the first clip of each prompt, and ``clips`` carries
        those clips whole (video, mono audio, fps, sample rate) for the run's sample clips."""
        checks = trajectory_checks(traj, self.fl2va, self.condition_seed)
        metrics = {f"eval/{k}": float(v.mean()) for k, v in checks.passed.items()}
        for verifier, names in VERIFIERS.items():
            if all(n in checks.passed for n in names):
                both = np.logical_and.reduce([checks.passed[n] for n in names])
                metrics[f"eval/{verifier}"] = float(both.mean())
        overall = checks.overall
        metrics["eval/overall"] = float(overall.mean())
        rows = first_of_each_prompt(traj)
        video = traj.extra_fields["video"].detach().cpu().numpy()
        audio = traj.extra_fields["audio"].detach().cpu().float().numpy()
        if audio.ndim == 3:  # (B, C, S): the clips are mono, as the verifiers hear them
            audio = audio.mean(axis=1)
        clips = {
            "video": video[rows],
            "audio": audio[rows],
            "fps": _rates(traj, "fps", FPS)[rows],
            "sample_rate": _rates(traj, "sample_rate", SAMPLE_RATE)[rows],
        }
        return EvalResult(
            metrics,
            video[rows, video.shape[1] // 2],
            [traj.prompts.texts[i] for i in rows],
            [bool(overall[i]) for i in rows],
            clips,
        )

    def probe_data(self, n: int = 16) -> ProbeData:
        """Ground-truth clips of the train prompts (seed k for the k-th): the probe encodes
        them into the family's joint video+audio latent (``encode_clip``)."""
        prompts = [p.text for p in split_prompts("train")[:n]]
        video, audio = render_batch(prompts, list(range(len(prompts))))
        return ProbeData(None, prompts, torch.from_numpy(video), torch.from_numpy(audio))


def ref2va_conditions(text: str, seed: int, spec: ClipSpec) -> dict[str, np.ndarray]:
    """Ref2VA's references for one prompt: the canonical clip's middle frame ((H, W, 3)
    uint8) and its waveform ((samples,) float32)."""
    video, audio = render(text, seed, spec)
    return {"ref_image": video[video.shape[0] // 2].copy(), "ref_audio": audio}


def build(cfg: TaskConfig) -> AVBenchTask:
    return AVBenchTask(cfg)


__all__ = [
    "AVBenchTask",
    "AVPrompt",
    "ClipSpec",
    "build",
    "conditions",
    "parse_prompt",
    "render",
    "render_batch",
    "split_prompts",
    "trajectory_checks",
]
