"""Rewards declared per modality: each scorer entry's ``modality`` (or the scorer's own split,
AVBench's verifiers), summed by the pool into ``ScoredBatch.modality_rewards``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from diffrl.config import load_config
from diffrl.errors import ConfigError, DiffrlError
from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.reward.scorers import build_scorer
from diffrl.tasks.avbench import split_prompts, trajectory_checks
from diffrl.tasks.avbench.scorer import modality_parts
from diffrl.tasks.avbench.verify import VERIFIERS
from diffrl.types import Trajectory

N = 3


class Split:
    """Fixed scores with a declared split: 0.25 video, the rest audio."""

    name, needs = "test_split", frozenset()

    async def score(self, traj: Trajectory) -> ScoreResult:
        s = torch.tensor([1.0, 2.0, 4.0])
        return ScoreResult(
            s, torch.ones(N, dtype=torch.bool), {}, {"video": s / 4, "audio": s * 3 / 4}
        )


register_scorer("test_split")(Split)


@register_scorer("test_flat")
class Flat:
    name, needs = "test_flat", frozenset()

    def __init__(self, value: float = 1.0) -> None:
        self.value = value

    async def score(self, traj: Trajectory) -> ScoreResult:
        s = torch.full((N,), self.value)
        return ScoreResult(s, torch.ones(N, dtype=torch.bool))


@register_scorer("test_audio_text")
class AudioText(Flat):
    """A scorer that says what it grades (as an audio-text similarity would)."""

    name, modality = "test_audio_text", "audio"


@register_scorer("test_bad_modality")
class Speech(Flat):
    name, modality = "test_bad_modality", "speech"


def traj() -> Trajectory:
    from diffrl.types import PromptBatch

    prompts = PromptBatch(
        ("a",) * N, torch.ones(N, 2, dtype=torch.long), ("h",) * N, torch.zeros(N, dtype=torch.long)
    )
    return Trajectory(prompts, torch.zeros(N, dtype=torch.long), torch.arange(N), torch.zeros(N, 4))


def test_the_pool_sums_weighted_scores_per_declared_modality() -> None:
    scorers = [
        ScorerConfig("test_split", weight=2.0),  # auto: its own split
        ScorerConfig("test_flat", weight=0.5, params={"value": 3.0}, modality="audio"),
        ScorerConfig("test_flat", weight=1.0, label="flat_auto"),  # auto, no split: joint
        ScorerConfig("test_split", weight=1.0, label="split_as_joint", modality="joint"),
        ScorerConfig("test_audio_text", weight=0.25),  # auto: the scorer's declared modality
    ]
    scored, metrics = asyncio.run(RewardPool(RewardConfig(scorers)).score(traj()))
    s = torch.tensor([1.0, 2.0, 4.0])
    by = scored.modality_rewards
    torch.testing.assert_close(by["video"], 2.0 * s / 4)
    torch.testing.assert_close(by["audio"], 2.0 * s * 3 / 4 + 0.5 * 3.0 + 0.25)
    torch.testing.assert_close(by["joint"], 1.0 + s)
    torch.testing.assert_close(by["video"] + by["audio"] + by["joint"], scored.rewards)
    assert metrics["reward/modality/video/mean"] == pytest.approx(float((s / 2).mean()))


def test_a_modality_outside_the_list_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"reward\.scorers\[0\]\.modality' = 'speech'"):
        load_config(None, ["reward.scorers=[{name: shapes, modality: speech}]"])
    with pytest.raises(DiffrlError, match="declares modality 'speech'"):
        RewardPool(RewardConfig([ScorerConfig("test_bad_modality")]))
    with pytest.raises(ValueError, match="parts are named"):
        ScoreResult(torch.ones(2), torch.ones(2, dtype=torch.bool), {}, {"speech": torch.ones(2)})


def avbench_traj(shuffle_audio: bool) -> Trajectory:
    """Rendered ground-truth clips of 4 held-out prompts; with ``shuffle_audio`` each clip has
    the next prompt's sound (right picture, wrong beeps)."""
    from diffrl.tasks.avbench import render_batch
    from diffrl.types import PromptBatch

    texts = tuple(p.text for p in split_prompts("test")[:4])
    video, audio = render_batch(list(texts), list(range(4)))
    if shuffle_audio:
        audio = np.roll(audio, 1, axis=0)
    prompts = PromptBatch(texts, torch.zeros(4, 2, dtype=torch.long), ("h",) * 4, torch.arange(4))
    fields = {"video": torch.from_numpy(video), "audio": torch.from_numpy(audio)}
    return Trajectory(
        prompts, torch.arange(4), torch.arange(4), torch.zeros(4, 1), extra_fields=fields
    )


def share(fractions: dict, verifier: str) -> np.ndarray:
    """Independent: the verifier's checks' fractions over the number of checks."""
    return sum(fractions[c] for c in VERIFIERS[verifier]) / len(fractions)


def test_avbench_splits_its_partial_score_by_verifier() -> None:
    scorer = build_scorer("avbench", {"mode": "partial"})
    good, bad = avbench_traj(False), avbench_traj(True)
    for t in (good, bad):
        result = asyncio.run(scorer.score(t))
        parts = result.parts
        assert set(parts) == {"video", "audio", "joint"}
        torch.testing.assert_close(sum(parts.values()), result.scores)
        # independent: the checks' fractions over the number of checks, by verifier
        checks = trajectory_checks(t)
        f = checks.fractions

        want_audio, want_video = share(f, "text_audio"), share(f, "visual")
        np.testing.assert_allclose(parts["audio"].numpy(), want_audio, rtol=1e-6)
        np.testing.assert_allclose(parts["video"].numpy(), want_video, rtol=1e-6)
        np.testing.assert_allclose(parts["joint"].numpy(), share(f, "av_sync"), rtol=1e-6)
    # the wrong sound costs the audio (and the sync), never the picture
    p_good, p_bad = modality_parts(trajectory_checks(good)), modality_parts(trajectory_checks(bad))
    assert torch.equal(p_good["video"], p_bad["video"])
    assert (p_bad["audio"] < p_good["audio"]).any()
    # the all-pass score has no additive split: it is joint
    assert asyncio.run(build_scorer("avbench", {"mode": "overall"}).score(good)).parts == {}


def test_the_av_model_scorers_declare_their_modality() -> None:
    """CLAP judges the sound against the text (audio); ImageBind the sound against the picture
    (joint: both modalities' credit shares it)."""
    from diffrl.reward.scorers.clap import ClapScorer
    from diffrl.reward.scorers.imagebind import ImageBindAVScorer

    assert ClapScorer.modality == "audio"
    assert ImageBindAVScorer.modality == "joint"
