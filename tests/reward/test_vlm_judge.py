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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch

from diffrl.reward.pool import RewardConfig, RewardFailure, RewardPool, ScorerConfig
from diffrl.reward.scorers import build_scorer
from diffrl.reward.scorers.vlm import (
    PAIRWISE_TEMPLATE,
    TEMPLATES,
    chat_url,
    parse_choice,
    parse_score,
    parse_yesno,
)
from diffrl.types import Trajectory

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

    async def reply(self, question: str, images: list[str]) -> JSONResponse | str:
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
        if "Answer A or B" in question:  # pairwise: the brighter image wins, as if it judged
            if "biased" in question:
                return "A"  # always the first: both orders must cancel it
            if "dunno" in question:
                return "Both look equally good."
            a, b = (decode_png(u).mean() for u in images)
            return "Image A." if a > b else "**B**"
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
            content = body["messages"][-1]["content"]
            question = content[-1]["text"]
            urls = [p["image_url"]["url"] for p in content if p["type"] == "image_url"]
            out = await self.reply(question, urls)
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


def group_traj(media_traj, text: str, brightness: list[int]):
    """One group: ``text`` for every sample, each image flat at its brightness."""
    imgs = torch.tensor(brightness, dtype=torch.uint8)[:, None, None, None].expand(-1, 4, 4, 3)
    traj = media_traj([text] * len(brightness), image=imgs.contiguous())
    return replace(traj, group=torch.zeros(len(brightness), dtype=torch.long))


def pairwise(base_url: str, **params):
    defaults = {"base_url": base_url, "model": "fake-vlm", "backoff": 0.01, "trust_env": False}
    return build_scorer("vlm_pairwise", {**defaults, **params})


def test_pairwise_judge_counts_wins_in_both_orders(judge, media_traj) -> None:
    url, fake = judge
    traj = group_traj(media_traj, "a red circle", [10, 200, 90, 40])
    res = asyncio.run(pairwise(url).score_group(traj))
    # each image beats the dimmer ones: wins / (2 * 3 games), in both orders
    assert res.scores.tolist() == pytest.approx([0.0, 1.0, 2 / 3, 1 / 3]) and res.valid.all()
    assert len(fake.requests) == 12  # G(G-1) ordered pairs
    content = fake.requests[0]["messages"][-1]["content"]
    assert [p["type"] for p in content] == ["image_url", "image_url", "text"]
    assert content[-1]["text"] == PAIRWISE_TEMPLATE.format(prompt="a red circle")
    assert res.metrics["first_frac"] == 0.5 and res.metrics["failed_frac"] == 0.0
    fake.reset()
    once = asyncio.run(pairwise(url, both_orders=False).score_group(traj))
    assert once.scores.tolist() == res.scores.tolist() and len(fake.requests) == 6


def test_pairwise_position_bias_cancels_and_shrugs_are_no_games(judge, media_traj) -> None:
    url, _ = judge
    biased = group_traj(media_traj, "a biased circle", [10, 200, 90])
    res = asyncio.run(pairwise(url).score_group(biased))
    assert res.scores.tolist() == [0.5, 0.5, 0.5] and res.metrics["first_frac"] == 1.0
    one_way = asyncio.run(pairwise(url, both_orders=False).score_group(biased))
    assert one_way.scores.tolist() == [1.0, 0.5, 0.0]  # (0,1) (0,2) (1,2): A always wins
    shrug = asyncio.run(pairwise(url).score_group(group_traj(media_traj, "dunno", [1, 2])))
    assert not shrug.valid.any() and shrug.metrics["unparsed_frac"] == 1.0
    assert parse_choice("Answer: B") == 0.0 and parse_choice("image a") == 1.0
    assert parse_choice("both") is None and parse_choice("") is None


def test_pairwise_dead_judge_fails_the_group_in_the_pool(judge, media_traj) -> None:
    url, _ = judge
    good = group_traj(media_traj, "a red circle", [10, 200])
    dead = replace(group_traj(media_traj, "broken", [10, 200]), group=torch.ones(2).long())
    traj = Trajectory.concat([good, dead])
    params = {"base_url": url, "model": "m", "backoff": 0.0, "max_retries": 0, "trust_env": False}
    cfg = ScorerConfig("vlm_pairwise", required=False, params=params)
    scored, metrics = asyncio.run(RewardPool(RewardConfig([cfg])).score(traj))
    assert scored.valid.tolist() == [True, True, False, False]
    assert scored.rewards[:2].tolist() == [0.0, 1.0]
    assert metrics["reward/vlm_pairwise/failed_groups"] == 0.5
    with pytest.raises(RewardFailure, match="group 1 .*'broken'.*no pair got a reply"):
        asyncio.run(RewardPool(RewardConfig([replace(cfg, required=True)])).score(traj))
    with pytest.raises(ValueError, match="answer"):
        pairwise(url, answer="yesno")
