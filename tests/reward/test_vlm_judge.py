"""The VLM judge against a local fake OpenAI-compatible server (Starlette + uvicorn on a free
loopback port, in a background thread): request shape, answer parsing, missing != 0, retries
on 429/5xx/time-outs, the concurrency cap, and a dead server reported as such."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
from diffrl.reward.scorers import build_scorer
from diffrl.reward.scorers.vlm import TEMPLATES, chat_url, parse_score, parse_yesno

pytest.importorskip("httpx")
starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402


@dataclass
class FakeJudge:
    """Answers by keyword in the question, like a scripted VLM; records every request."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    attempts: Counter = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self) -> None:
        self.requests.clear()
        self.headers.clear()
        self.attempts.clear()
        self.in_flight = self.max_in_flight = 0

    async def reply(self, question: str) -> JSONResponse | str:
        key = next(
            (k for k in ("flaky", "busy", "slow", "broken", "bad request") if k in question), None
        )
        n = self.attempts[key or question]
        self.attempts[key or question] += 1
        if key == "flaky" and n == 0:
            return JSONResponse({"error": "overloaded"}, status_code=500)
        if key == "busy" and n == 0:
            return JSONResponse({"error": "rate"}, status_code=429, headers={"Retry-After": "0"})
        if key == "slow" and n == 0:
            await asyncio.sleep(1.0)  # past the client's time-out
        if key == "broken":
            return JSONResponse({"error": "down"}, status_code=503)
        if key == "bad request":
            return JSONResponse({"error": "image too large"}, status_code=400)
        if "wait" in question:
            await asyncio.sleep(0.05)
        if "Reply with only a number" in question:
            return "Score: 8/10" if "octopus" in question else "0.75"
        if "circle" in question or key in ("flaky", "slow"):
            return "Yes."
        if "square" in question or key == "busy":
            return "**No**, it does not."
        return "I cannot tell."

    async def chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            question = body["messages"][-1]["content"][1]["text"]
            out = await self.reply(question)
        finally:
            self.in_flight -= 1
        if isinstance(out, JSONResponse):
            return out
        return JSONResponse(
            {
                "id": "fake",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": out},
                        "finish_reason": "stop",
                    }
                ],
            }
        )


@pytest.fixture(scope="module")
def judge_server() -> Iterator[tuple[str, FakeJudge]]:
    judge = FakeJudge()
    app = Starlette(routes=[Route("/v1/chat/completions", judge.chat, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "fake judge server did not start"
    yield f"http://127.0.0.1:{port}", judge
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def judge(judge_server) -> tuple[str, FakeJudge]:
    judge_server[1].reset()
    return judge_server


def scorer(base_url: str, **params):
    defaults = {"base_url": base_url, "model": "fake-vlm", "backoff": 0.01, "trust_env": False}
    return build_scorer("vlm_judge", {**defaults, **params})


def images(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 8, 12, 3), generator=torch.Generator().manual_seed(0)).to(
        torch.uint8
    )


def run(s, traj):
    return asyncio.run(s.score(traj))


def test_parsers_and_url() -> None:
    assert parse_yesno("Yes.") == 1.0 and parse_yesno("  no, it doesn't") == 0.0
    assert parse_yesno("**YES**") == 1.0 and parse_yesno("Answer: no") == 0.0
    assert parse_yesno("maybe") is None and parse_yesno("") is None
    assert parse_yesno("The answer is yes") is None  # strict: first word only
    assert parse_score("0.8") == 0.8 and parse_score("Score: 1") == 1.0
    assert parse_score(".25 overall") == 0.25
    assert parse_score("8/10") is None and parse_score("-0.1") is None
    assert parse_score("none") is None
    assert chat_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"


def test_request_shape_and_yes_no(judge, media_traj, monkeypatch) -> None:
    url, fake = judge
    monkeypatch.setenv("DIFFRL_TEST_JUDGE_KEY", "sekrit")
    imgs = images(3)
    texts = ["a red circle", "a blue square", "a red circle"]
    res = run(scorer(url, api_key_env="DIFFRL_TEST_JUDGE_KEY"), media_traj(texts, image=imgs))
    assert res.scores.tolist() == [1.0, 0.0, 1.0] and res.valid.all()
    assert res.metrics == {"failed_frac": 0.0, "unparsed_frac": 0.0}
    assert len(fake.requests) == 3
    assert all(h["authorization"] == "Bearer sekrit" for h in fake.headers)
    by_text = {}
    for body in fake.requests:
        assert body["model"] == "fake-vlm" and body["temperature"] == 0.0
        (msg,) = body["messages"]
        assert msg["role"] == "user"
        image_part, text_part = msg["content"]
        assert image_part["type"] == "image_url" and text_part["type"] == "text"
        data_url = image_part["image_url"]["url"]
        assert data_url.startswith("data:image/png;base64,")
        by_text.setdefault(text_part["text"], []).append(data_url)
    for i, t in enumerate(texts):
        question = TEMPLATES["yesno"].format(prompt=t)
        assert question == f'Does this image show: "{t}"? Answer yes or no.'
        decoded = [decode_png(u) for u in by_text[question]]
        assert any(np.array_equal(d, imgs[i].numpy()) for d in decoded)  # lossless round trip


def decode_png(data_url: str) -> np.ndarray:
    from PIL import Image

    raw = base64.b64decode(data_url.split(",", 1)[1])
    return np.array(Image.open(io.BytesIO(raw)).convert("RGB"))


def test_unparseable_answer_is_missing_not_zero(judge, media_traj) -> None:
    url, _ = judge
    res = run(scorer(url), media_traj(["a red circle", "a mumble of shapes"], image=images(2)))
    assert res.valid.tolist() == [True, False]
    assert res.scores[0] == 1.0 and torch.isnan(res.scores[1])
    assert res.metrics["unparsed_frac"] == 0.5
    # in the pool, an optional judge's shrug excludes the sample rather than scoring it 0
    pool = RewardPool(
        RewardConfig([ScorerConfig("vlm_judge", required=False, params=scorer_params(url))])
    )
    batch, _ = asyncio.run(
        pool.score(media_traj(["a red circle", "a mumble of shapes"], image=images(2)))
    )
    assert batch.valid.tolist() == [True, False] and torch.isnan(batch.rewards[1])


def scorer_params(url: str) -> dict[str, Any]:
    return {"base_url": url, "model": "fake-vlm", "backoff": 0.01, "trust_env": False}


def test_score_answers(judge, media_traj) -> None:
    url, fake = judge
    res = run(scorer(url, answer="score"), media_traj(["a cat", "an octopus"], image=images(2)))
    assert res.valid.tolist() == [True, False]  # "8/10" is not on the [0, 1] scale
    assert res.scores[0] == pytest.approx(0.75)
    assert "between 0 and 1" in fake.requests[0]["messages"][0]["content"][1]["text"]


def test_retries_500_429_and_timeouts_then_recovers(judge, media_traj) -> None:
    url, fake = judge
    texts = ["a flaky circle", "a busy square", "a slow circle"]
    res = run(scorer(url, timeout=0.3), media_traj(texts, image=images(3)))
    assert res.scores.tolist() == [1.0, 0.0, 1.0] and res.valid.all()
    assert fake.attempts["flaky"] == 2 and fake.attempts["busy"] == 2
    assert fake.attempts["slow"] == 2


def test_concurrency_is_capped(judge, media_traj) -> None:
    url, fake = judge
    res = run(scorer(url, max_concurrency=2), media_traj(["wait, a circle"] * 6, image=images(6)))
    assert res.valid.all() and len(fake.requests) == 6
    assert 1 <= fake.max_in_flight <= 2


def test_failures_mark_samples_missing_and_a_dead_server_raises(judge, media_traj) -> None:
    url, fake = judge
    res = run(
        scorer(url, max_retries=1),
        media_traj(["a circle", "broken", "bad request"], image=images(3)),
    )
    assert res.valid.tolist() == [True, False, False] and res.metrics["failed_frac"] == 2 / 3
    assert fake.attempts["broken"] == 2 and fake.attempts["bad request"] == 1  # 4xx: no retry
    with pytest.raises(RuntimeError, match="no sample got a reply.*503"):
        run(scorer(url, max_retries=1), media_traj(["broken"] * 2, image=images(2)))
    with socket.socket() as s:  # a port nobody listens on: connection refused, retried, raised
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RuntimeError, match="ConnectError"):
        run(scorer(dead, max_retries=1), media_traj(["a circle"], image=images(1)))


def test_bad_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="base_url"):
        build_scorer("vlm_judge", {"model": "m"})
    with pytest.raises(ValueError, match="answer"):
        build_scorer("vlm_judge", {"base_url": "http://x", "model": "m", "answer": "stars"})
    with pytest.raises(ValueError, match="template"):
        build_scorer("vlm_judge", {"base_url": "http://x", "model": "m", "template": "{image}"})


def test_a_trickling_judge_is_cut_at_the_whole_request_deadline(raw_server, media_traj) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    with raw_server(head, lambda: iter([b" "] * 1000), pause_s=0.05) as url:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="no sample got a reply: timed out after 0.5s"):
            run(scorer(url, timeout=0.5, max_retries=0), media_traj(["a"], image=images(1)))
    assert time.monotonic() - start < 1.5  # was 29 s with timeout=1: httpx's is per read


def test_an_endless_judge_reply_is_cut_at_the_cap(raw_server, media_traj) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n"  # no length: to close
    endless = raw_server(head, lambda: iter(lambda: b" " * 65536, None))
    with endless as url, pytest.raises(RuntimeError, match="reply over 1048576 bytes"):
        run(scorer(url, max_retries=0), media_traj(["a"], image=images(1)))


def test_judge_url_credentials_never_appear_in_errors(media_traj, caplog) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://alice:s3cret@127.0.0.1:{s.getsockname()[1]}"
    judge = scorer(dead, max_retries=0)
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError) as e:
        run(judge, media_traj(["a circle"], image=images(1)))
    for text in (str(e.value), caplog.text, judge.url):
        assert "alice" not in text and "s3cret" not in text, text
    assert "***@127.0.0.1" in str(e.value)
