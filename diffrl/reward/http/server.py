"""Serve any registered scorer over HTTP (``diffrl serve-reward``).

Why a server at all: a reward model may need its own GPU, its own Python environment or its
own release cycle, and it can be shared by several training runs. The server wraps the same
``Scorer`` protocol the in-process pool uses, so a scorer is written once and can run either
way; ``HttpScorer`` (client.py) is its counterpart on the training side. The JSON API is
described in docs/reward_http.md, what each defence is for in docs/reliability.md.

A request is checked in the order that is cheapest for the server and clearest for the client:
1. the connection (guard.py's ``GuardedH11Protocol``): a request head within
   ``header_timeout_s`` and ``max_head_bytes`` (408 / 431), the bearer token at the head (401,
   and the socket is closed without reading on), a request slot (at most ``max_connections``
   requests at once; past them a bounded, timed queue, then 503), a body within
   ``body_timeout_s`` (408);
2. the caller: the bearer token again (401), or without one, a loopback Host, a loopback or
   absent Origin and a JSON content type (400 / 403 / 415), so a web page cannot drive the
   server;
3. body size (413), JSON shape, batch size and metadata ranges (400 / 413 / 422);
4. inside the batch gate (guard.py's ``BatchGate``, one batch at a time): media headers against
   the scoring and decoding budgets and whole-file checks (413 / 422), then decoding (422),
   then scoring (422 if the scorer refuses its input with ValueError, 500 if it fails
   otherwise). Work whose client has gone is skipped or cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
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
from urllib.parse import urlsplit

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from diffrl.errors import DiffrlError
from diffrl.reward.http import codec
from diffrl.reward.http.codec import MEDIA_FIELDS, TOKEN_ENV, CodecError, TooLargeError
from diffrl.reward.http.guard import (
    UNAUTHORIZED,
    BatchGate,
    ConnectionLimits,
    bearer_matches,
    clip,
    quiet_repetitive_logs,
    uvicorn_config,
    wait_for_disconnect,
)
from diffrl.reward.scorer import Scorer, ScoreResult, is_group_scorer
from diffrl.reward.scorers import build_scorer
from diffrl.types import PromptBatch, Trajectory

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_BODY_MB = 64.0
# Decoded media can be far larger than the (compressed) body: a black 8192^2 PNG is ~200 kB
# but 192 MiB of RGB. This caps what one request may decode (256 MiB = 89 Mpx of RGB, e.g. 85
# images of 1024^2); it is checked from the PNG headers before any pixel is decoded.
DEFAULT_MAX_DECODED_BYTES = 256 << 20
# What one request may ask the scorer to look at, images and video frames together (pixels x
# batch): scoring cost grows with it, and five 4096^2 PNGs of 319 kB once took the shapes
# verifier 2.9 GB and 50 s of the gate. 32 Mpx (2^20 px each) is 128 images of 512^2 or 32 of
# 1024^2; past it the client splits its batch (HttpScorer's batch_size).
DEFAULT_MAX_REQUEST_MPX = 32.0
# Params ``serve`` gives a scorer unless told otherwise, so a served scorer scores as the
# recipes do: the default recipe (recipes/shapes_nft.yaml, and shapes_sd3_nft) scores shapes
# with mode=overall, while the constructor's default is partial credit.
SERVE_DEFAULT_PARAMS: dict[str, dict[str, Any]] = {"shapes": {"mode": "overall"}}
METADATA_INT_LISTS = ("prompt_ids", "group", "seeds")
INT64 = (-(1 << 63), (1 << 63) - 1)
CLIENT_GONE = 499  # nginx's "client closed request": never delivered, only logged


# --- the caller -------------------------------------------------------------------------------


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


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header -> (host, port or None); "[::1]:8000" -> ("::1", 8000)."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            host, port = value, ""
    if not port:
        return host, None
    if not port.isdigit():
        raise ValueError(f"bad port in {value!r}")
    return host, int(port)


def check_local_caller(request: Request, body: bool) -> None:
    """Without a token, make sure the caller is a program on this machine, not a web page in
    its browser: DNS rebinding sends a foreign Host, a cross-site fetch or form a foreign (or
    "null") Origin, and a browser sends a JSON content type only after a CORS preflight, which
    this server never grants (so a text/plain "simple request" is refused)."""
    host_header = request.headers.get("host", "")
    server = request.scope.get("server")
    port = server[1] if server else None
    try:
        host, given = split_host(host_header)
    except ValueError:
        host, given = "", None
    if not is_loopback(host) or (port is not None and (given or 80) != port):
        raise _fail(
            400,
            f"Host header {host_header!r} is not this server's loopback address "
            f"(127.0.0.1:{port}); without {TOKEN_ENV} the server answers local programs only",
        )
    origin = request.headers.get("origin")
    if origin is not None and not is_loopback(urlsplit(origin).hostname or ""):
        raise _fail(403, f"Origin {origin!r} is not a loopback origin")
    if body:
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise _fail(415, f"Content-Type must be application/json, got {media or 'none'!r}")


# --- the request ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoreRequest:
    """A /score body after its JSON shape was checked (media still encoded)."""

    prompts: list[str]
    media: dict[str, list[Any]]  # extra-field name -> encoded entries, one per prompt
    metadata: dict[str, Any]


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
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _fail(413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload (or cut at the body deadline): nobody to answer
        raise _fail(CLIENT_GONE, "the client left during the upload") from None
    return b"".join(chunks)


def parse_request(body: bytes, needs: frozenset[str], max_batch: int) -> ScoreRequest:
    """Check the JSON shape of a /score body; errors name the offending field."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise _fail(400, "request body is JSON nested too deeply") from None
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
    check_metadata(metadata, n)  # before the request queues for the gate
    return ScoreRequest(prompts, media, metadata)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_metadata(metadata: dict[str, Any], n: int) -> tuple[dict[str, list[int] | None], int]:
    """(prompt_ids / group / seeds lists or None, policy_version); 422 for a wrong type or
    length, 400 for an integer outside int64 (what the tensors hold)."""
    lists: dict[str, list[int] | None] = {}
    for key in METADATA_INT_LISTS:
        value = metadata.get(key)
        if value is not None and (
            not isinstance(value, list) or len(value) != n or not all(map(_is_int, value))
        ):
            raise _fail(422, f"metadata.{key} must be a list of {n} integers")
        for i, v in enumerate(value or ()):
            if not INT64[0] <= v <= INT64[1]:
                raise _fail(400, f"metadata.{key}[{i}] = {v} is outside the int64 range")
        lists[key] = value
    version = metadata.get("policy_version", 0)
    if not _is_int(version):
        raise _fail(422, "metadata.policy_version must be an integer")
    if not INT64[0] <= version <= INT64[1]:
        raise _fail(400, f"metadata.policy_version = {version} is outside the int64 range")
    return lists, version


# --- media ------------------------------------------------------------------------------------


def _png_headers(entries: list[Any], what: str) -> tuple[list[bytes], tuple[int, int]]:
    """Base64 PNGs of one size -> (raw bytes, (width, height)), from their headers only."""
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
    return [raw for raw, _ in sized], (w, h)


def _decode_pngs(raws: list[bytes], size: tuple[int, int], what: str) -> np.ndarray:
    w, h = size
    out = np.empty((len(raws), h, w, 3), dtype=np.uint8)  # (N, H, W, 3)
    for i, raw in enumerate(raws):
        out[i] = codec.decode_png(raw, f"{what}[{i}]")
    return out


def decode_media(
    req: ScoreRequest,
    max_decoded_bytes: int,
    sample_rate: int | None = None,
    max_pixels: int | None = None,
) -> dict[str, torch.Tensor]:
    """Encoded media -> the tensors scorers read: image (B, H, W, 3) uint8, video
    (B, F, H, W, 3) uint8, audio (B, N) or (B, C, N) float32 in [-1, 1].

    Every PNG header is read (and every PNG checked whole, see ``codec.png_size``) and the
    totals checked against ``max_pixels`` (what the scorer will look at, images and video
    frames) and ``max_decoded_bytes`` before any pixel is decoded, so a request of small PNGs
    claiming huge sizes costs nothing.
    Audio tensors carry no rate, so a scorer assumes its own (its ``sample_rate`` param);
    ``sample_rate``, when known, is checked against the WAV headers so that audio at another
    rate is refused instead of silently scored at the wrong speed."""
    planned = pixels = 0

    def take(nbytes: int, what: str) -> None:
        nonlocal planned, pixels
        if what != "audio":
            pixels += nbytes // 3  # RGB
            if max_pixels is not None and pixels > max_pixels:
                raise TooLargeError(
                    f"{what} would take the request to {pixels} pixels, over the server's "
                    f"scoring budget of {max_pixels} pixels a request (--max-request-mpx "
                    f"{max_pixels / (1 << 20):g}); send fewer or smaller images a request"
                )
        planned += nbytes
        if planned > max_decoded_bytes:
            raise TooLargeError(
                f"decoded {what} would take the request to {planned} bytes, over the server's "
                f"limit of {max_decoded_bytes} bytes ({max_decoded_bytes // 3} RGB pixels)"
            )

    images = None
    if "image" in req.media:
        raws, (w, h) = _png_headers(req.media["image"], "images")
        take(len(raws) * h * w * 3, "images")
        images = (raws, (w, h))
    videos = []
    for i, frames in enumerate(req.media.get("video", ())):
        if not isinstance(frames, list) or not frames:
            raise CodecError(f"videos[{i}] must be a non-empty list of base64 PNG frames")
        raws, (w, h) = _png_headers(frames, f"videos[{i}]")
        if videos and (len(raws), (w, h)) != (len(videos[0][0]), videos[0][1]):
            f0, (w0, h0) = len(videos[0][0]), videos[0][1]
            raise CodecError(
                f"videos[{i}] has {len(raws)} frames of {w}x{h} but videos[0] has {f0} of "
                f"{w0}x{h0}; all videos in a request must have one length and frame size"
            )
        take(len(raws) * h * w * 3, f"videos[{i}]")
        videos.append((raws, (w, h)))
    # every header read and within budget: now decode
    fields: dict[str, torch.Tensor] = {}
    if images is not None:
        fields["image"] = torch.from_numpy(_decode_pngs(*images, "images"))
    if videos:
        frames_out = [_decode_pngs(r, s, f"videos[{i}]") for i, (r, s) in enumerate(videos)]
        fields["video"] = torch.from_numpy(np.stack(frames_out))
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
        take(sum(c.nbytes for c in clips), "audio")  # bounded by the body: 2x its PCM
        fields["audio"] = torch.from_numpy(np.stack(clips))
    return fields


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
    lists, version = check_metadata(metadata, n)
    ints = {k: None if v is None else torch.tensor(v, dtype=torch.long) for k, v in lists.items()}
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


def scorer_params(scorer: Scorer, given: dict[str, Any]) -> dict[str, Any]:
    """The params a scorer runs with: those given, plus each constructor param the scorer
    keeps as an attribute of the same name (so defaults show too, e.g. shapes' ``mode``)."""
    out = dict(given)
    try:
        names = list(inspect.signature(type(scorer).__init__).parameters)
    except (TypeError, ValueError):
        names = []
    for name in names:
        value = getattr(scorer, name, None)
        if name not in out and isinstance(value, (str, int, float, bool)):
            out[name] = value
    return out


# --- the app ----------------------------------------------------------------------------------


def create_app(
    scorer: Scorer,
    token: str | None,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * (1 << 20)),
    *,
    max_concurrent: int = 1,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    max_request_pixels: int = int(DEFAULT_MAX_REQUEST_MPX * (1 << 20)),
    params: dict[str, Any] | None = None,
) -> FastAPI:
    """The reward app for one scorer. ``token=None`` disables auth (loopback only; the CLI
    enforces that) and checks instead that callers are local programs. ``max_concurrent``
    batches are decoded and scored at a time (default 1, see ``BatchGate``). ``params``: the
    scorer's params, reported by /health (default: what ``scorer_params`` finds)."""
    limits = (max_batch, max_body_bytes, max_concurrent, max_decoded_bytes, max_request_pixels)
    if min(limits) < 1:
        raise ValueError(
            "max_batch, max_body_bytes, max_concurrent, max_decoded_bytes, max_request_pixels: >= 1"
        )
    params = scorer_params(scorer, {}) if params is None else params
    # No /docs or /openapi.json: they would be unauthenticated and describe nothing useful.
    app = FastAPI(title="diffrl reward server", docs_url=None, redoc_url=None, openapi_url=None)
    needs = frozenset(scorer.needs)
    expected = token.encode() if token else None
    gate = BatchGate(max_concurrent)
    rate = getattr(scorer, "sample_rate", None)  # audio scorers declare the rate they expect
    rate = int(rate) if isinstance(rate, (int, float)) and rate > 0 else None

    def authorize(request: Request, body: bool) -> None:
        if expected is None:
            check_local_caller(request, body)
            return
        # the connection checked it at the head already (guard.py); this covers any server
        # that runs the app without that protocol
        if not bearer_matches(request.headers.get("authorization"), expected):
            raise HTTPException(
                status_code=401, detail=UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"}
            )

    async def decode_and_score(req: ScoreRequest) -> ScoreResult:
        n = len(req.prompts)
        try:  # decoding is CPU-bound: keep the event loop free for /health and other uploads
            fields = await asyncio.to_thread(
                decode_media, req, max_decoded_bytes, rate, max_request_pixels
            )
        except TooLargeError as e:
            raise _fail(413, str(e)) from None
        except CodecError as e:
            raise _fail(422, str(e)) from None
        traj = build_trajectory(req.prompts, fields, req.metadata)
        try:
            return await scorer.score(traj)
        except ValueError as e:  # the scorer refuses this input: the same again fails again
            log.warning("scorer %r refused a batch of %d: %s", scorer.name, n, e)
            raise _fail(422, f"scorer {scorer.name!r} refused the input: {clip(str(e))}") from None
        except Exception as e:
            log.exception("scorer %r failed on a batch of %d", scorer.name, n)
            raise _fail(
                500, f"scorer {scorer.name!r} failed: {type(e).__name__}: {clip(str(e))}"
            ) from e

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        authorize(request, body=False)
        return {
            "status": "ok",
            "scorer": scorer.name,
            "needs": sorted(needs),
            "params": params,
            "max_batch": max_batch,
            "max_body_bytes": max_body_bytes,
            "max_request_pixels": max_request_pixels,
        }

    @app.post("/score")
    async def score(request: Request) -> Response:
        authorize(request, body=True)
        body = await read_body(request, max_body_bytes)
        req = parse_request(body, needs, max_batch)
        n = len(req.prompts)
        if n == 0:
            return JSONResponse({"scores": [], "valid": [], "metrics": {}})
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            result = await gate.run(lambda: decode_and_score(req), gone)
        finally:
            gone.cancel()
        if result is None:
            log.info("the client of a batch of %d left; its work was skipped or cancelled", n)
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(encode_result(result, n, scorer.name))

    return app


def serve(
    scorer_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    params: dict[str, Any] | None = None,
    *,
    max_decoded_mb: float = DEFAULT_MAX_DECODED_BYTES / (1 << 20),
    max_request_mpx: float = DEFAULT_MAX_REQUEST_MPX,
    limits: ConnectionLimits | None = None,
) -> None:
    """Build the scorer and serve it until interrupted (what ``diffrl serve-reward`` runs).
    Every check runs before the scorer is built, so a bad flag fails in seconds, not after a
    reward model has loaded. A scorer named in ``SERVE_DEFAULT_PARAMS`` gets those params
    unless ``params`` sets them; the start-up line states the params the scorer runs with."""
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(host, token)
    if max_batch < 1:
        raise DiffrlError(f"--max-batch={max_batch}: must be >= 1")
    sizes = (max_body_mb, max_decoded_mb, max_request_mpx)
    if not all(0 < mb < math.inf for mb in sizes):  # NaN fails too
        raise DiffrlError(
            f"--max-body-mb={max_body_mb}, --max-decoded-mb={max_decoded_mb}, "
            f"--max-request-mpx={max_request_mpx}: must be finite, > 0"
        )
    limits = limits or ConnectionLimits()
    given = {**SERVE_DEFAULT_PARAMS.get(scorer_name, {}), **(params or {})}
    try:
        scorer = build_scorer(scorer_name, given)
    except (KeyError, ValueError) as e:
        raise DiffrlError(f"--scorer {scorer_name}: {e}") from None
    if is_group_scorer(scorer):  # the client splits a batch by --max-batch, not by group
        raise DiffrlError(
            f"--scorer {scorer_name}: a group scorer is not served over HTTP; run it in the "
            "reward pool (reward.scorers), serving its per-sample judge here if it has one"
        )
    effective = scorer_params(scorer, given)
    app = create_app(
        scorer,
        token,
        max_batch,
        int(max_body_mb * (1 << 20)),
        max_decoded_bytes=int(max_decoded_mb * (1 << 20)),
        max_request_pixels=int(max_request_mpx * (1 << 20)),
        params=effective,
    )
    log.warning(
        "serving scorer %r (params %s; needs %s) on http://%s:%d, auth %s",
        scorer.name,
        effective,
        sorted(scorer.needs),
        host,
        port,
        "on" if token else "off",
    )
    _raise_fd_limit(limits)
    config = uvicorn_config(
        app,
        limits,
        token,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=10,
    )
    quiet_repetitive_logs(__name__)  # after the config: uvicorn sets its loggers up there
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()


def _raise_fd_limit(limits: ConnectionLimits) -> None:
    """Make room for every socket the limits allow (idle + in progress + queued, plus the
    process's own files): a server out of file descriptors refuses everyone."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    need = limits.max_idle + limits.max_connections + limits.max_queued + 128
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < need:
        log.warning(
            "the open-file limit (%d) is below the %d sockets the connection limits allow; "
            "lower --max-idle-connections / --max-queued or raise `ulimit -n`",
            soft,
            need,
        )


class BackgroundServer:
    """An ASGI app served by uvicorn on a daemon thread of this process, with the same
    connection guards as ``serve``.

    Why: tests (and notebooks) need a real server -- real sockets, real HTTP, real failures --
    without a subprocess's start-up cost. The socket is bound before the thread starts, so
    ``port=0`` picks a free port with no race and ``url`` is valid as soon as ``start`` returns.
    ``token``: the app's bearer token, for the connection to check at the head as ``serve``
    does (the app checks it either way).
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ConnectionLimits | None = None,
        token: str | None = None,
    ) -> None:
        self.app, self.host = app, host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn_config(
            app,
            limits or ConnectionLimits(),
            token,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
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
