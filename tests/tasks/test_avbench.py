"""AVBench: the renderer, the exact verifiers (pass on ground truth, fail on each corruption),
the split, the task's held-out eval and the scorer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from scipy import ndimage

from diffrl.reward.scorers import build_scorer
from diffrl.tasks import Prompt, TaskConfig, build_task
from diffrl.tasks.avbench import render, render_batch, trajectory_checks
from diffrl.tasks.avbench.prompts import all_prompts, make_prompt, parse_prompt, split_prompts
from diffrl.tasks.avbench.render import (
    FPS,
    FRAMES,
    SAMPLE_RATE,
    SAMPLES,
    SIZE,
    ClipSpec,
    contact_frames,
)
from diffrl.tasks.avbench.verify import (
    VERIFIERS,
    analyze_audio,
    analyze_video,
    verify_clips,
    verify_frames,
    verify_sync,
    verify_text_audio,
    verify_visual,
)
from diffrl.types import PromptBatch, Trajectory

RED_TWICE_HIGH = make_prompt("red", 2, "high")
CHECKS = ("pitch", "beep_count", "sync", "color", "bounce_count")


def failing(video, audio, prompt, **kw) -> set[str]:
    checks = verify_clips(video[None], audio[None], [prompt], FPS, SAMPLE_RATE, **kw)
    return {name for name, ok in checks.passed.items() if not ok[0]}


# --------------------------------------------------------------------------- renderer


def test_render_shapes_and_determinism() -> None:
    video, audio = render(RED_TWICE_HIGH, seed=3)
    assert video.shape == (FRAMES, SIZE, SIZE, 3) and video.dtype == np.uint8
    assert audio.shape == (SAMPLES,) and audio.dtype == np.float32
    assert np.abs(audio).max() <= 1.0
    again = render(RED_TWICE_HIGH.text, seed=3)  # a text renders as its parsed prompt
    np.testing.assert_array_equal(again[0], video)
    np.testing.assert_array_equal(again[1], audio)
    other = render(RED_TWICE_HIGH, seed=4)
    assert not np.array_equal(other[0], video) and not np.array_equal(other[1], audio)
    batch_v, batch_a = render_batch([RED_TWICE_HIGH, RED_TWICE_HIGH.text], [3, 4])
    np.testing.assert_array_equal(batch_v[0], video)
    np.testing.assert_array_equal(batch_a[1], other[1])


def test_contacts_and_beeps_fall_where_the_prompt_says() -> None:
    for n in (1, 2, 3):
        video, audio = render(make_prompt("blue", n, "low"), seed=0)
        np.testing.assert_array_equal(analyze_video(video).contacts, contact_frames(n))
        events = analyze_audio(audio, SAMPLE_RATE)
        np.testing.assert_allclose(events.times * FPS, contact_frames(n), atol=0.2)
        np.testing.assert_allclose(events.pitches, 300.0, atol=10.0)


def test_other_clip_geometries_render_verifiable_clips() -> None:
    """A model's own frame count, size and rates (e.g. 10 frames at 24 fps, 64 px, 24 kHz)."""
    spec = ClipSpec(frames=10, size=64, fps=24, sample_rate=24000)
    prompts = all_prompts()
    video, audio = render_batch(prompts, None, spec)
    assert video.shape == (36, 10, 64, 64, 3) and audio.shape == (36, 10000)
    assert verify_clips(video, audio, prompts, spec.fps, spec.sample_rate).overall.all()
    with pytest.raises(ValueError, match="frames >= 10"):
        ClipSpec(frames=8)


# --------------------------------------------------------------------------- verifiers


def test_verifiers_pass_on_every_ground_truth_prompt() -> None:
    prompts = all_prompts()
    video, audio = render_batch(prompts, list(range(len(prompts))))
    checks = verify_clips(video, audio, prompts, FPS, SAMPLE_RATE)
    assert set(checks.passed) == set(CHECKS)
    assert checks.overall.all()
    assert all((f == 1.0).all() for f in checks.fractions.values())
    # the per-verifier entry points agree with the combined one
    for part in (
        verify_text_audio(audio, prompts, SAMPLE_RATE),
        verify_sync(video, audio, FPS, SAMPLE_RATE),
        verify_visual(video, prompts),
    ):
        assert all(v.all() for v in part.passed.values())


def test_verifiers_tolerate_noise_and_blur() -> None:
    """A generator's clips are never clean: pixel noise, soft edges, a noise floor."""
    prompts = all_prompts()
    video, audio = render_batch(prompts, list(range(len(prompts))))
    rng = np.random.default_rng(0)
    soft = ndimage.gaussian_filter(video.astype(np.float64), sigma=(0, 0, 0.8, 0.8, 0))
    noisy = np.clip(soft + rng.normal(0, 8, video.shape), 0, 255).astype(np.uint8)
    hiss = np.clip(audio + rng.normal(0, 0.03, audio.shape), -1, 1).astype(np.float32)
    checks = verify_clips(noisy, hiss, prompts, first=video[:, 0], last=video[:, -1])
    assert {k: v.mean() for k, v in checks.passed.items()} == dict.fromkeys(
        (*CHECKS, "frames"), 1.0
    )


@pytest.mark.parametrize(
    ("corrupt", "expected"),
    [
        # wrong colour: the video of a green ball
        (lambda v, a: (render(make_prompt("green", 2, "high"))[0], a), {"color"}),
        # wrong pitch: the audio of low beeps
        (lambda v, a: (v, render(make_prompt("red", 2, "low"))[1]), {"pitch"}),
        # wrong count in the audio: three beeps (also out of sync with two bounces)
        (lambda v, a: (v, render(make_prompt("red", 3, "high"))[1]), {"beep_count", "sync"}),
        # wrong count in the video: three bounces (also out of sync with two beeps)
        (lambda v, a: (render(make_prompt("red", 3, "high"))[0], a), {"bounce_count", "sync"}),
        # audio offset by two frames: right pitch and count, out of sync
        (lambda v, a: (v, np.roll(a, 2 * SAMPLE_RATE // FPS)), {"sync"}),
        # silence: no beeps at all
        (lambda v, a: (v, np.zeros_like(a)), {"pitch", "beep_count", "sync"}),
        # a blank video: no ball to see or track
        (lambda v, a: (np.full_like(v, 30), a), {"color", "bounce_count", "sync"}),
    ],
)
def test_verifiers_fail_on_each_corruption(corrupt, expected) -> None:
    video, audio = render(RED_TWICE_HIGH, seed=1)
    assert failing(video, audio, RED_TWICE_HIGH) == set()
    video, audio = corrupt(video, audio)
    assert failing(video, audio, RED_TWICE_HIGH) == expected


def _second_ball(video: np.ndarray, frames: slice, radius: float = 4.0) -> np.ndarray:
    """The clip with a second red ball in `frames`, high up on the side the real one is not
    (trained T2VA clips hedge the start side that way in their first frames)."""
    out = video.copy()
    rows, cols = np.indices(video.shape[1:3]) + 0.5
    for f in range(*frames.indices(len(video))):
        ball_cx = cols[np.abs(video[f].astype(int) - video[f, 0, 0]).max(axis=-1) > 48].mean()
        cx = 6.0 if ball_cx > 16 else 26.0  # >= 9 px from the real ball's centre
        out[f, (cols - cx) ** 2 + (rows - 6.0) ** 2 <= radius**2] = (255, 0, 0)
    return out


@pytest.mark.parametrize(
    ("frames", "radius"),
    [(slice(0, 3), 4.0), (slice(0, 1), 4.0), (slice(5, 6), 3.0), (slice(0, 12), 4.0)],
)
def test_a_second_ball_in_any_frame_fails_the_visual_checks(frames, radius) -> None:
    """A second object as small as 3/4 of the ball's radius, in as few as one frame, leaves no
    single trajectory: colour, bounces and sync fail, and no fraction rewards it."""
    video, audio = render(RED_TWICE_HIGH, seed=1)
    doubled = _second_ball(video, frames, radius)
    track = analyze_video(doubled)
    assert not track.one_ball and track.objects.max() == 2
    assert failing(doubled, audio, RED_TWICE_HIGH) == {"color", "bounce_count", "sync"}
    checks = verify_clips(doubled[None], audio[None], [RED_TWICE_HIGH])
    shown = (track.objects == 2).mean()
    assert checks.fractions["color"][0] == pytest.approx(min(1 - shown, 0.99))
    assert checks.fractions["bounce_count"][0] == 0.0 and checks.fractions["sync"][0] == 0.0


def test_a_ball_that_vanishes_fails_the_visual_checks() -> None:
    video, audio = render(RED_TWICE_HIGH, seed=1)
    background = tuple(int(c) for c in np.median(video[0].reshape(-1, 3), axis=0))
    for frames in (slice(4, 6), slice(11, 12)):
        gone = video.copy()
        gone[frames] = background  # the ball is painted over
        assert not analyze_video(gone).one_ball
        assert failing(gone, audio, RED_TWICE_HIGH) == {"color", "bounce_count", "sync"}
    # a ball that shrinks to a speck (under a third of its area) has vanished too
    track = analyze_video(video)
    speck = video.copy()
    speck[6] = background
    speck[6, int(track.cy[6]) - 1 : int(track.cy[6]) + 1, 14:17] = (255, 0, 0)  # 6 px
    assert analyze_video(speck).objects[6] == 0
    assert failing(speck, audio, RED_TWICE_HIGH) == {"color", "bounce_count", "sync"}


def test_noise_makes_no_second_object() -> None:
    """Pixel noise twice the tolerance test's (N(0, 16)) leaves one object in every frame."""
    prompts = all_prompts()
    video, _ = render_batch(prompts, list(range(len(prompts))))
    rng = np.random.default_rng(1)
    noisy = np.clip(video + rng.normal(0, 16, video.shape), 0, 255).astype(np.uint8)
    assert all(analyze_video(clip).one_ball for clip in noisy)
    # nor does a stray spot under a third of the ball's area (6 px at 32)
    spotted = video[0].copy()
    spotted[:, 1:3, 1:4] = (255, 0, 0)
    assert analyze_video(spotted).one_ball


def test_fractions_give_partial_credit() -> None:
    video, _ = render(RED_TWICE_HIGH)
    _, three_beeps = render(make_prompt("red", 3, "high"))
    checks = verify_clips(video[None], three_beeps[None], [RED_TWICE_HIGH])
    assert checks.fractions["beep_count"][0] == pytest.approx(0.5)  # 1 - |3 - 2| / 2
    assert 0 < checks.fractions["sync"][0] < 1  # some beeps land on contacts, not all
    assert checks.fractions["pitch"][0] == 1.0 and checks.passed["pitch"][0]
    assert 0 < checks.partial[0] < 1


def test_frames_verifier_matches_first_and_last_frames() -> None:
    video, audio = render(RED_TWICE_HIGH, seed=2)
    first, last = video[0][None], video[-1][None]
    assert verify_frames(video[None], first, last).passed["frames"].all()
    assert failing(video, audio, RED_TWICE_HIGH, first=first, last=last) == set()
    for wrong in ("yellow", "green", "blue"):  # the same motion, another colour
        other = render(make_prompt(wrong, 2, "high"), seed=2)[0]
        checks = verify_frames(other[None], first, last)
        assert not checks.passed["frames"][0] and checks.fractions["frames"][0] == 0.0
    shifted = np.roll(video, 6, axis=2)  # the ball 6 px to the side
    assert not verify_frames(shifted[None], first, last).passed["frames"][0]
    half = video.copy()
    half[-1] = np.roll(video[-1], 6, axis=1)  # only the last frame is wrong
    assert verify_frames(half[None], first, last).fractions["frames"][0] == 0.5


# --------------------------------------------------------------------------- prompts


def test_split_is_deterministic_disjoint_and_compositional() -> None:
    train, test = split_prompts("train"), split_prompts("test")
    assert len(train) + len(test) == len(all_prompts()) == 36 and len(test) == 8
    assert not {p.text for p in train} & {p.text for p in test}
    for p in all_prompts():  # every word and every attribute pair is seen in training
        assert sum(q.color == p.color and q.bounces == p.bounces for q in train) >= 2
        assert sum(q.color == p.color and q.pitch == p.pitch for q in train) >= 2
        assert sum(q.bounces == p.bounces and q.pitch == p.pitch for q in train) >= 2
    assert parse_prompt("a red ball bounces twice, high beeps") == RED_TWICE_HIGH
    with pytest.raises(ValueError, match="outside the AVBench grammar"):
        parse_prompt("a red ball bounces four times, high beeps")


# --------------------------------------------------------------------------- task + scorer


def fake_trajectory(prompts: list[Prompt], g: int = 2, shuffle_audio: bool = False):
    texts = tuple(p.text for p in prompts for _ in range(g))
    n = len(texts)
    seeds = list(range(n))
    video, audio = render_batch(list(texts), seeds)
    if shuffle_audio:  # each clip gets the next prompt's sound
        audio = np.roll(audio, g, axis=0)
    batch = PromptBatch(
        texts=texts,
        input_ids=torch.zeros(n, 4, dtype=torch.int64),
        ids_hash=tuple(str(i) for i in range(n)),
        prompt_ids=torch.arange(len(prompts)).repeat_interleave(g),
    )
    return Trajectory(
        prompts=batch,
        group=batch.prompt_ids.clone(),
        seeds=torch.tensor(seeds),
        x0=torch.zeros(n, 1),
        extra_fields={
            "video": torch.from_numpy(video),
            "audio": torch.from_numpy(audio),
            "fps": torch.full((n,), FPS),
            "sample_rate": torch.full((n,), SAMPLE_RATE),
        },
    )


@pytest.mark.parametrize("name", ["avbench", "avbench_fl2va"])
def test_task_splits_and_modes(name) -> None:
    task = build_task(TaskConfig(task=name))
    assert task.name == name and task.fl2va == (name == "avbench_fl2va")
    assert task.prompts("train") == [Prompt(p.text) for p in split_prompts("train")]
    assert task.prompts("test") == [Prompt(p.text) for p in split_prompts("test")]
    probe = task.probe_data(n=3)  # ground-truth clips for the joint-latent probe
    assert probe.pixels is None and probe.texts == [p.text for p in split_prompts("train")[:3]]
    assert probe.video.shape == (3, 12, 32, 32, 3) and probe.audio.shape == (3, 6000)
    conds = task.conditions(RED_TWICE_HIGH.text, seed=5)
    video, _ = render(RED_TWICE_HIGH, seed=5)
    np.testing.assert_array_equal(conds["first_frame"], video[0])
    np.testing.assert_array_equal(conds["last_frame"], video[-1])


def test_i2av_mode_gives_the_first_frame_alone() -> None:
    """avbench_i2av: the FL2VA task's first frame, nothing else; graded by the T2VA checks."""
    i2av, fl2va = (
        build_task(TaskConfig(task="avbench_i2av")),
        build_task(TaskConfig(task="avbench_fl2va")),
    )
    assert i2av.needs_conditions and not i2av.fl2va and i2av.i2av
    assert build_task(TaskConfig(task="avbench")).prompt_conditions([], {}) is None
    prompts = i2av.prompts("train")[:2]
    geometry = dict(frames=11, size=32, fps=24.0, sample_rate=16000)
    got, full = (
        i2av.prompt_conditions(prompts, geometry),
        fl2va.prompt_conditions(prompts, geometry),
    )
    assert [set(c) for c in got] == [{"first_frame"}] * 2
    for g, f in zip(got, full, strict=True):
        np.testing.assert_array_equal(g["first_frame"], f["first_frame"])


def test_evaluate_on_ground_truth_and_on_shuffled_audio() -> None:
    task = build_task(TaskConfig(task="avbench"))
    prompts = task.prompts("test")
    traj = fake_trajectory(prompts)
    result = asyncio.run(task.evaluate(traj, rewards=None))
    assert result.metrics["eval/overall"] == 1.0
    want = {f"eval/{c}" for c in CHECKS} | {f"eval/{v}" for v in VERIFIERS if v != "frames"}
    assert set(result.metrics) == want | {"eval/overall"}
    assert all(v == 1.0 for v in result.metrics.values())
    assert result.captions == [p.text for p in prompts] and result.ok == [True] * len(prompts)
    video = traj.extra_fields["video"].numpy()
    np.testing.assert_array_equal(result.images, video[::2, FRAMES // 2])

    shuffled = asyncio.run(task.evaluate(fake_trajectory(prompts, shuffle_audio=True)))
    assert shuffled.metrics["eval/overall"] < 1.0
    assert shuffled.metrics["eval/text_audio"] < 1.0
    assert shuffled.metrics["eval/visual"] == 1.0  # the pictures are untouched


def test_fl2va_evaluate_grades_the_conditions() -> None:
    """Without carried frames the canonical conditions (seed 0) are the reference: clips
    rendered with seed 0 match them, clips of other seeds start elsewhere and do not."""
    task = build_task(TaskConfig(task="avbench_fl2va"))
    prompts = task.prompts("test")[:3]
    traj = fake_trajectory(prompts, g=1)
    result = asyncio.run(task.evaluate(traj))
    assert "eval/frames" in result.metrics
    video = traj.extra_fields["video"]
    carried = traj.with_fields(first_frame=video[:, 0], last_frame=video[:, -1])
    assert asyncio.run(task.evaluate(carried)).metrics["eval/overall"] == 1.0
    canonical = [render(p.text, 0)[0] for p in prompts]
    at_seed0 = traj.with_fields(video=torch.from_numpy(np.stack(canonical)))
    assert trajectory_checks(at_seed0, fl2va=True).passed["frames"].all()
    mixed = traj.with_fields(
        first_frame=torch.from_numpy(np.stack([c[0] for c in canonical[::-1]])),
        last_frame=torch.from_numpy(np.stack([c[-1] for c in canonical[::-1]])),
    )
    assert asyncio.run(task.evaluate(mixed)).metrics["eval/frames"] < 1.0


def test_scorer_needs_and_values() -> None:
    strict, partial = build_scorer("avbench", {"mode": "overall"}), build_scorer("avbench")
    assert strict.needs == partial.needs == frozenset({"video", "audio"})
    with pytest.raises(ValueError, match="mode"):
        build_scorer("avbench", {"mode": "graded"})
    prompts = split_prompts("test")[:4]
    good = fake_trajectory([Prompt(p.text) for p in prompts], g=1)
    result = asyncio.run(strict.score(good))
    assert result.scores.tolist() == [1.0] * 4 and result.valid.all()
    assert result.metrics["accuracy"] == 1.0
    assert asyncio.run(partial.score(good)).scores.tolist() == [1.0] * 4
    # the sound of the wrong prompt: strict gives 0 on every broken clip, partial something
    bad = fake_trajectory([Prompt(p.text) for p in prompts], g=1, shuffle_audio=True)
    s, p = asyncio.run(strict.score(bad)).scores, asyncio.run(partial.score(bad)).scores
    assert (p >= s).all() and (s < 1).any()
    assert ((p > 0) & (p < 1))[s == 0].all()
    fl2va = build_scorer("avbench", {"mode": "overall", "fl2va": True})
    video = good.extra_fields["video"]
    carried = good.with_fields(first_frame=video[:, 0], last_frame=video[:, -1])
    assert asyncio.run(fl2va.score(carried)).metrics["frames"] == 1.0
    # without carried frames the reference is each prompt's seed-0 render (row 0's seed);
    # seed 1 starts the ball elsewhere on another background
    scores = asyncio.run(fl2va.score(good)).scores.tolist()
    assert scores[:2] == [1.0, 0.0]
