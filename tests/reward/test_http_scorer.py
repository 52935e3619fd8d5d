"""The reward HTTP path against a real local server: the remote scorer must give exactly the
rewards the in-process one gives, and the server must refuse what it should (auth, size,
missing fields) with the right status and a message that names the problem."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from reward_server import serve_reward_cli

from diffrl.cli import main
from diffrl.config import DEFAULT_RECIPE, load_config
from diffrl.reward.http import HttpScorer, RewardRequestRejected, codec
from diffrl.reward.http.server import (
    BackgroundServer,
    ScoreRequest,
    build_trajectory,
    check_bind,
    create_app,
    decode_media,
    is_loopback,
)
from diffrl.reward.pool import RewardPool
from diffrl.reward.scorer import ScoreResult
from diffrl.reward.scorers import build_scorer
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.tasks.shapes.scorer import ShapesScorer
from diffrl.types import PromptBatch, Trajectory

TOKEN = "test-token-123"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TOKEN_ENV = codec.TOKEN_ENV


def make_traj(n: int, fields: dict[str, torch.Tensor] | None = None) -> Trajectory:
    """n ShapesBench prompts; images are ground-truth renders except every third is blank, so
    the scores are not all equal."""
    prompts = split_prompts("train")[:n]
    rng = np.random.default_rng(0)
    images = np.stack([render(p, rng) for p in prompts])
    images[::3] = 0
    batch = PromptBatch(
        texts=tuple(p.text for p in prompts),
        input_ids=torch.zeros((n, 1), dtype=torch.long),
        ids_hash=("",) * n,
        prompt_ids=torch.arange(n),
    )
    return Trajectory(
        prompts=batch,
        group=torch.arange(n) // 2,
        seeds=torch.arange(n),
        x0=torch.zeros(n, 3, 32, 32),
        sigmas=torch.tensor([1.0, 0.0]),
        policy_version=3,
        extra_fields=fields if fields is not None else {"image": torch.from_numpy(images)},
    )


def score_remote(scorer: HttpScorer, traj: Trajectory) -> ScoreResult:
    """Score in a fresh event loop and close the client inside it: its pooled sockets belong
    to that loop."""

    async def go() -> ScoreResult:
        try:
            return await scorer.score(traj)
        finally:
            await scorer.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    app = create_app(build_scorer("shapes"), TOKEN, max_batch=8, max_body_bytes=200_000)
    with BackgroundServer(app) as srv:
        yield srv


def test_round_trip_matches_local_scorer(server, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    traj = make_traj(7)
    local = asyncio.run(build_scorer("shapes").score(traj))
    assert len(set(local.scores.tolist())) > 1  # a meaningful comparison
    for batch_size in (0, 3):  # one request, and three requests of <= 3 samples
        remote = build_scorer("http", {"url": server.url + "/", "batch_size": batch_size})
        result = score_remote(remote, traj)
        assert torch.equal(result.scores, local.scores)  # PNG is lossless: exactly equal
        assert result.valid.all()
        assert result.metrics["accuracy"] == pytest.approx(local.metrics["accuracy"])
        assert result.metrics["http_attempts"] == (1 if batch_size == 0 else 3)


def test_health(server) -> None:
    r = httpx.get(f"{server.url}/health", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {
        "status": "ok",
        "scorer": "shapes",
        "needs": ["image"],
        "params": {"mode": "partial"},  # the constructor's default, built here directly
        "max_batch": 8,
        "max_body_bytes": 200_000,
        "max_request_pixels": 32 << 20,
    }


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {TOKEN}"}],
    ids=["none", "wrong-token", "wrong-scheme"],
)
def test_401_without_the_right_token(server, headers) -> None:
    for method, path in (("GET", "/health"), ("POST", "/score")):
        r = httpx.request(method, server.url + path, headers=headers, json={"prompts": []})
        assert r.status_code == 401, (method, path)
        assert r.headers["www-authenticate"] == "Bearer"


def test_client_with_wrong_token_gets_clear_error(server, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "not-the-token")
    remote = build_scorer("http", {"url": server.url, "retries": 3})
    with pytest.raises(RewardRequestRejected, match=f"HTTP 401.*token in \\${TOKEN_ENV}") as e:
        score_remote(remote, make_traj(2))
    assert e.value.status == 401 and remote.attempts == 1  # never retried


def test_413_on_oversize_body_and_batch(server, monkeypatch) -> None:
    big = {"prompts": ["x"], "images": ["A" * 250_000]}
    r = httpx.post(f"{server.url}/score", json=big, headers=AUTH)
    assert r.status_code == 413 and "over the limit of 200000 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(30):
            yield b" " * 10_000

    r = httpx.post(f"{server.url}/score", content=chunks(), headers=AUTH)
    assert r.status_code == 413
    r = httpx.post(f"{server.url}/score", json={"prompts": ["x"] * 9}, headers=AUTH)
    assert r.status_code == 413 and "max batch of 8" in r.json()["detail"]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(RewardRequestRejected, match="HTTP 413.*batch_size"):
        score_remote(HttpScorer(server.url), make_traj(9))


def test_422_names_the_problem(server, monkeypatch) -> None:
    png = codec.encode_png(np.zeros((32, 32, 3), np.uint8))
    small = codec.encode_png(np.zeros((16, 16, 3), np.uint8))
    cases = {
        "missing field 'images'": {"prompts": ["a"]},
        "missing field 'prompts'": {"images": [png]},
        "'images' has 2 entries but 'prompts' has 1": {"prompts": ["a"], "images": [png, png]},
        "images[1] is not a PNG": {"prompts": ["a", "b"], "images": [png, "AAAA"]},
        "images[1] is not valid base64": {"prompts": ["a", "b"], "images": [png, "%%"]},
        "images[1] is 16x16 px but images[0] is 32x32": {
            "prompts": ["a", "b"],
            "images": [png, small],
        },
        "metadata.group must be a list of 1 integers": {
            "prompts": ["a"],
            "images": [png],
            "metadata": {"group": [0, 1]},
        },
    }
    for message, body in cases.items():
        r = httpx.post(f"{server.url}/score", json=body, headers=AUTH)
        assert r.status_code == 422, (message, r.text)
        assert message in r.json()["detail"]
    r = httpx.post(f"{server.url}/score", content=b"{oops", headers=AUTH)
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    # the client surfaces a 422 at once, naming the field the server missed
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    remote = HttpScorer(server.url, needs=[])
    with pytest.raises(RewardRequestRejected, match="HTTP 422.*'images'"):
        score_remote(remote, make_traj(2))
    assert remote.attempts == 1


class MediaScorer:
    """Reads video and audio; returns NaN for sample 1 and a NaN metric, to test the path of
    every media type and the NaN -> null -> NaN round trip."""

    name = "media_probe"
    needs = frozenset({"video", "audio"})
    sample_rate = 8000  # the server refuses audio at any other rate

    def __init__(self) -> None:
        self.seen: Trajectory | None = None

    async def score(self, traj: Trajectory) -> ScoreResult:
        self.seen = traj
        video = traj.extra_fields["video"].float().mean(dim=(1, 2, 3, 4))
        audio = traj.extra_fields["audio"].float().mean(dim=-1)
        scores = video + audio
        scores[1] = float("nan")
        valid = torch.ones(len(scores), dtype=torch.bool)
        return ScoreResult(scores, valid, {"bad": float("nan")})


def test_video_audio_and_nan_scores_round_trip(monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    n = 3
    video = torch.randint(0, 256, (n, 2, 8, 8, 3), dtype=torch.uint8)
    audio = torch.linspace(-0.5, 0.5, n * 100).reshape(n, 100)
    probe = MediaScorer()
    with BackgroundServer(create_app(probe, None)) as srv:
        remote = HttpScorer(srv.url, needs=["video", "audio"], audio_sample_rate=8000)
        traj = make_traj(n, {"video": video, "audio": audio})
        result = score_remote(remote, traj)
        wrong_rate = HttpScorer(srv.url, needs=["video", "audio"], audio_sample_rate=16000)
        with pytest.raises(RewardRequestRejected, match="HTTP 422.*16000 Hz.*expects 8000 Hz"):
            score_remote(wrong_rate, traj)
    assert torch.equal(probe.seen.extra_fields["video"], video)
    assert torch.allclose(probe.seen.extra_fields["audio"], audio, atol=1 / 32767)
    assert probe.seen.group.tolist() == [0, 0, 1] and probe.seen.policy_version == 3
    assert result.valid.tolist() == [True, False, True]
    assert torch.isnan(result.scores[1])  # missing, not 0
    expected = video.float().mean(dim=(1, 2, 3, 4)) + audio.mean(dim=-1)
    assert torch.allclose(result.scores[[0, 2]], expected[[0, 2]], atol=1e-3)
    assert "bad" not in result.metrics  # a NaN metric travels as null and is dropped


def test_codec_round_trips() -> None:
    img = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    raw, size = codec.png_size(codec.encode_png(img), "x")
    assert size == (7, 5) and np.array_equal(codec.decode_png(raw, "x"), img)
    stereo = np.stack([np.linspace(-1, 1, 50), np.linspace(1, -1, 50)]).astype(np.float32)
    out, rate = codec.decode_wav(codec.encode_wav(stereo, 22050), "a")
    assert rate == 22050 and out.shape == (2, 50) and np.allclose(out, stereo, atol=1e-4)
    req = ScoreRequest(["a"], {"image": [codec.encode_png(img)]}, {})
    with pytest.raises(codec.TooLargeError):
        decode_media(req, max_decoded_bytes=10)
    traj = build_trajectory(["a"], decode_media(req, 1 << 20), {})
    assert len(traj) == 1 and traj.x0.shape == (1, 3, 5, 7)


def test_scorer_exception_is_a_500_with_its_message() -> None:
    class Broken:
        name, needs = "broken", frozenset({"image"})

        async def score(self, traj):
            raise RuntimeError("model weights missing")

    png = codec.encode_png(np.zeros((4, 4, 3), np.uint8))
    with BackgroundServer(create_app(Broken(), None)) as srv:
        r = httpx.post(f"{srv.url}/score", json={"prompts": ["a"], "images": [png]})
    assert r.status_code == 500
    assert r.json()["detail"] == "scorer 'broken' failed: RuntimeError: model weights missing"


def test_loopback_rules(caplog) -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""):
        assert not is_loopback(host), host
    check_bind("0.0.0.0", "secret")  # a token makes any host fine
    with caplog.at_level("WARNING"):
        check_bind("127.0.0.1", None)
    assert "no authentication" in caplog.text


def test_cli_refuses_non_loopback_without_token(monkeypatch, capsys) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    code = main(["serve-reward", "--scorer", "shapes", "--host", "0.0.0.0", "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2 and TOKEN_ENV in err and "non-loopback" in err
    code = main(["serve-reward", "--scorer", "no_such_scorer", "--port", "1"])
    assert code == 2 and "unknown scorer 'no_such_scorer'" in capsys.readouterr().err
    code = main(["serve-reward", "--scorer", "shapes", "--scorer-param", "mode"])
    assert code == 2 and "expected key=value" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_reward_smoke(monkeypatch) -> None:
    """The real command in a subprocess, with a token. `--scorer shapes` scores as the default
    recipe does (mode=overall; the constructor's default is partial credit, which the command
    once served unannounced), and says so at start-up and in /health."""
    traj = make_traj(4)
    partial = ShapesScorer(mode="partial").score_sync(traj).scores.tolist()
    assert partial == [0.25, 1.0, 1.0, 0.25]  # the two modes differ on this batch
    with serve_reward_cli(TOKEN, "--max-batch", "16") as server:
        health = httpx.get(f"{server.url}/health", headers=AUTH, timeout=5).json()
        assert health["max_batch"] == 16 and health["params"] == {"mode": "overall"}
        assert "serving scorer 'shapes' (params {'mode': 'overall'}" in server.log()
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        result = score_remote(HttpScorer(server.url), traj)
        assert result.scores.tolist() == [0.0, 1.0, 1.0, 0.0]  # mode=overall, as the recipe
    (recipe_scorer,) = load_config(DEFAULT_RECIPE, []).reward.scorers  # what the server matches
    assert recipe_scorer.name == "shapes" and recipe_scorer.params == {"mode": "overall"}


def test_recipe_points_at_http_scorer() -> None:
    """The YAML from docs/reward_http.md builds an HttpScorer through the pool."""
    scorers = '[{name: http, params: {url: "http://127.0.0.1:8000", needs: [image]}}]'
    cfg = load_config(None, [f"reward.scorers={scorers}"])
    ((sc, scorer),) = RewardPool(cfg.reward).scorers
    assert isinstance(scorer, HttpScorer)
    assert scorer.url == "http://127.0.0.1:8000" and scorer.needs == {"image"}
    with pytest.raises(Exception, match="needs=.*unknown"):
        HttpScorer("http://x", needs=["smell"])
    with pytest.raises(Exception, match="http:// or https://"):
        HttpScorer("127.0.0.1:8000")
