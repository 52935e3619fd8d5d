"""Audio-video rewards on a real rollout: clips sampled from the shipped AVBench base (the tiny
MiniMax-H3, preset h3-avbench) scored by CLAP and the ImageBind-style AV scorer in one pool,
whose reward is their weighted sum; and a scorer whose input no producer sets is refused at
start-up, naming the field.

The tiny CLAP checkpoint and the scripted AV embedder are test_model_scorers.py's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_model_scorers import CLAP_RATE, TinyAV, clap_dir  # noqa: F401  (clap_dir: a fixture)

from diffrl.build import prompt_set
from diffrl.errors import DiffrlError
from diffrl.models.registry import ModelConfig, load_model
from diffrl.reward.pool import RewardConfig, RewardFailure, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import TaskConfig, build_task
from diffrl.types import Trajectory

pytest.importorskip("diffusers")

GROUP = 2  # samples per prompt
WEIGHTS = {"clap": 0.7, "imagebind_av": 0.3}


@pytest.fixture(scope="module")
def av_traj() -> Trajectory:
    """2 AVBench prompts x 2 samples from the shipped base, 3 ODE steps (no LoRA: the base)."""
    model = load_model(
        ModelConfig(family="minimax_h3", preset="h3-avbench", weights="builtin:avbench_h3")
    )
    task = build_task(TaskConfig(task="avbench"))
    prompts = prompt_set(task, model, task.prompts("train")[:2])
    engine = RolloutEngine(
        model, RolloutConfig(group_size=GROUP, num_steps=3), [], torch.device("cpu")
    )
    return asyncio.run(engine.generate(prompts.all(), seed=0))


@pytest.fixture(scope="module")
def av_embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TinyAV scripted and saved, as the ImageBind-style scorer loads a real embedder."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_av") / "av.pt"
    torch.jit.script(TinyAV().eval()).save(str(path))
    return path


def test_the_rollout_carries_audio_and_video(av_traj: Trajectory) -> None:
    f = av_traj.extra_fields
    assert f["video"].shape == (4, 12, 16, 16, 3) and f["video"].dtype == torch.uint8
    assert f["audio"].shape == (4, 6000) and f["audio"].is_floating_point()  # 0.75 s at 8 kHz
    assert f["sample_rate"].tolist() == [CLAP_RATE] * 4
    assert torch.isfinite(f["audio"]).all() and f["audio"].abs().max() > 0  # real sound
    assert av_traj.prompts.cond is None  # T2VA: the text only


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_clap_and_av_pool_is_the_weighted_sum(
    av_traj: Trajectory,
    clap_dir: Path,  # noqa: F811
    av_embedder: Path,
) -> None:
    """reward = 0.7 * clap + 0.3 * imagebind_av per sample; each scorer's scores and metrics
    are reported under its own name, and equal what the scorer gives alone."""
    rate = int(av_traj.extra_fields["sample_rate"][0])  # the rollout's rate, told to each scorer
    params = {
        "clap": {"path": str(clap_dir), "sample_rate": rate},
        "imagebind_av": {"path": str(av_embedder), "sample_rate": rate},
    }
    pool = RewardPool(
        RewardConfig(scorers=[ScorerConfig(k, WEIGHTS[k], params=params[k]) for k in WEIGHTS])
    )
    pool.check_inputs(produced={"video", "fps", "image", "audio", "sample_rate"})
    scored, metrics = asyncio.run(pool.score(av_traj))

    assert set(scored.per_scorer) == set(WEIGHTS)
    for key, scores in scored.per_scorer.items():
        assert scores.shape == (4,) and torch.isfinite(scores).all(), key
    assert scored.valid.all() and torch.isfinite(scored.rewards).all()
    want = sum(WEIGHTS[k] * scored.per_scorer[k] for k in WEIGHTS)
    torch.testing.assert_close(scored.rewards, want, rtol=0, atol=1e-6)
    assert scored.rewards.tolist() != scored.per_scorer["clap"].tolist()  # both weighed in
    # no normalisation in the pool: each entry is the scorer's own score
    for (sc, scorer), key in zip(pool.scorers, WEIGHTS, strict=True):
        alone: ScoreResult = asyncio.run(scorer.score(av_traj))
        torch.testing.assert_close(scored.per_scorer[key], alone.scores, rtol=0, atol=0)
        assert sc.key == key
    assert scored.per_scorer["clap"].abs().max() <= 1 + 1e-5  # a cosine
    for key in WEIGHTS:
        assert metrics[f"reward/{key}/mean"] == pytest.approx(
            float(scored.per_scorer[key].double().mean())
        )
        assert metrics[f"reward/{key}/valid_frac"] == 1.0
    assert metrics["reward/mean"] == pytest.approx(float(want.double().mean()))
    assert metrics["reward/clap/mean"] != metrics["reward/imagebind_av/mean"]


# --- a field no producer sets -------------------------------------------------------------


@dataclass
class DepthScorer:
    """Reads a field ("depth") that no engine produces."""

    name: str = "depth_consistency"
    needs: frozenset[str] = frozenset({"depth"})

    async def score(self, traj: Trajectory) -> ScoreResult:
        raise AssertionError("never reached: the pool refuses it first")


register_scorer("test_depth_consistency")(DepthScorer)

IMAGE_FAMILY_PRODUCES = {"image"}  # what an image family's rollout carries (e.g. sd3, flux)


def test_clap_on_an_image_family_is_refused_at_start_up(clap_dir: Path) -> None:  # noqa: F811
    pool = RewardPool(RewardConfig(scorers=[ScorerConfig("clap", params={"path": str(clap_dir)})]))
    with pytest.raises(DiffrlError, match=r"scorer 'clap' needs \['audio'\]") as err:
        pool.check_inputs(produced=IMAGE_FAMILY_PRODUCES)
    assert "produces ['image']" in str(err.value)
    pool.check_inputs(produced={"image", "audio"})  # an omni rollout: accepted


def test_unknown_field_is_refused_at_start_up() -> None:
    pool = RewardPool(RewardConfig(scorers=[ScorerConfig("test_depth_consistency")]))
    with pytest.raises(DiffrlError, match=r"'depth_consistency' needs \['depth'\]"):
        pool.check_inputs(produced={"video", "fps", "image", "audio", "sample_rate"})


def test_the_per_batch_check_names_the_producer(
    clap_dir: Path,  # noqa: F811
    media_traj,
) -> None:
    """A trajectory that lacks a field at scoring time: the error names the field and the
    engine that should have set it (scorer.PRODUCERS), or says no producer is known."""
    pool = RewardPool(RewardConfig(scorers=[ScorerConfig("clap", params={"path": str(clap_dir)})]))
    image_only = media_traj(["a dog barks"], image=torch.zeros(1, 8, 8, 3, dtype=torch.uint8))
    with pytest.raises(RewardFailure, match=r"'audio' is set by the rollout engine \(omni audio"):
        asyncio.run(pool.score(image_only))
    depth = RewardPool(RewardConfig(scorers=[ScorerConfig("test_depth_consistency")]))
    with pytest.raises(RewardFailure, match="'depth' is set by an unknown producer"):
        asyncio.run(depth.score(image_only))


def test_start_up_check_names_the_producer(clap_dir: Path) -> None:  # noqa: F811
    pool = RewardPool(RewardConfig(scorers=[ScorerConfig("clap", params={"path": str(clap_dir)})]))
    with pytest.raises(DiffrlError, match="omni audio decoder"):
        pool.check_inputs(produced=IMAGE_FAMILY_PRODUCES)
