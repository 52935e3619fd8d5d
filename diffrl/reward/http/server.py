"""Serve any registered scorer over HTTP (``diffrl serve-reward``).

Why a server at all: a reward model may need its own GPU, its own Python environment or its
own release cycle, and it can be shared by several training runs. The server wraps the same
``Scorer`` protocol the in-process pool uses, so a scorer is written once and can run either
way; ``HttpScorer`` (client.py) is its counterpart on the training side. The JSON API is
described in docs/reward_http.md.

Requests are checked in the order that is cheapest for the server and clearest for the client:
auth (401), body size (413), JSON shape and batch size (400/413/422), media decoding (413/422),
then scoring (500 if the scorer raises).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from diffrl.errors import DiffrlError
from diffrl.reward.http import codec
from diffrl.reward.http.codec import MEDIA_FIELDS, TOKEN_ENV, CodecError, TooLargeError
from diffrl.reward.scorer import Scorer, ScoreResult, build_scorer
from diffrl.types import PromptBatch, Trajectory

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_BODY_MB = 64.0
# Decoded media can be far larger than the (compressed) body: black-background PNGs shrink
# ~30x. This caps the tensors one request may materialise on the server.
DEFAULT_MAX_DECODED_BYTES = 4 << 30
METADATA_INT_LISTS = ("prompt_ids", "group", "seeds")


@dataclass(frozen=True)
class ScoreRequest:
    """A /score body after its JSON shape was checked (media still encoded)."""

    prompts: list[str]
    media: dict[str, list[Any]]  # extra-field name -> encoded entries, one per prompt
    metadata: dict[str, Any]


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # any other host name may resolve to a reachable interface


def check_bind(host: str, token: str | None) -> None:
    """Refuse to expose an unauthenticated scorer beyond this machine: anyone who can reach
    it could burn its GPU time or probe the reward model."""
    if token:
        return
    if not is_loopback(host):
        raise DiffrlError(
            f"refusing to serve on non-loopback host {host!r} without a token: set "
            f"{TOKEN_ENV} to a secret shared with the clients (or bind to 127.0.0.1)"
        )
    log.warning("%s is not set: the reward server on %s has no authentication", TOKEN_ENV, host)


def _fail(status: int, message: str) -> HTTPException:
    return HTTPException(status_code=status, detail=message)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes, so an
    oversize upload never sits in memory in full (chunked uploads have no Content-Length)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise _fail(400, f"bad Content-Length header {declared!r}") from None
        if size > limit:
            raise _fail(413, f"request body of {size} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _fail(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request(body: bytes, needs: frozenset[str], max_batch: int) -> ScoreRequest:
    """Check the JSON shape of a /score body; errors name the offending field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise _fail(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _fail(422, "request body must be a JSON object with a 'prompts' list")
    prompts = data.get("prompts")
    if prompts is None:
        raise _fail(422, "missing field 'prompts'")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise _fail(422, "'prompts' must be a list of strings")
    n = len(prompts)
    if n > max_batch:
        raise _fail(
            413,
            f"batch of {n} samples is over this server's max batch of {max_batch}; "
            "send smaller requests (HttpScorer's batch_size param)",
        )
    media: dict[str, list[Any]] = {}
    for name, key in MEDIA_FIELDS.items():
        value = data.get(key)
        if value is None:
            if name in needs:
                raise _fail(422, f"missing field {key!r}: the scorer needs {name!r} inputs")
            continue
        if not isinstance(value, list):
            raise _fail(422, f"{key!r} must be a list, got {type(value).__name__}")
        if len(value) != n:
            raise _fail(422, f"{key!r} has {len(value)} entries but 'prompts' has {n}")
        if name in needs:  # only what the scorer reads is decoded
            media[name] = value
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise _fail(422, "'metadata' must be a JSON object")
    return ScoreRequest(prompts, media, metadata)


def _decode_images(entries: list[Any], what: str, budget: int) -> tuple[np.ndarray, int]:
    """Base64 PNGs of one size -> (N, H, W, 3) uint8; returns the array and bytes used."""
    sized = [codec.png_size(e, f"{what}[{i}]") for i, e in enumerate(entries)]
    if not sized:
        raise CodecError(f"{what} is empty")
    w, h = sized[0][1]
    for i, (_, size) in enumerate(sized):
        if size != (w, h):
            raise CodecError(
                f"{what}[{i}] is {size[0]}x{size[1]} px but {what}[0] is {w}x{h}; "
                "all images in a request must have one size"
            )
    nbytes = len(sized) * h * w * 3
    if nbytes > budget:
        raise TooLargeError(f"decoded {what} would take {nbytes} bytes, over the server's limit")
    out = np.empty((len(sized), h, w, 3), dtype=np.uint8)
    for i, (raw, _) in enumerate(sized):
        out[i] = codec.decode_png(raw, f"{what}[{i}]")
    return out, nbytes


def decode_media(
    req: ScoreRequest, max_decoded_bytes: int, sample_rate: int | None = None
) -> dict[str, torch.Tensor]:
    """Encoded media -> the tensors scorers read: image (B, H, W, 3) uint8, video
    (B, F, H, W, 3) uint8, audio (B, N) or (B, C, N) float32 in [-1, 1].

    Audio tensors carry no rate, so a scorer assumes its own (its ``sample_rate`` param);
    ``sample_rate``, when known, is checked against the WAV headers so that audio at another
    rate is refused instead of silently scored at the wrong speed."""
    budget = max_decoded_bytes
    fields: dict[str, torch.Tensor] = {}
    if "image" in req.media:
        images, used = _decode_images(req.media["image"], "images", budget)
        budget -= used
        fields["image"] = torch.from_numpy(images)
    if "video" in req.media:
        videos = []
        for i, frames in enumerate(req.media["video"]):
            if not isinstance(frames, list) or not frames:
                raise CodecError(f"videos[{i}] must be a non-empty list of base64 PNG frames")
            arr, used = _decode_images(frames, f"videos[{i}]", budget)
            budget -= used
            if videos and arr.shape != videos[0].shape:
                raise CodecError(
                    f"videos[{i}] has frames {arr.shape} but videos[0] has {videos[0].shape}; "
                    "all videos in a request must have one length and frame size"
                )
            videos.append(arr)
        fields["video"] = torch.from_numpy(np.stack(videos))
    if "audio" in req.media:
        decoded = [codec.decode_wav(e, f"audio[{i}]") for i, e in enumerate(req.media["audio"])]
        clips = [clip for clip, _ in decoded]
        for i, (clip, rate) in enumerate(decoded):
            if sample_rate is not None and rate != sample_rate:
                raise CodecError(
                    f"audio[{i}] is at {rate} Hz but the scorer expects {sample_rate} Hz "
                    "(set the http scorer's audio_sample_rate to the server scorer's sample_rate)"
                )
            if rate != decoded[0][1]:
                raise CodecError(f"audio[{i}] is at {rate} Hz but audio[0] at {decoded[0][1]} Hz")
            if clip.shape != clips[0].shape:
                raise CodecError(
                    f"audio[{i}] has shape {clip.shape} but audio[0] has {clips[0].shape}; "
                    "all clips in a request must have one length and channel count"
                )
        if sum(c.nbytes for c in clips) > budget:
            raise TooLargeError("decoded audio would be over the server's limit")
        fields["audio"] = torch.from_numpy(np.stack(clips))
    return fields


def _int_list(metadata: dict[str, Any], key: str, n: int) -> torch.Tensor | None:
    value = metadata.get(key)
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise _fail(422, f"metadata.{key} must be a list of {n} integers")
    return torch.tensor(value, dtype=torch.long)


def build_trajectory(
    prompts: list[str], fields: dict[str, torch.Tensor], metadata: dict[str, Any]
) -> Trajectory:
    """A minimal valid Trajectory around the decoded media, so an unmodified scorer can run.

    Token ids, hashes and latents do not travel over HTTP: scorers read prompt texts and
    media only. ``metadata`` may carry prompt_ids / group / seeds / policy_version (the client
    sends them), which group-aware scorers can use; otherwise each sample is its own group.
    ``x0`` is a zero-stride view so that a batch of large images costs no extra memory.
    """
    n = len(prompts)
    h, w = fields["image"].shape[1:3] if "image" in fields else (1, 1)
    ints = {k: _int_list(metadata, k, n) for k in METADATA_INT_LISTS}
    version = metadata.get("policy_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise _fail(422, "metadata.policy_version must be an integer")
    arange = torch.arange(n, dtype=torch.long)
    batch = PromptBatch(
        texts=tuple(prompts),
        input_ids=torch.zeros((n, 1), dtype=torch.long),
        ids_hash=("",) * n,
        prompt_ids=arange if ints["prompt_ids"] is None else ints["prompt_ids"],
    )
    return Trajectory(
        prompts=batch,
        group=arange if ints["group"] is None else ints["group"],
        seeds=torch.zeros(n, dtype=torch.long) if ints["seeds"] is None else ints["seeds"],
        x0=torch.zeros((1, 3, h, w)).expand(n, -1, -1, -1),
        sigmas=torch.tensor([1.0, 0.0]),
        policy_version=version,
        extra_fields=fields,
    )


def _finite_or_none(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def encode_result(result: ScoreResult, n: int, name: str) -> dict[str, Any]:
    """ScoreResult -> response JSON. JSON has no NaN, so a missing score is ``null`` with
    ``valid: false``; the client turns it back into NaN (never 0)."""
    scores = result.scores.detach().float().cpu().reshape(-1)
    valid = result.valid.detach().bool().cpu().reshape(-1)
    if scores.shape != (n,) or valid.shape != (n,):
        raise _fail(
            500, f"scorer {name!r} returned {tuple(result.scores.shape)} scores for {n} samples"
        )
    out_scores: list[float | None] = []
    out_valid: list[bool] = []
    for s, ok in zip(scores.tolist(), valid.tolist(), strict=True):
        good = bool(ok) and math.isfinite(s)
        out_scores.append(s if good else None)
        out_valid.append(good)
    metrics = {str(k): _finite_or_none(v) for k, v in result.metrics.items()}
    return {"scores": out_scores, "valid": out_valid, "metrics": metrics}


def create_app(
    scorer: Scorer,
    token: str | None,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * (1 << 20)),
    *,
    max_concurrent: int = 1,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> FastAPI:
    """The reward app for one scorer. ``token=None`` disables auth (loopback only; the CLI
    enforces that). ``max_concurrent`` batches are scored at a time (default 1: a GPU reward
    model should see one batch at a time rather than run out of memory on several)."""
    if max_batch < 1 or max_body_bytes < 1 or max_concurrent < 1:
        raise ValueError("max_batch, max_body_bytes and max_concurrent must be >= 1")
    # No /docs or /openapi.json: they would be unauthenticated and describe nothing useful.
    app = FastAPI(title="diffrl reward server", docs_url=None, redoc_url=None, openapi_url=None)
    needs = frozenset(scorer.needs)
    expected = token.encode() if token else None
    gate = asyncio.Semaphore(max_concurrent)
    rate = getattr(scorer, "sample_rate", None)  # audio scorers declare the rate they expect
    rate = int(rate) if isinstance(rate, (int, float)) and rate > 0 else None

    def authorize(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the token matched
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        authorize(request)
        return {
            "status": "ok",
            "scorer": scorer.name,
            "needs": sorted(needs),
            "max_batch": max_batch,
            "max_body_bytes": max_body_bytes,
        }

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        authorize(request)
        body = await read_body(request, max_body_bytes)
        req = parse_request(body, needs, max_batch)
        n = len(req.prompts)
        if n == 0:
            return JSONResponse({"scores": [], "valid": [], "metrics": {}})
        try:  # decoding is CPU-bound: keep the event loop free for /health and other uploads
            fields = await asyncio.to_thread(decode_media, req, max_decoded_bytes, rate)
        except TooLargeError as e:
            raise _fail(413, str(e)) from None
        except CodecError as e:
            raise _fail(422, str(e)) from None
        traj = build_trajectory(req.prompts, fields, req.metadata)
        async with gate:
            try:
                result = await scorer.score(traj)
            except Exception as e:
                log.exception("scorer %r failed on a batch of %d", scorer.name, n)
                raise _fail(500, f"scorer {scorer.name!r} failed: {type(e).__name__}: {e}") from e
        return JSONResponse(encode_result(result, n, scorer.name))

    return app


def serve(
    scorer_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    params: dict[str, Any] | None = None,
) -> None:
    """Build the scorer and serve it until interrupted (what ``diffrl serve-reward`` runs).
    Every check runs before the scorer is built, so a bad flag fails in seconds, not after a
    reward model has loaded."""
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(host, token)
    if max_batch < 1:
        raise DiffrlError(f"--max-batch={max_batch}: must be >= 1")
    if not max_body_mb > 0:
        raise DiffrlError(f"--max-body-mb={max_body_mb}: must be > 0")
    try:
        scorer = build_scorer(scorer_name, params)
    except (KeyError, ValueError) as e:
        raise DiffrlError(f"--scorer {scorer_name}: {e}") from None
    app = create_app(scorer, token, max_batch, int(max_body_mb * (1 << 20)))
    log.warning(
        "serving scorer %r (needs %s) on http://%s:%d, auth %s",
        scorer.name,
        sorted(scorer.needs),
        host,
        port,
        "on" if token else "off",
    )
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)


class BackgroundServer:
    """An ASGI app served by uvicorn on a daemon thread of this process.

    Why: tests (and notebooks) need a real server -- real sockets, real HTTP, real failures --
    without a subprocess's start-up cost. The socket is bound before the thread starts, so
    ``port=0`` picks a free port with no race and ``url`` is valid as soon as ``start`` returns.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host = app, host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock]},
            daemon=True,
            name=f"reward-server-{self.port}",
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the reward server thread exited during start-up")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the reward server did not start within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
