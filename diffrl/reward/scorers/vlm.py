"""A vision-language model as judge, over any OpenAI-compatible chat completions API: one
image at a time (``vlm_judge``), or pairwise within a group (``vlm_pairwise``: A or B?).

Each image goes, as a base64 PNG ``data:`` URL, to ``POST {base_url}/v1/chat/completions``
(vLLM, SGLang, TGI, llama.cpp's server and hosted APIs all speak it) with a question made from
a template and the prompt. The reply is parsed strictly: ``yes`` -> 1, ``no`` -> 0, or a number
in [0, 1] when ``answer="score"``. A reply that does not parse, or a request that still fails
after its retries, marks that sample missing (``valid=False``): a judge's shrug is not a "no",
and scoring it 0 would teach the policy to avoid whatever confuses the judge.

Transient failures (HTTP 429, 5xx, time-outs, dropped connections) are retried with exponential
back-off (honouring ``Retry-After``); a concurrency cap keeps a large batch from flooding the
server. ``timeout`` bounds each whole request, so a server that trickles its reply a byte at a
time cannot hold a sample past it (httpx's own timeout is per read); a reply is read at most to
``MAX_REPLY_BYTES``; credentials in ``base_url`` never appear in a message. httpx is imported
lazily so the package imports without it.

``vlm_pairwise`` is a group scorer (reward/scorer.py): for the G images of one prompt it asks
the judge about every pair, both images in one request (first = A, second = B), in both orders
by default so that a judge's leaning to one position cancels; each sample's reward is its win
rate over the comparisons that got a parsed answer (Pref-GRPO's, reward/scorers/pairwise.py).
That is G(G-1) requests per group (G(G-1)/2 with ``both_orders=False``), under the same
concurrency cap, time-outs and retries as ``vlm_judge``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from diffrl.errors import check_choice
from diffrl.reward.http.client import read_capped, redact_url, scrub
from diffrl.reward.scorer import ScoreResult, register_scorer
from diffrl.reward.scorers.pairwise import win_rates
from diffrl.types import Trajectory

log = logging.getLogger(__name__)

TEMPLATES = {
    "yesno": 'Does this image show: "{prompt}"? Answer yes or no.',
    "score": (
        'How well does this image match the description "{prompt}"? Reply with only a number '
        "between 0 and 1, where 1 is a perfect match."
    ),
}

PAIRWISE_TEMPLATE = (
    'Both images were generated for the description "{prompt}". Which one matches it better, '
    "the first (A) or the second (B)? Answer A or B."
)

MAX_REPLY_BYTES = 1 << 20  # a chat completion of a few tokens is ~1 kB

_WORD = re.compile(r"[a-z]+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_yesno(text: str) -> float | None:
    """1.0 / 0.0 when the reply's first word is yes / no (an ``Answer:`` label is skipped;
    case, punctuation and markdown are ignored); None for anything else, e.g. "maybe"."""
    words = _WORD.findall(text.lower())
    if words[:1] == ["answer"]:
        words = words[1:]
    if not words:
        return None
    return {"yes": 1.0, "no": 0.0}.get(words[0])


def parse_score(text: str) -> float | None:
    """The first number in the reply, if it lies in [0, 1]; None otherwise (no number, or a
    number on another scale such as "8/10", which would be a guess to rescale)."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    value = float(m.group())
    return value if 0.0 <= value <= 1.0 else None


PARSERS = {"yesno": parse_yesno, "score": parse_score}


def parse_choice(text: str) -> float | None:
    """1.0 when the reply picks the first image (its first word is A, after an optional
    ``Answer:`` or ``Image`` label), 0.0 for the second (B); None for anything else."""
    words = _WORD.findall(text.lower())
    while words[:1] in (["answer"], ["image"]):
        words = words[1:]
    if not words:
        return None
    return {"a": 1.0, "b": 0.0}.get(words[0])


def chat_url(base_url: str) -> str:
    """``{base_url}/v1/chat/completions``; a base URL that already ends in ``/v1`` (the
    OpenAI client's convention) is not given a second one."""
    base = base_url.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def png_data_url(image) -> str:
    """One (H, W, 3) uint8 image as a lossless base64 PNG data URL."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def reply_text(data: Any) -> str:
    """The assistant's text from a chat completions response body (string or content parts)."""
    content = data["choices"][0]["message"]["content"]
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise TypeError(f"message content is {type(content).__name__}, not text")
    return content


@dataclass(frozen=True)
class Outcome:
    value: float | None = None  # parsed score; None when unparsed or failed
    reply: str | None = None  # the judge's text, when one came back
    error: str | None = None  # why no reply came back (after retries)


@register_scorer("vlm_judge")
class VlmJudgeScorer:
    """Scores each image by asking a VLM about its prompt.

    Params: ``base_url`` and ``model`` (required), ``answer`` ("yesno" or "score"),
    ``template`` (a ``str.format`` string with ``{prompt}``; the default matches ``answer``),
    ``system`` (an optional system message), ``max_concurrency``, ``timeout`` (seconds for one
    whole request: connect, upload and the full reply), ``max_retries``, ``backoff`` (first
    retry delay, doubled each time, capped at ``max_backoff``), ``api_key_env`` (environment
    variable with a bearer token; unset is fine for a local server), ``max_tokens``,
    ``temperature``, ``extra_body`` (merged into each request, e.g. vLLM's ``{"top_k": 1}``),
    ``trust_env`` (httpx: honour proxy variables).
    If no sample gets a reply at all the scorer raises, so a dead server is reported as such.
    """

    needs = frozenset({"image"})

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        answer: str = "yesno",
        template: str | None = None,
        system: str | None = None,
        max_concurrency: int = 8,
        timeout: float = 60.0,
        max_retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        api_key_env: str | None = "OPENAI_API_KEY",
        max_tokens: int = 16,
        temperature: float = 0.0,
        extra_body: dict[str, Any] | None = None,
        trust_env: bool = True,
        name: str = "vlm_judge",
    ) -> None:
        check_choice("answer", answer, tuple(PARSERS))
        if not base_url or not model:
            raise ValueError(
                f"scorer {name!r} needs params.base_url (e.g. http://localhost:8000) and "
                f"params.model (the served model name), got {base_url!r} and {model!r}"
            )
        if max_concurrency < 1 or max_retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError(
                f"max_concurrency={max_concurrency} (>= 1), max_retries={max_retries} (>= 0), "
                f"timeout={timeout} (> 0), backoff={backoff} (>= 0)"
            )
        self.template = template or TEMPLATES[answer]
        try:
            self.template.format(prompt="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"template {self.template!r} must be a format string whose only field is "
                f"{{prompt}}: {e!r}"
            ) from None
        self.name = name
        self._url = chat_url(base_url)  # with credentials, if any: only requests see it
        self.url = redact_url(self._url)
        self.model = model
        self.answer = answer
        self.parse = PARSERS[answer]
        self.system = system
        self.max_concurrency = int(max_concurrency)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.api_key_env = api_key_env
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.extra_body = dict(extra_body or {})
        self.trust_env = trust_env

    def request_body(self, image_url: str | list[str], prompt: str) -> dict[str, Any]:
        """The chat request: the image(s), in order, then the question."""
        urls = [image_url] if isinstance(image_url, str) else image_url
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": u}} for u in urls
        ]
        content.append({"type": "text", "text": self.template.format(prompt=prompt)})
        messages.append({"role": "user", "content": content})
        return {
            **self.extra_body,
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def delay(self, attempt: int, retry_after: str | None) -> float:
        """Exponential back-off with a little jitter; a server's ``Retry-After`` (seconds)
        wins when it asks for longer. Capped at ``max_backoff``."""
        wait = self.backoff * 2**attempt * (1.0 + 0.1 * random.random())
        if retry_after is not None:
            with contextlib.suppress(ValueError):  # an HTTP-date: keep our own schedule
                wait = max(wait, float(retry_after))
        return min(wait, self.max_backoff)

    async def post(self, client, body: dict[str, Any]) -> tuple[int, Any, bytes, bool]:
        """One request: (status, headers, reply body up to MAX_REPLY_BYTES, whether cut)."""
        async with client.stream("POST", self._url, json=body) as r:
            data, cut = await read_capped(r, MAX_REPLY_BYTES)
            return r.status_code, r.headers, data, cut

    async def ask(self, client, sem: asyncio.Semaphore, body: dict[str, Any]) -> Outcome:
        import httpx

        error = "no attempt made"
        async with sem:
            for attempt in range(self.max_retries + 1):
                retry_after = None
                try:
                    status, headers, data, cut = await asyncio.wait_for(
                        self.post(client, body), self.timeout
                    )
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    error = f"timed out after {self.timeout:g}s"
                except httpx.TransportError as e:  # refused or dropped connections
                    error = scrub(f"{type(e).__name__}: {e}", self._url)
                else:
                    text = data[:200].decode(errors="replace")
                    if status == 429 or status >= 500:
                        error = f"HTTP {status}: {text}"
                        retry_after = headers.get("retry-after")
                    elif status >= 400:  # our request is wrong: retrying cannot help
                        return Outcome(error=f"HTTP {status}: {text}")
                    elif cut:
                        return Outcome(error=f"reply over {MAX_REPLY_BYTES} bytes, not read")
                    else:
                        try:
                            reply = reply_text(json.loads(data))
                        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
                            return Outcome(error=f"malformed response ({e!r}): {text}")
                        return Outcome(value=self.parse(reply), reply=reply)
                if attempt < self.max_retries:
                    await asyncio.sleep(self.delay(attempt, retry_after))
        return Outcome(error=f"{error} (after {self.max_retries + 1} attempts)")

    async def ask_all(self, bodies: list[dict[str, Any]]) -> list[Outcome]:
        """Every request, at most ``max_concurrency`` at a time, over one connection pool."""
        import httpx

        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency)
        async with httpx.AsyncClient(
            timeout=self.timeout, headers=self.headers(), limits=limits, trust_env=self.trust_env
        ) as client:
            return list(await asyncio.gather(*(self.ask(client, sem, b) for b in bodies)))

    async def score(self, traj: Trajectory) -> ScoreResult:
        urls = await image_urls(traj)
        bodies = [
            self.request_body(url, prompt)
            for url, prompt in zip(urls, traj.prompts.texts, strict=True)
        ]
        return self.result(await self.ask_all(bodies))

    def result(self, outcomes: list[Outcome]) -> ScoreResult:
        n = len(outcomes)
        failed = [o for o in outcomes if o.error is not None]
        if n and len(failed) == n:
            raise RuntimeError(f"VLM judge at {self.url}: no sample got a reply: {failed[0].error}")
        for o in failed[:3]:
            log.warning("VLM judge: a sample is marked missing: %s", o.error)
        unparsed = [o.reply for o in outcomes if o.error is None and o.value is None]
        if unparsed:
            log.warning(
                "VLM judge: %d replies did not parse as %s, marked missing; e.g. %r",
                len(unparsed),
                self.answer,
                unparsed[0][:100],
            )
        scores = torch.tensor(
            [float("nan") if o.value is None else o.value for o in outcomes], dtype=torch.float32
        )
        return ScoreResult(
            scores,
            torch.isfinite(scores),
            {"failed_frac": len(failed) / max(n, 1), "unparsed_frac": len(unparsed) / max(n, 1)},
        )


async def image_urls(traj: Trajectory) -> list[str]:
    """The trajectory's images as PNG data URLs (encoded off the event loop)."""
    images = traj.extra_fields["image"].cpu().numpy()  # (B, H, W, 3) uint8
    return await asyncio.to_thread(lambda: [png_data_url(img) for img in images])


@register_scorer("vlm_pairwise")
class VlmPairwiseScorer:
    """A group scorer: each image's win rate against the others of its group, as judged by a
    VLM asked "A or B?" about each pair. Params: those of ``vlm_judge`` but ``answer`` (the
    template, if given, has ``{prompt}`` and asks for A or B), plus ``both_orders`` (ask each
    pair twice, swapped; default True). A reply that does not parse, or a request that fails,
    is no game (the pair is not counted); an image with no game at all is missing. A group
    where no request got a reply raises: the pool fails the group (a dead server)."""

    needs = frozenset({"image"})
    groupwise = True

    def __init__(self, both_orders: bool = True, **params: Any) -> None:
        if "answer" in params:
            raise ValueError("vlm_pairwise takes no params.answer: its answer is A or B")
        params.setdefault("template", PAIRWISE_TEMPLATE)
        params.setdefault("name", "vlm_pairwise")
        # the single-image judge's transport (retries, time-outs, concurrency cap, redaction),
        # with its parser swapped for A-or-B
        self.judge = VlmJudgeScorer(**params)
        self.judge.parse, self.judge.answer = parse_choice, "A or B"
        self.name = self.judge.name
        self.both_orders = bool(both_orders)

    async def score_group(self, traj: Trajectory) -> ScoreResult:
        n = len(traj)
        if len(set(traj.prompts.texts)) != 1:
            raise ValueError(f"a group holds one prompt, got {sorted(set(traj.prompts.texts))}")
        urls = await image_urls(traj)
        prompt = traj.prompts.texts[0]
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
        if not self.both_orders:
            pairs = [(i, j) for i, j in pairs if i < j]
        bodies = [self.judge.request_body([urls[i], urls[j]], prompt) for i, j in pairs]
        outcomes = await self.judge.ask_all(bodies)
        failed = [o for o in outcomes if o.error is not None]
        if outcomes and len(failed) == len(outcomes):
            raise RuntimeError(
                f"VLM judge at {self.judge.url}: no pair got a reply: {failed[0].error}"
            )
        wins, games = torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, n, dtype=torch.float64)
        unparsed = 0
        for (i, j), o in zip(pairs, outcomes, strict=True):
            if o.value is None:
                unparsed += o.error is None
                continue
            wins[i, j] += o.value  # 1: the first (i) won
            wins[j, i] += 1.0 - o.value
            games[i, j] += 1
            games[j, i] += 1
        if unparsed:
            log.warning("VLM pairwise judge: %d replies were neither A nor B", unparsed)
        rates = win_rates(wins, games)
        judged = [o.value for o in outcomes if o.value is not None]
        asked = max(len(outcomes), 1)
        metrics = {
            "failed_frac": len(failed) / asked,
            "unparsed_frac": unparsed / asked,
            # the judge's leaning to the first image (0.5 = none; both_orders cancels it)
            "first_frac": sum(judged) / len(judged) if judged else float("nan"),
        }
        return ScoreResult(rates, torch.isfinite(rates), metrics)
