"""HttpScorer under failure: what is retried (timeouts, refused connections, 429, 5xx), what
is not (other 4xx, malformed replies), and that every failure ends in an error that says what
happened -- or, for null/NaN scores, in missing samples, never in a silent 0."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from diffrl.reward.http import (
    HttpScorer,
    RewardReplyMalformed,
    RewardRequestRejected,
    RewardServerUnavailable,
)
from diffrl.reward.http import client as client_module
from diffrl.reward.http.client import backoff_delay, parse_retry_after, resolves_to_loopback
from diffrl.reward.http.codec import TOKEN_ENV
from diffrl.reward.http.server import BackgroundServer, create_app
from diffrl.reward.pool import RewardConfig, RewardFailure, RewardPool, ScorerConfig
from diffrl.reward.scorer import ScoreResult
from diffrl.reward.scorers import build_scorer
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.types import PromptBatch, Trajectory

N = 3
FAST = dict(timeout_s=1.0, retries=2, backoff_s=0.01, max_backoff_s=0.05)
Step = Callable[[int], Awaitable[Response]]


def make_traj(n: int = N) -> Trajectory:
    texts = tuple(p.text for p in split_prompts("train")[:n])
    batch = PromptBatch(texts, torch.zeros((n, 1), dtype=torch.long), ("",) * n, torch.arange(n))
    return Trajectory(
        prompts=batch,
        group=torch.arange(n),
        seeds=torch.zeros(n, dtype=torch.long),
        x0=torch.zeros(n, 3, 8, 8),
        sigmas=torch.tensor([1.0, 0.0]),
        policy_version=0,
        extra_fields={"image": torch.zeros(n, 8, 8, 3, dtype=torch.uint8)},
    )


# --- a scriptable fake reward server ---------------------------------------------------------


def ok(value: float = 0.5) -> Step:
    async def step(n: int) -> Response:
        return JSONResponse({"scores": [value] * n, "valid": [True] * n, "metrics": {}})

    return step


def status(code: int, headers: dict[str, str] | None = None) -> Step:
    async def step(n: int) -> Response:
        return JSONResponse({"detail": f"scripted {code}"}, status_code=code, headers=headers)

    return step


def raw(body: str, code: int = 200) -> Step:
    async def step(n: int) -> Response:
        return Response(body, status_code=code, media_type="application/json")

    return step


def slow(seconds: float) -> Step:
    async def step(n: int) -> Response:
        await asyncio.sleep(seconds)
        return await ok()(n)

    return step


class FakeServer:
    """Answers the k-th /score request with steps[k] (the last step repeats); counts calls."""

    def __init__(self, *steps: Step) -> None:
        self.steps, self.calls = list(steps), 0
        self.app = FastAPI()

        @self.app.post("/score")
        async def score(request: Request) -> Response:
            n = len((await request.json())["prompts"])
            step = self.steps[min(self.calls, len(self.steps) - 1)]
            self.calls += 1
            return await step(n)


@contextmanager
def serving(*steps: Step) -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer(*steps)
    with BackgroundServer(fake.app) as srv:
        yield fake, srv.url


def scorer(url: str, **kw) -> HttpScorer:
    return HttpScorer(url, **{**FAST, **kw})


def run(s: HttpScorer, traj: Trajectory | None = None) -> ScoreResult:
    """Score in a fresh event loop and close the client inside it (its sockets belong to
    that loop); later calls reopen it."""

    async def go() -> ScoreResult:
        try:
            return await s.score(traj or make_traj())
        finally:
            await s.close()

    return asyncio.run(go())


@pytest.fixture(autouse=True)
def _no_token(monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def dead_url() -> str:
    """A loopback port with nothing listening: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# --- transient failures: retried, then a clear error ------------------------------------------


def test_server_down_at_start_is_retried_then_fails() -> None:
    s = scorer(dead_url())
    with pytest.raises(RewardServerUnavailable, match=r"after 3 attempt\(s\).*ConnectError"):
        run(s)
    assert s.attempts == 3


def test_server_dying_mid_run() -> None:
    fake = FakeServer(ok(0.25))
    srv = BackgroundServer(fake.app).start()
    s = scorer(srv.url)
    try:
        assert run(s).scores.tolist() == [0.25] * N
    finally:
        srv.stop()
    with pytest.raises(RewardServerUnavailable, match=r"after 3 attempt\(s\)"):
        run(s)
    assert fake.calls == 1 and s.attempts == 4


def test_slow_server_times_out_and_is_retried() -> None:
    with serving(slow(1.0)) as (fake, url):
        s = scorer(url, timeout_s=0.2, retries=1)
        start = time.monotonic()
        with pytest.raises(RewardServerUnavailable, match=r"2 attempt\(s\).*timed out after 0.2s"):
            run(s)
        assert time.monotonic() - start < 0.9  # gave up on each attempt at the timeout
        assert fake.calls == 2


def test_500_twice_then_200_succeeds() -> None:
    with serving(status(500), status(503), ok(0.75)) as (fake, url):
        result = run(scorer(url))
    assert result.scores.tolist() == [0.75] * N and result.valid.all()
    assert fake.calls == 3 and result.metrics["http_attempts"] == 3


def test_5xx_until_retries_run_out() -> None:
    expected = r"3 attempt\(s\).*HTTP 502: scripted"
    with (
        serving(status(502)) as (fake, url),
        pytest.raises(RewardServerUnavailable, match=expected),
    ):
        run(scorer(url))
    assert fake.calls == 3


def test_429_honours_retry_after() -> None:
    with serving(status(429, {"Retry-After": "1"}), ok()) as (fake, url):
        start = time.monotonic()
        result = run(scorer(url, max_backoff_s=2.0))
        waited = time.monotonic() - start
    assert result.valid.all() and fake.calls == 2
    assert 0.95 <= waited < 2.5  # the server's 1 s, not the client's 0.01 s backoff


# --- permanent failures: one attempt, a clear error --------------------------------------------


@pytest.mark.parametrize("code", [400, 403, 404, 413, 422])
def test_other_4xx_is_not_retried(code: int) -> None:
    expected = f"HTTP {code}.*scripted {code}"
    with (
        serving(status(code)) as (fake, url),
        pytest.raises(RewardRequestRejected, match=expected) as e,
    ):
        run(scorer(url))
    assert e.value.status == code and fake.calls == 1


def test_missing_auth_is_a_clear_unretried_error() -> None:
    app = create_app(build_scorer("shapes"), token="server-secret")
    with BackgroundServer(app) as srv:
        s = scorer(srv.url)
        with pytest.raises(RewardRequestRejected, match=f"HTTP 401.*\\${TOKEN_ENV} is not set"):
            run(s)
    assert s.attempts == 1


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("<html>bad gateway</html>", "not JSON"),
        ('{"detail": "ok?"}', "no 'scores' field"),
        ('{"scores": 1.0}', "'scores' is a float, not a list"),
        ('{"scores": [1.0]}', "returned 1 scores for 3 samples"),
        ('{"scores": [1.0, 2.0, 3.0, 4.0]}', "returned 4 scores for 3 samples"),
        ('{"scores": [1.0, "high", 3.0]}', "scores\\[1\\] is 'high', not a number"),
        ('{"scores": [1.0, true, 3.0]}', "scores\\[1\\] is True"),
        ('{"scores": [1, 2, 3], "valid": [true]}', "'valid' must be a list of 3"),
    ],
)
def test_malformed_reply_is_a_clear_error(body: str, problem: str) -> None:
    with serving(raw(body)) as (fake, url), pytest.raises(RewardReplyMalformed, match=problem):
        run(scorer(url))
    assert fake.calls == 1  # an API mismatch is not transient: within (far below) retries


# --- missing scores ----------------------------------------------------------------------------


def test_null_and_nan_scores_are_missing_not_zero() -> None:
    # NaN is not JSON, but Python servers emit it; accept it and treat it like null
    with serving(
        raw('{"scores": [1.0, null, NaN]}'),
        raw('{"scores": [1, 2, 3], "valid": [true, false, true]}'),
    ) as (_, url):
        s = scorer(url)
        first, second = run(s), run(s)
    assert first.valid.tolist() == [True, False, False]
    assert first.scores[0] == 1.0 and torch.isnan(first.scores[1:]).all()
    assert second.valid.tolist() == [True, False, True]
    assert torch.isnan(second.scores[1]) and second.scores[[0, 2]].tolist() == [1.0, 3.0]


# --- through the reward pool -------------------------------------------------------------------


def test_pool_optional_http_failure_marks_samples_missing() -> None:
    params = {"url": dead_url(), "retries": 1, "backoff_s": 0.01}
    pool = RewardPool(
        RewardConfig([ScorerConfig("shapes"), ScorerConfig("http", required=False, params=params)])
    )
    batch, metrics = asyncio.run(pool.score(make_traj()))
    assert not batch.valid.any() and torch.isnan(batch.rewards).all()
    assert torch.isnan(batch.per_scorer["http"]).all()
    assert metrics["reward/http/failed"] == 1.0


def test_pool_required_http_failure_stops_training() -> None:
    params = {"url": dead_url(), "retries": 1, "backoff_s": 0.01}
    pool = RewardPool(RewardConfig([ScorerConfig("http", params=params)]))
    with pytest.raises(RewardFailure, match=r"required scorer 'http' failed.*2 attempt\(s\)"):
        asyncio.run(pool.score(make_traj()))


# --- the policy's arithmetic -------------------------------------------------------------------


def test_backoff_and_retry_after_parsing() -> None:
    for attempt, base in ((1, 0.5), (2, 1.0), (3, 2.0)):
        assert base <= backoff_delay(attempt, 0.5, 8.0) <= base * 1.1
    assert 8.0 <= backoff_delay(10, 0.5, 8.0) <= 8.8  # capped
    assert 3.0 <= backoff_delay(1, 0.5, 8.0, retry_after_s=3.0) <= 3.3  # server asks for more
    assert backoff_delay(1, 0.5, 8.0, retry_after_s=600.0) <= 8.8  # but never past the cap
    assert parse_retry_after("2") == 2.0 and parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past
    future = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < parse_retry_after(future) <= 30


def test_client_is_pooled_per_event_loop_and_closes() -> None:
    with serving(ok()) as (_, url):
        s = scorer(url)

        async def twice():
            await s.score(make_traj())
            first = s._http
            await s.score(make_traj())
            assert s._http is first  # one pooled client within a loop
            await s.close()
            assert s._http is None

        asyncio.run(twice())
        assert run(s).valid.all()  # a new loop gets a fresh client


# --- hostile replies ---------------------------------------------------------------------------


def test_scores_past_float32_are_missing_never_a_valid_inf() -> None:
    big_int = "1" + "0" * 400  # a JSON integer past float64
    scores = f"[1e300, -1e300, 3.5e38, 1e400, {big_int}, 3e38]"
    body = f'{{"scores": {scores}, "valid": [true, true, true, true, true, true]}}'
    with serving(raw(body)) as (_, url):
        result = run(scorer(url), make_traj(6))
    assert result.valid.tolist() == [False] * 5 + [True]
    assert torch.isnan(result.scores[:5]).all() and torch.isfinite(result.scores).sum() == 1
    assert result.scores[5] == pytest.approx(3e38)  # within float32: kept


async def endless_step(n: int) -> Response:
    async def chunks():  # 200 MiB; finite, as uvicorn drops writes once the client has gone
        for _ in range(200):
            yield b" " * (1 << 20)

    return StreamingResponse(chunks(), media_type="application/json")


async def declared_too_big(n: int) -> Response:
    return Response(b" " * (2 << 20), media_type="application/json")


@pytest.mark.parametrize("step", [endless_step, declared_too_big], ids=["endless", "declared"])
def test_a_huge_reply_is_cut_at_the_cap_and_not_retried(step) -> None:
    with serving(step) as (fake, url):
        start = time.monotonic()
        with pytest.raises(RewardReplyMalformed, match="over the client's limit of 1048576"):
            run(scorer(url, max_reply_bytes=1 << 20))
        assert time.monotonic() - start < 2.0
    assert fake.calls == 1


def test_a_huge_error_reply_is_read_only_for_its_message() -> None:
    async def huge_500(n: int) -> Response:
        return Response(b"x" * (8 << 20), status_code=500)

    with serving(huge_500) as (fake, url), pytest.raises(RewardServerUnavailable, match="HTTP 500"):
        run(scorer(url))
    assert fake.calls == 3  # a 5xx is still retried


def test_a_trickling_reply_is_cut_at_the_whole_request_deadline(raw_server) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    with raw_server(head, lambda: iter([b" "] * 1000), pause_s=0.05) as url:
        s = scorer(url, timeout_s=0.5, retries=0)
        start = time.monotonic()
        with pytest.raises(RewardServerUnavailable, match="timed out after 0.5s"):
            run(s)
    assert time.monotonic() - start < 1.5  # each byte came well within httpx's read timeout


# --- credentials and loopback ------------------------------------------------------------------


SECRET = "s3cr%40t-pw"  # percent-encoded "s3cr@t-pw"


def assert_no_credentials(text: str) -> None:
    for leak in ("alice", SECRET, "s3cr@t-pw"):
        assert leak not in text, text


def test_url_credentials_never_appear_in_errors_or_logs(caplog, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "tok")
    dead = dead_url().replace("http://", f"http://alice:{SECRET}@")
    s = scorer(dead)
    assert_no_credentials(s.url)
    with caplog.at_level("WARNING"), pytest.raises(RewardServerUnavailable) as e:
        run(s)
    assert_no_credentials(str(e.value))
    assert "***@127.0.0.1" in str(e.value)

    async def echoing(n: int) -> Response:
        return JSONResponse({"detail": f"who is alice:{SECRET}?"}, status_code=422)

    # a server that echoes the credentials back in its message
    with serving(echoing) as (_, url), pytest.raises(RewardRequestRejected) as e:
        run(scorer(url.replace("http://", f"http://alice:{SECRET}@")))
    assert_no_credentials(str(e.value))
    with pytest.raises(ValueError) as e:
        HttpScorer(f"ftp://alice:{SECRET}@host")
    assert_no_credentials(str(e.value))
    assert_no_credentials(caplog.text)


def test_loopback_is_decided_from_the_resolved_address(caplog, monkeypatch) -> None:
    table = {
        "127.0.0.1.example.com": ["93.184.216.34"],  # a public name that looks like loopback
        "localhost": ["127.0.0.1", "::1"],
        "half.example": ["127.0.0.1", "10.0.0.5"],
    }

    def fake_getaddrinfo(host, *args, **kwargs):
        if host not in table:
            raise socket.gaierror("unknown host")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in table[host]]

    monkeypatch.setattr(client_module.socket, "getaddrinfo", fake_getaddrinfo)
    assert resolves_to_loopback("localhost") and resolves_to_loopback("127.0.0.2")
    assert resolves_to_loopback("::1") and resolves_to_loopback("[::1]")
    for host in ("127.0.0.1.example.com", "half.example", "nowhere.invalid", "10.0.0.1"):
        assert not resolves_to_loopback(host), host
    monkeypatch.setenv(TOKEN_ENV, "tok")
    with caplog.at_level("WARNING"):
        HttpScorer("http://localhost:8000")
        assert "clear text" not in caplog.text
        HttpScorer("http://127.0.0.1.example.com:8000")
    assert "clear text to http://127.0.0.1.example.com:8000" in caplog.text
