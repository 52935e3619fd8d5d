"""The reward server process under hostile load, on loopback: sockets that send nothing or
trickle a request, a log flood, bodies that overflow integers or nest deep, PNGs that claim
huge sizes, scorer input errors, clients that leave, and web pages that try to drive a server
without a token. Each test drives a real `diffrl serve-reward` process, its deadlines cut to
1 s by the command's own flags, so the whole file takes seconds; two processes serve the file.
"""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from reward_server import RunningServer, journal_events, serve_reward_cli

from diffrl.cli import main
from diffrl.reward.http import HttpScorer, RewardRequestRejected, RewardServerUnavailable, codec
from diffrl.reward.scorer import ScoreResult
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.types import PromptBatch, Trajectory

pytestmark = pytest.mark.timeout(60)

TOKEN = "fault-token-1"
AUTH = {"authorization": f"Bearer {TOKEN}"}
DEADLINES = ("--header-timeout-s", "1", "--body-timeout-s", "1")
MAX_CONNECTIONS = 16
MAX_DECODED_MB = 64
DELAY_S = 1.0  # the sleepy scorer's time per batch
TINY_PNG = codec.encode_png(np.zeros((4, 4, 3), np.uint8))
ONE_IMAGE = f'"prompts": ["a red circle on the left"], "images": ["{TINY_PNG}"]'  # JSON inside


@pytest.fixture(scope="module")
def guarded() -> Iterator[RunningServer]:
    """The shapes scorer behind a token, 1 s deadlines, at most 16 sockets, 64 MiB decoded."""
    flags = (*DEADLINES, "--max-connections", str(MAX_CONNECTIONS))
    flags += ("--max-decoded-mb", str(MAX_DECODED_MB))
    with serve_reward_cli(TOKEN, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def journal(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sleepy") / "journal.txt"


@pytest.fixture(scope="module")
def open_server(journal) -> Iterator[RunningServer]:
    """No token (loopback only). The shapes scorer, but a batch whose first prompt starts with
    "sleep" (or "thread": in a thread) takes DELAY_S and is journaled as it starts and ends."""
    params = ("--scorer-param", f"delay_s={DELAY_S}", "--scorer-param", f"journal={journal}")
    with serve_reward_cli("", *DEADLINES, *params, scorer="sleepy") as server:
        yield server


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch) -> None:
    monkeypatch.delenv(codec.TOKEN_ENV, raising=False)


def address(server: RunningServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent before closing; b"" for a silent close or a reset."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def make_traj(texts: list[str]) -> Trajectory:
    n = len(texts)
    rng = np.random.default_rng(0)
    images = np.stack([render(p, rng) for p in split_prompts("train")[:n]])
    batch = PromptBatch(
        tuple(texts), torch.zeros((n, 1), dtype=torch.long), ("",) * n, torch.arange(n)
    )
    return Trajectory(
        prompts=batch,
        group=torch.arange(n),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 3, 4, 4),
        sigmas=torch.tensor([1.0, 0.0]),
        policy_version=0,
        extra_fields={"image": torch.from_numpy(images)},
    )


def score(scorer: HttpScorer, traj: Trajectory) -> ScoreResult:
    async def go() -> ScoreResult:
        try:
            return await scorer.score(traj)
        finally:
            await scorer.close()

    return asyncio.run(go())


def png(size: int) -> str:
    """A black size x size PNG: a few hundred kB that claim size^2 pixels."""
    buf = io.BytesIO()
    Image.new("RGB", (size, size)).save(buf, format="PNG", compress_level=9)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# --- connections -------------------------------------------------------------------------------


def test_idle_and_half_sent_sockets_are_closed_and_do_not_lock_out(guarded) -> None:
    socks = []
    for i in range(60):  # 60 unauthenticated sockets against a cap of 16
        s = socket.create_connection(address(guarded))
        if i % 2:
            s.sendall(b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half a request head
        socks.append(s)
    start = time.monotonic()
    r = httpx.get(f"{guarded.url}/health", headers=AUTH, timeout=5)
    assert r.status_code == 200 and time.monotonic() - start < 1.0  # not locked out
    replies = [read_until_closed(s, timeout_s=5) for s in socks]
    assert time.monotonic() - start < 3.0  # every socket closed by the 1 s deadline
    assert all(r == b"" or r.startswith(b"HTTP/1.1 408 Request Timeout") for r in replies)
    assert any(r.startswith(b"HTTP/1.1 408") for r in replies[-16:])  # a half head is told
    assert "closing the oldest idle one" in guarded.log()  # --max-connections took effect
    for s in socks:
        s.close()


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_trickled_request_is_cut_at_its_deadline(guarded, part) -> None:
    head = (
        b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    s = socket.create_connection(address(guarded))
    if part == "body":
        s.sendall(head)
    trickle = head if part == "head" else b" " * 1000
    start, reply = time.monotonic(), b""
    s.settimeout(0.1)
    for byte in trickle:  # one byte every 0.1 s: each arrives well inside any read timeout
        try:
            s.sendall(bytes([byte]))
            reply = s.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if reply or time.monotonic() - start > 5:
            break
    elapsed = time.monotonic() - start
    s.close()
    assert reply.startswith(b"HTTP/1.1 408") and 0.9 < elapsed < 2.5, (reply, elapsed)
    assert "Traceback" not in guarded.log()  # a cut upload is not an application error


def test_a_flood_of_bad_requests_logs_a_few_lines(guarded) -> None:
    before = len(guarded.log())
    for i in range(150):
        with socket.create_connection(address(guarded)) as s:
            # garbage (uvicorn warns "Invalid HTTP request") and unauthenticated (401)
            s.sendall(
                b"\x16\x03\x01 not http\r\n\r\n"
                if i % 2
                else b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            )
            read_until_closed(s, timeout_s=2) if i % 2 else s.recv(4096)
    added = guarded.log()[before:]
    assert added.count("Invalid HTTP request") <= 10 and added.count(" 401 ") <= 10, added
    assert len(added) < 5_000
    assert httpx.get(f"{guarded.url}/health", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--header-timeout-s", "0", "must be a finite number > 0, got '0'"),
        ("--body-timeout-s", "nan", "must be a finite number > 0, got 'nan'"),
        ("--max-decoded-mb", "inf", "must be a finite number > 0, got 'inf'"),
        ("--max-connections", "-1", "must be an integer > 0, got '-1'"),
        ("--max-connections", "2.5", "must be an integer > 0, got '2.5'"),
    ],
)
def test_bad_limit_flags_exit_2_naming_the_flag(capsys, flag, value, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve-reward", "--scorer", "shapes", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


# --- request bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (f'{{{ONE_IMAGE}, "metadata": {{"seeds": [{1 << 70}]}}}}', "seeds[0]"),
        (f'{{{ONE_IMAGE}, "metadata": {{"group": [{-(1 << 64)}]}}}}', "int64"),
        (f'{{{ONE_IMAGE}, "metadata": {{"policy_version": {1 << 63}}}}}', "int64"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
    ids=["seed", "group", "policy-version", "deep"],
)
def test_overflowing_ints_and_deep_json_are_400(guarded, body, message) -> None:
    r = httpx.post(f"{guarded.url}/score", content=body, headers=AUTH, timeout=5)
    assert r.status_code == 400 and message in r.json()["detail"], r.text
    assert httpx.get(f"{guarded.url}/health", headers=AUTH).status_code == 200


def test_huge_png_sizes_are_refused_from_their_headers(guarded) -> None:
    rss = guarded.peak_rss_mib()
    big, large = png(8192), png(4096)
    cases = {  # (body, words of the 413); neither decodes a pixel
        "over 16777216 pixels": {"prompts": ["a"] * 4, "images": [big] * 4},  # 1 MB, 4 x 8192^2
        # 3 x 4096^2 is 144 MiB: within the default budget (256), over --max-decoded-mb 64
        f"limit of {MAX_DECODED_MB << 20} bytes": {"prompts": ["a"] * 3, "images": [large] * 3},
    }
    for message, body in cases.items():
        r = httpx.post(f"{guarded.url}/score", json=body, headers=AUTH, timeout=10)
        assert r.status_code == 413 and message in r.json()["detail"], r.text
    assert guarded.peak_rss_mib() - rss < 64  # decoding the second would take 144 MiB


def test_a_scorer_refusing_its_input_is_a_422_not_retried(open_server) -> None:
    remote = HttpScorer(open_server.url, retries=3, backoff_s=0.01)
    traj = make_traj(["a red circle on the left", "launch the missiles"])
    with pytest.raises(RewardRequestRejected, match="HTTP 422.*outside the ShapesBench grammar"):
        score(remote, traj)
    assert remote.attempts == 1


# --- the batch gate ----------------------------------------------------------------------------


def post_in_thread(url: str, body: dict, out: dict, key: str) -> threading.Thread:
    def go() -> None:
        t = time.monotonic()
        out[key] = httpx.post(f"{url}/score", json=body, timeout=30), time.monotonic() - t

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def test_decoding_waits_for_the_batch_gate(open_server) -> None:
    server = open_server
    good = codec.encode_png(np.zeros((8, 8, 3), np.uint8))
    out: dict = {}
    first = post_in_thread(server.url, {"prompts": ["sleep a"], "images": [good]}, out, "first")
    time.sleep(0.3)  # the first batch is being scored
    t = time.monotonic()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert time.monotonic() - t < 0.3  # the event loop is free
    bad = post_in_thread(server.url, {"prompts": ["sleep b"], "images": ["AAAA"]}, out, "bad")
    first.join()
    bad.join()
    assert out["first"][0].status_code == 200
    reply, waited = out["bad"]
    assert reply.status_code == 422 and "images[0] is not a PNG" in reply.json()["detail"]
    assert waited > DELAY_S - 0.5  # its PNG was read only once the first batch was done


@pytest.mark.parametrize("mode", ["sleep", "thread"])
def test_work_whose_client_left_is_cancelled_or_skipped(open_server, journal, mode) -> None:
    server = open_server
    seen = len(journal_events(journal))
    # four attempts of 0.2 s, all over before the first batch's DELAY_S
    impatient = HttpScorer(server.url, timeout_s=0.2, retries=3, backoff_s=0.01)
    with pytest.raises(RewardServerUnavailable, match="4 attempt"):
        score(impatient, make_traj([f"{mode} a red circle on the left"]))
    start = time.monotonic()
    result = score(HttpScorer(server.url, timeout_s=10), make_traj([f"{mode} patient"]))
    assert result.valid.all()
    events = journal_events(journal)[seen:]
    starts = [t for e, t in events if e == "start"]
    dones = [t for e, t in events if e == "done"]
    if mode == "sleep":  # each attempt was cancelled when its client left: none finished
        assert len(starts) == 5 and len(dones) == 1
        assert time.monotonic() - start < DELAY_S + 0.5  # nothing left queued ahead of it
    else:  # a thread cannot be stopped: the first attempt ran on, the three queued never ran
        assert len(starts) == 2 and len(dones) == 2
        assert starts[1] >= dones[0]  # and the next batch waited for its thread


# --- no token: only local programs -------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        ({"host": "evil.example"}, 400, "Host header 'evil.example'"),
        ({"host": "127.0.0.1:1"}, 400, "not this server's loopback address"),
        ({"origin": "http://evil.example"}, 403, "not a loopback origin"),
        ({"origin": "null"}, 403, "not a loopback origin"),
        ({"content-type": "text/plain"}, 415, "must be application/json"),
    ],
    ids=["foreign-host", "other-port", "foreign-origin", "null-origin", "text-plain"],
)
def test_without_a_token_only_local_programs_are_answered(
    open_server, headers, status, message
) -> None:
    body = '{"prompts": []}'
    base = {"content-type": "application/json"}
    r = httpx.post(f"{open_server.url}/score", content=body, headers={**base, **headers})
    assert r.status_code == status and message in r.json()["detail"], r.text
    if "content-type" not in headers:  # /health tells a foreign page nothing either
        r = httpx.get(f"{open_server.url}/health", headers=headers)
        assert r.status_code == status


def test_without_a_token_a_local_client_still_scores(open_server) -> None:
    local = {"origin": "http://localhost:3000", "content-type": "application/json"}
    r = httpx.post(f"{open_server.url}/score", content=f"{{{ONE_IMAGE}}}", headers=local)
    assert r.status_code == 200
    host = open_server.url.replace("127.0.0.1", "localhost")
    result = score(HttpScorer(host), make_traj(["a red circle on the left"]))
    assert result.valid.all()
