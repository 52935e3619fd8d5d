"""AVBench's verifiers as a scorer: exact programs over a clip's frames and samples."""

from __future__ import annotations

import asyncio

import torch

from diffrl.errors import check_choice
from diffrl.reward.scorer import ScoreResult
from diffrl.tasks.avbench import trajectory_checks
from diffrl.tasks.avbench.verify import VERIFIERS, Checks
from diffrl.types import Trajectory

# what each verifier grades (algorithm.modality_credit): the audio against the text, the
# picture against the text and the given frames, and the sync between them, of both
VERIFIER_MODALITY = {
    "text_audio": "audio",
    "visual": "video",
    "frames": "video",
    "av_sync": "joint",
}


class AVBenchScorer:
    """mode="overall": 1 if every check passes else 0 (the eval's strict score);
    mode="partial": the mean of the checks' fractions (pitch, beep_count, sync, color,
    bounce_count, and frames with ``fl2va``), a denser signal that credits e.g. two of three
    beeps in sync; its ``parts`` split that mean by modality (``VERIFIER_MODALITY``).
    ``fl2va``: also grade the first/last frames against the conditions in
    ``extra_fields`` ("first_frame", "last_frame"), or the prompt's canonical ones."""

    needs = frozenset({"video", "audio"})

    def __init__(self, mode: str = "partial", fl2va: bool = False, name: str = "avbench") -> None:
        check_choice("mode", mode, ("partial", "overall"))
        self.name, self.mode, self.fl2va = name, mode, bool(fl2va)

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    def score_sync(self, traj: Trajectory) -> ScoreResult:
        checks = trajectory_checks(traj, self.fl2va)
        overall = torch.from_numpy(checks.overall.astype("float32"))
        scores = overall if self.mode == "overall" else torch.from_numpy(checks.partial).float()
        metrics = {"accuracy": float(overall.mean())}
        metrics |= {k: float(v.mean()) for k, v in checks.passed.items()}
        parts = modality_parts(checks) if self.mode == "partial" else {}
        return ScoreResult(
            scores.float(), torch.ones(len(scores), dtype=torch.bool), metrics, parts
        )


def modality_parts(checks: Checks) -> dict[str, torch.Tensor]:
    """The partial score (the mean of the checks' fractions) split by modality -> (B,) each:
    a check's fraction / the number of checks goes to its verifier's modality, so the parts sum
    to the score. (The all-pass score has no such split: it is joint.) A check that no verifier
    lists would be graded by neither alone: it is joint."""
    of_check = {c: VERIFIER_MODALITY[v] for v, names in VERIFIERS.items() for c in names}
    n = len(checks.fractions)
    parts: dict[str, torch.Tensor] = {}
    for name, fraction in checks.fractions.items():
        modality = of_check.get(name, "joint")
        part = torch.from_numpy(fraction.astype("float32")) / n
        parts[modality] = parts[modality] + part if modality in parts else part
    return parts
