"""The reward server process under hostile load, on loopback: sockets that send nothing or
trickle a request, clients without the token that hold their socket open, bursts past the
request slots, a log flood, oversize heads, bodies that overflow integers or nest deep, PNGs
that claim huge sizes or are cut short, scorer input errors, clients that leave, and web pages
that try to drive a server without a token. Each test drives a real `diffrl serve-reward`
process, its deadlines cut to 1 s by the command's own flags, so the whole file takes seconds;
two processes serve the file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
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
from diffrl.reward.http.guard import ConnectionLimits
from diffrl.reward.http.server import BackgroundServer
from diffrl.reward.scorer import ScoreResult
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.tasks.shapes.render import render
from diffrl.types import PromptBatch, Trajectory

pytestmark = pytest.mark.timeout(60)

TOKEN = "fault-token-1"
AUTH = {"authorization": f"Bearer {TOKEN}"}
DEADLINES = ("--header-timeout-s", "1", "--body-timeout-s", "1")
MAX_CONNECTIONS = 8  # request slots
MAX_IDLE = 48  # sockets without a request
MAX_DECODED_MB = 64
MAX_REQUEST_MPX = 24  # 72 MiB of RGB: a request can pass it or the decoded budget first
DELAY_S = 1.0  # the sleepy scorer's time per batch
TINY_PNG = codec.encode_png(np.zeros((4, 4, 3), np.uint8))
ONE_IMAGE = f'"prompts": ["a red circle on the left"], "images": ["{TINY_PNG}"]'  # JSON inside


@pytest.fixture(scope="module")
def guarded() -> Iterator[RunningServer]:
    """The shapes scorer (no params) behind a token, 1 s deadlines, 8 request slots, 48 idle
    sockets, 64 MiB decoded, 24 Mpx scored a request."""
    flags = (*DEADLINES, "--max-connections", str(MAX_CONNECTIONS))
    flags += ("--max-idle-connections", str(MAX_IDLE), "--max-decoded-mb", str(MAX_DECODED_MB))
    flags += ("--max-request-mpx", str(MAX_REQUEST_MPX))
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
    for i in range(60):  # 60 unauthenticated sockets against a cap of 48
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
    assert "closing the oldest idle one" in guarded.log()  # --max-idle-connections took effect
    for s in socks:
        s.close()


def wait_until_reset(socks: list[socket.socket], timeout_s: float) -> float:
    """Seconds until the server has closed every socket for good: after its FIN a socket can
    still be written to, until the server drops it; then a write fails (reset / broken pipe)."""
    start, open_ = time.monotonic(), list(socks)
    while open_ and time.monotonic() - start < timeout_s:
        for s in list(open_):
            try:
                s.sendall(b" ")
            except OSError:
                open_.remove(s)
        time.sleep(0.1)
    assert not open_, f"{len(open_)} sockets still open after {timeout_s} s"
    return time.monotonic() - start


def test_clients_without_the_token_cannot_hold_a_request_slot(guarded) -> None:
    """POST heads with a large Content-Length and no token, then a body byte now and then:
    each used to get its 401 but keep its request slot until the body deadline, so a real
    client got 503. Now each is answered 401 at its head and closed without the body being
    awaited; request slots are held by authenticated requests only."""
    head = (
        b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000000\r\n\r\n{"
    )
    attackers = [socket.create_connection(address(guarded)) for _ in range(5 * MAX_CONNECTIONS)]
    for s in attackers:
        s.sendall(head)
    time.sleep(0.2)
    for s in attackers:  # a body byte each, after the 401 was sent
        with contextlib.suppress(OSError):
            s.sendall(b" ")
    start = time.monotonic()
    body, headers = f"{{{ONE_IMAGE}}}", {**AUTH, "content-type": "application/json"}
    r = httpx.post(f"{guarded.url}/score", content=body, headers=headers, timeout=5)
    assert r.status_code == 200 and time.monotonic() - start < 1.0, r.text
    replies = [read_until_closed(s, timeout_s=1) for s in attackers]  # FIN after the 401
    assert all(r.startswith(b"HTTP/1.1 401") and b"bearer token" in r for r in replies)
    assert time.monotonic() - start < 1.5  # none waited for its body deadline
    assert wait_until_reset(attackers, timeout_s=4) < 3.0  # the server dropped them all
    for s in attackers:
        s.close()


def test_a_burst_past_the_request_slots_waits_its_turn(guarded) -> None:
    """40 valid requests at once on 40 sockets, 5x the request slots: the sockets past the cap
    used to close the oldest ones, whose heads had already been sent (two thirds of a 200-way
    burst failed its first attempt). Now every request is served, those past the slots after
    waiting in the queue, with no retry."""
    body, headers = f"{{{ONE_IMAGE}}}", {**AUTH, "content-type": "application/json"}

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=40, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=20) as client:
            posts = (
                client.post(f"{guarded.url}/score", content=body, headers=headers)
                for _ in range(5 * MAX_CONNECTIONS)
            )
            return await asyncio.gather(*posts)

    replies = asyncio.run(burst())
    assert [r.status_code for r in replies] == [200] * (5 * MAX_CONNECTIONS)
    assert all(r.json()["valid"] == [True] for r in replies)
    assert "request slots are busy: requests wait" in guarded.log()  # the queue was used


def test_heads_bad_pngs_and_huge_prompts(guarded) -> None:
    """A request head over the documented 16 KiB (100 KB heads were accepted) is a 431, and a
    request pipelined after another is not served (the connection closes after the first); a
    PNG cut short (Pillow decodes one without its last chunks) is a 422, never scored; a 4 MB
    prompt the scorer refuses is quoted in a bounded log line and reply (a 19 MB one was
    logged whole)."""
    url, json_type = f"{guarded.url}/score", {"content-type": "application/json"}
    headers = {**AUTH, **json_type}
    ok = httpx.post(url, content=f"{{{ONE_IMAGE}}}", headers={**headers, "x-pad": "a" * 15_000})
    assert ok.status_code == 200, ok.text
    big = httpx.post(url, content=f"{{{ONE_IMAGE}}}", headers={**headers, "x-pad": "a" * 17_000})
    assert big.status_code == 431 and "16384 bytes" in big.json()["detail"], big.text
    with socket.create_connection(address(guarded)) as s:  # a second, pipelined request
        get = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n\r\n"
        s.sendall(get % TOKEN.encode() + get % b"wrong")  # would skip the checks at the head
        replies = read_until_closed(s, timeout_s=3)
    assert replies.startswith(b"HTTP/1.1 200") and replies.count(b"HTTP/1.1") == 1, replies
    full = base64.b64decode(codec.encode_png(np.full((16, 16, 3), 200, np.uint8)))
    for cut in (12, 30):  # IEND missing; the image data's last chunk cut
        short = base64.b64encode(full[:-cut]).decode()
        body = {"prompts": ["a red circle on the left"], "images": [short]}
        r = httpx.post(url, json=body, headers=AUTH)
        assert r.status_code == 422 and "truncated PNG" in r.json()["detail"], r.text
    before = len(guarded.log())
    prompt = "launch " * 600_000  # 4.2 MB, outside the grammar
    body = {"prompts": [prompt], "images": [TINY_PNG]}
    r = httpx.post(url, json=body, headers=AUTH, timeout=10)
    assert r.status_code == 422 and "outside the ShapesBench grammar" in r.json()["detail"]
    assert len(r.text) < 2_000 and "more characters not shown" in r.text
    added = guarded.log()[before:]
    assert "refused a batch of 1" in added and "more characters not shown" in added
    assert len(added) < 5_000


def test_the_request_queue_is_bounded_and_timed() -> None:
    """Past the request slots a request waits, but not without bound: one more than
    ``max_queued`` is refused at once, and one that waits past ``queue_timeout_s`` is told
    so; both are 503 with Retry-After (the client retries those). Once the slot frees, the
    next request is served."""
    free = threading.Event()

    async def app(scope, receive, send) -> None:  # a bare ASGI app: /hold waits for ``free``
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/hold":
            await asyncio.to_thread(free.wait, 10)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limits = ConnectionLimits(max_connections=1, max_queued=1, queue_timeout_s=0.5)
    with BackgroundServer(app, limits=limits) as srv:
        host = (srv.host, srv.port)
        held: dict = {}
        holder = threading.Thread(target=lambda: held.update(r=httpx.get(f"{srv.url}/hold")))
        holder.start()
        time.sleep(0.2)  # /hold has the one slot
        queued, extra = socket.create_connection(host), socket.create_connection(host)
        queued.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        start = time.monotonic()
        extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        refused = read_until_closed(extra, timeout_s=2)
        assert refused.startswith(b"HTTP/1.1 503") and b"queue is full" in refused
        assert b"retry-after: 1" in refused and time.monotonic() - start < 0.3
        timed_out = read_until_closed(queued, timeout_s=2)
        assert timed_out.startswith(b"HTTP/1.1 503") and b"stayed busy" in timed_out
        assert 0.3 < time.monotonic() - start < 1.0
        free.set()
        holder.join(5)
        assert held["r"].status_code == 200
        assert httpx.get(f"{srv.url}/").status_code == 200  # the slot was given back
        queued.close()
        extra.close()


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
        ("--max-request-mpx", "nan", "must be a finite number > 0, got 'nan'"),
        ("--queue-timeout-s", "inf", "must be a finite number > 0, got 'inf'"),
        ("--max-queued", "0", "must be an integer > 0, got '0'"),
        ("--max-idle-connections", "1.5", "must be an integer > 0, got '1.5'"),
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
    big, large, mid = png(8192), png(4096), png(3400)
    cases = {  # (body, words of the 413); none decodes a pixel
        "over 16777216 pixels": {"prompts": ["a"] * 4, "images": [big] * 4},  # 1 MB, 4 x 8192^2
        # 2 x 4096^2 is 32 Mpx: within the default scoring budget (32), over 24
        f"scoring budget of {MAX_REQUEST_MPX << 20} pixels": {
            "prompts": ["a"] * 2,
            "images": [large] * 2,
        },
        # 2 x 3400^2 is 22 Mpx, 66 MiB: within the default budget (256), over 64
        f"limit of {MAX_DECODED_MB << 20} bytes": {"prompts": ["a"] * 2, "images": [mid] * 2},
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
