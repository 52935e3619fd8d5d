"""``HttpScorer``: a scorer that asks a remote reward server (``diffrl serve-reward``).

Failure policy, and why:
- timeouts, connection errors, 429 and 5xx are transient (a restarting or busy server), so
  they are retried with exponential backoff plus jitter (jitter keeps many workers from
  retrying in lock-step); a 429's Retry-After is honoured up to ``max_backoff_s``;
- any other 4xx means the request itself is wrong (bad token, missing field, oversize), which
  no retry can fix: it raises at once with the status and the server's message;
- a malformed 2xx reply (not JSON, no 'scores', wrong count, non-numbers) means client and
  server disagree about the API; it is not retried either, and the error names the problem;
- a null or NaN score, or one that overflows float32 (1e300 -> inf), marks that sample
  missing (``valid=False``, score NaN), never 0 and never a valid inf;
- a reply is read as a stream and dropped past ``max_reply_bytes`` (a /score reply is ~30
  bytes a sample), so a broken or hostile server cannot make the trainer buffer gigabytes;
- credentials in the URL (``http://user:pass@host``) never appear in a message or a log line.
The pool turns a raise into RewardFailure (required scorer) or missing samples (optional).

httpx is imported lazily so registering this scorer (which happens whenever any scorer is
built) does not require the HTTP client to be installed.
"""

from __future__ import annotations

import asyncio
import email.utils
import ipaddress
import json
import logging
import math
import os
import random
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import torch

from diffrl.errors import DiffrlError
from diffrl.reward.http import codec
from diffrl.reward.http.codec import MEDIA_FIELDS, TOKEN_ENV
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.types import Trajectory

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

JITTER = 0.1  # each wait is stretched by up to 10%
DEFAULT_MAX_REPLY_BYTES = 16 << 20  # a /score reply of 256 samples is ~10 kB
ERROR_BODY_BYTES = 64 << 10  # an error reply is read this far, for its message


class RewardHttpError(DiffrlError):
    """The remote reward server could not produce scores; the message says why."""


class RewardRequestRejected(RewardHttpError):
    """The server refused the request (a 4xx other than 429); retrying cannot help."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RewardReplyMalformed(RewardHttpError):
    """The server answered 2xx with something that is not a valid /score reply."""


class RewardServerUnavailable(RewardHttpError):
    """Every attempt failed with a transient error (timeout, connection, 429, 5xx)."""


def backoff_delay(
    attempt: int, base_s: float, cap_s: float, retry_after_s: float | None = None
) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based): base * 2^(k-1),
    at least the server's Retry-After, at most ``cap_s``, plus up to 10% jitter."""
    delay = base_s * (2 ** (attempt - 1))
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    delay = min(delay, cap_s)
    return delay * (1.0 + JITTER * random.random())


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: either delay-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class Reply:
    """One HTTP reply, its body read up to a cap."""

    status: int
    reason: str
    headers: httpx.Headers
    body: bytes
    cut: bool  # the body went on past the cap (and was not read further)


async def read_capped(resp: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """(at most ``limit`` bytes of a streamed body, whether it went on past that). Stops at
    a declared Content-Length over the limit without reading, else as soon as the limit is
    passed, so a huge or endless reply costs ``limit`` bytes at most."""
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return b"", True
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():  # decoded: a gzip bomb counts in full
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks)[:limit], True
    return b"".join(chunks), False


def _server_message(body: bytes) -> str:
    """The server's error text: FastAPI's {"detail": ...} when present, else the raw body."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and "detail" in data:
            return str(data["detail"])
    except ValueError:
        pass
    text = body.decode(errors="replace").strip()
    return text[:300] + ("..." if len(text) > 300 else "") if text else "(empty body)"


def redact_url(url: str) -> str:
    """``url`` with any user:password replaced by ``***``, fit for messages and logs."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def scrub(text: str, url: str) -> str:
    """``text`` with ``url``'s credentials removed, raw or percent-decoded, wherever they
    appear (an exception from the HTTP stack may quote the URL)."""
    userinfo = urlsplit(url).netloc.rpartition("@")[0]
    if not userinfo:
        return text
    password = userinfo.partition(":")[2]
    secrets = {userinfo, unquote(userinfo), password, unquote(password)} - {""}
    for secret in sorted(secrets, key=len, reverse=True):  # the whole before its parts
        text = text.replace(secret, "***")
    return text


def resolves_to_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback one. Decided from the
    addresses, not the name: "127.0.0.1.example.com" is a public DNS name, and "localhost"
    is loopback only because it resolves so. A name that does not resolve is not loopback."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0].partition("%")[0] for info in infos}  # drop an IPv6 zone id
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


@register_scorer("http")
class HttpScorer:
    """Scores a trajectory by POSTing its prompts and media to a reward server.

    ``retries`` counts extra attempts after the first, so a request is tried at most
    ``retries + 1`` times. ``batch_size`` > 0 splits a trajectory into several requests (sent
    one after another) to stay under the server's max batch or body size; 0 sends one.
    ``url`` is kept with its credentials redacted (what messages show); requests use the
    URL as given.
    """

    def __init__(
        self,
        url: str,
        needs: Iterable[str] = ("image",),
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        token_env: str = TOKEN_ENV,
        batch_size: int = 0,
        audio_sample_rate: int = 16000,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    ) -> None:
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
            shown = redact_url(url) if isinstance(url, str) else url
            raise ValueError(f"url={shown!r}: must be an http:// or https:// URL")
        needs = frozenset([needs] if isinstance(needs, str) else needs)
        unknown = sorted(needs - set(MEDIA_FIELDS))
        if unknown:
            raise ValueError(
                f"needs={sorted(needs)}: unknown {unknown}, allowed {list(MEDIA_FIELDS)}"
            )
        if not timeout_s > 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("timeout_s must be > 0 and retries, backoff_s, max_backoff_s >= 0")
        if batch_size < 0:
            raise ValueError(f"batch_size={batch_size}: must be >= 0 (0 = one request)")
        if max_reply_bytes < 1024:
            raise ValueError(f"max_reply_bytes={max_reply_bytes}: must be >= 1024")
        self.name = "http"
        self.needs = needs
        self._url = url.rstrip("/")  # with credentials, if any: only requests see it
        self.url = redact_url(self._url)
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.token_env = token_env
        self.token = os.environ.get(token_env) or None
        self.batch_size = int(batch_size)
        self.audio_sample_rate = int(audio_sample_rate)
        self.max_reply_bytes = int(max_reply_bytes)
        self.attempts = 0  # HTTP attempts made over this scorer's life (retries included)
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        parts = urlsplit(url)
        if self.token and parts.scheme == "http" and not resolves_to_loopback(parts.hostname or ""):
            log.warning("the reward token is sent in clear text to %s; prefer https", self.url)

    # -- connection ---------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        """The pooled client, made on first use. An AsyncClient's connections belong to the
        event loop that opened them, so a new loop (e.g. one asyncio.run per step) gets a new
        client instead of one whose sockets are tied to a closed loop."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            try:
                import httpx
            except ImportError as e:
                raise RewardHttpError(
                    "the 'http' scorer needs httpx: pip install 'httpx>=0.27'"
                ) from e
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s))
            self._loop = loop
        return self._http

    async def close(self) -> None:
        """Close pooled connections. Safe to call twice; a later score() reopens."""
        http, self._http = self._http, None
        if http is not None:
            try:
                if self._loop is asyncio.get_running_loop():
                    await http.aclose()
            finally:
                self._loop = None

    async def __aenter__(self) -> HttpScorer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- scoring ------------------------------------------------------------------------------

    async def score(self, traj: Trajectory) -> ScoreResult:
        n = len(traj)
        if n == 0:
            return ScoreResult(torch.zeros(0), torch.zeros(0, dtype=torch.bool))
        step = self.batch_size or n
        scores, valid = torch.full((n,), float("nan")), torch.zeros(n, dtype=torch.bool)
        weighted: dict[str, float] = {}
        weight: dict[str, int] = {}
        attempts, started = 0, time.perf_counter()
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            # PNG encoding is CPU-bound: off the loop, so other scorers keep running meanwhile
            body = await asyncio.to_thread(self._encode, traj, lo, hi)
            data, tries = await self._post(body)
            attempts += tries
            s, v, metrics = self._parse(data, hi - lo)
            scores[lo:hi], valid[lo:hi] = s, v
            for k, x in metrics.items():  # chunk metrics -> size-weighted mean
                weighted[k] = weighted.get(k, 0.0) + x * (hi - lo)
                weight[k] = weight.get(k, 0) + (hi - lo)
        metrics = {k: weighted[k] / weight[k] for k in weighted}
        metrics["http_attempts"] = float(attempts)
        metrics["http_latency_s"] = time.perf_counter() - started
        scores = torch.where(valid, scores, torch.full_like(scores, float("nan")))
        return ScoreResult(scores, valid, metrics)

    def _encode(self, traj: Trajectory, lo: int, hi: int) -> bytes:
        """Rows [lo, hi) of a trajectory -> /score JSON body."""
        body: dict[str, Any] = {"prompts": list(traj.prompts.texts[lo:hi])}
        fields = traj.extra_fields
        if "image" in self.needs:
            images = fields["image"][lo:hi].detach().cpu().numpy()
            body["images"] = [codec.encode_png(im) for im in images]
        if "video" in self.needs:
            videos = fields["video"][lo:hi].detach().cpu().numpy()  # (B, F, H, W, 3)
            body["videos"] = [[codec.encode_png(f) for f in v] for v in videos]
        if "audio" in self.needs:
            clips = fields["audio"][lo:hi].detach().float().cpu().numpy()  # (B, N) / (B, C, N)
            body["audio"] = [codec.encode_wav(c, self.audio_sample_rate) for c in clips]
        body["metadata"] = {
            "prompt_ids": traj.prompts.prompt_ids[lo:hi].tolist(),
            "group": traj.group[lo:hi].tolist(),
            "seeds": traj.seeds[lo:hi].tolist(),
            "policy_version": int(traj.policy_version),
        }
        return json.dumps(body).encode()

    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        return headers

    async def _exchange(self, client: httpx.AsyncClient, body: bytes) -> Reply:
        """One POST /score, its reply body read up to the cap (less for an error)."""
        post = client.stream("POST", f"{self._url}/score", content=body, headers=self._headers())
        async with post as resp:
            ok = 200 <= resp.status_code < 300
            data, cut = await read_capped(resp, self.max_reply_bytes if ok else ERROR_BODY_BYTES)
            return Reply(resp.status_code, resp.reason_phrase, resp.headers, data, cut)

    async def _post(self, body: bytes) -> tuple[Any, int]:
        """POST /score with retries; returns (decoded JSON reply, attempts used)."""
        client = self._client()  # first: it raises a clear error if httpx is missing
        import httpx

        target = f"{self.url}/score"
        last = "no attempt made"
        tries = self.retries + 1
        for attempt in range(1, tries + 1):
            self.attempts += 1
            retry_after = None
            try:
                # wait_for bounds the whole exchange (a trickling reply included); httpx's
                # timeout bounds each read and write
                reply = await asyncio.wait_for(self._exchange(client, body), self.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                last = f"timed out after {self.timeout_s:g}s"
            except httpx.TransportError as e:
                last = scrub(f"{type(e).__name__}: {str(e) or 'connection failed'}", self._url)
            else:
                code = reply.status
                if 200 <= code < 300:
                    return self._json(reply), attempt
                if code == 429 or code >= 500:
                    last = f"HTTP {code}: {_server_message(reply.body)}"
                    retry_after = parse_retry_after(reply.headers.get("retry-after"))
                else:
                    raise RewardRequestRejected(self._rejection(reply), code)
            if attempt < tries:
                delay = backoff_delay(attempt, self.backoff_s, self.max_backoff_s, retry_after)
                log.warning(
                    "reward server %s: attempt %d/%d failed (%s); retrying in %.2fs",
                    target,
                    attempt,
                    tries,
                    last,
                    delay,
                )
                await asyncio.sleep(delay)
        raise RewardServerUnavailable(
            f"reward server {target} failed after {tries} attempt(s); last error: {last}"
        )

    def _rejection(self, reply: Reply) -> str:
        code = reply.status
        msg = (
            f"reward server {self.url} rejected the request with HTTP {code} "
            f"{reply.reason}: {scrub(_server_message(reply.body), self._url)}"
        )
        if code == 401:
            if self.token:
                msg += f" (the token in ${self.token_env} was refused; is it the server's?)"
            else:
                msg += f" (${self.token_env} is not set; set it to the server's token)"
        elif code == 413:
            msg += " (lower the http scorer's batch_size, or raise the server's limits)"
        elif code == 404:
            msg += " (is the url that of a diffrl reward server?)"
        return msg

    def _json(self, reply: Reply) -> Any:
        if reply.cut:
            raise RewardReplyMalformed(
                f"reward server {self.url} sent a reply over the client's limit of "
                f"{self.max_reply_bytes} bytes (max_reply_bytes); it was not read further"
            )
        try:
            return json.loads(reply.body)
        except (ValueError, RecursionError) as e:
            start = reply.body[:80].decode(errors="replace")
            raise RewardReplyMalformed(
                f"reward server {self.url} replied HTTP {reply.status} with a body that is "
                f"not JSON ({type(e).__name__}); it starts {start!r}"
            ) from None

    def _parse(self, data: Any, n: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """A /score reply -> (scores with NaN where missing, valid mask, numeric metrics)."""

        def bad(problem: str) -> RewardReplyMalformed:
            return RewardReplyMalformed(f"reward server {self.url} sent a bad reply: {problem}")

        if not isinstance(data, dict) or "scores" not in data:
            raise bad("it has no 'scores' field")
        raw = data["scores"]
        if not isinstance(raw, list):
            raise bad(f"'scores' is a {type(raw).__name__}, not a list")
        if len(raw) != n:
            raise bad(f"it returned {len(raw)} scores for {n} samples")
        scores: list[float] = []
        for i, s in enumerate(raw):
            if s is None:
                scores.append(math.nan)
            elif isinstance(s, (int, float)) and not isinstance(s, bool):
                try:
                    scores.append(float(s))
                except OverflowError:  # an integer past float64: 1e400 written out
                    scores.append(math.nan)
            else:
                raise bad(f"scores[{i}] is {s!r}, not a number or null")
        flags = data.get("valid")
        if flags is not None:
            if not isinstance(flags, list) or len(flags) != n:
                raise bad(f"'valid' must be a list of {n} booleans")
            if not all(isinstance(f, bool) for f in flags):
                raise bad("'valid' holds something other than booleans")
        # float32 is what rewards are kept in: 1e300 or 3.5e38 would become a "valid" inf
        out = torch.tensor(scores, dtype=torch.float64).to(torch.float32)
        valid = torch.isfinite(out)
        if flags is not None:
            valid &= torch.tensor(flags, dtype=torch.bool)
        metrics_raw = data.get("metrics") or {}
        if not isinstance(metrics_raw, dict):
            raise bad("'metrics' is not an object")
        metrics = {
            str(k): float(v)
            for k, v in metrics_raw.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        return torch.where(valid, out, torch.full_like(out, math.nan)), valid, metrics
