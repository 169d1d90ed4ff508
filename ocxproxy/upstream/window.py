"""Each backend's context window and token counts, asked of the backend itself
(CONTRACT.md C10).

The window: `--context-window` when set; else llama.cpp's `GET /props`
(`default_generation_settings.n_ctx`, a slot's share, or `n_ctx`), or vLLM's
`GET /v1/models` (`max_model_len`). Learned by the health probe (`--health-interval`),
off the request path, and kept; learned again after the backend has been down (a
restart may change it); a backend that said nothing is asked again after a minute.
Without probes, only `--context-window` gives a window.

Counting: llama.cpp renders the chat template (`POST /apply-template`) and tokenizes the
prompt (`POST /tokenize`); vLLM tokenizes the messages (`POST /tokenize`). Both from the
chat form of the request (upstream/chat.py), so the count includes the template's
tokens. Any failure is "unknown", never an error: the request then goes on, and the
backend's own answer decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ocxproxy.errors import InvalidRequest
from ocxproxy.metrics import Metrics
from ocxproxy.upstream.chat import to_chat
from ocxproxy.upstream.fleet import Backend
from ocxproxy.upstream.http1 import Http1Client, Http1Error

log = logging.getLogger("ocxproxy.upstream")

ASK_TIMEOUT = 5.0
RETRY_AFTER = 60.0  # a backend that told nothing is asked again after this
LLAMA = "llama"
VLLM = "vllm"


@dataclass(frozen=True, slots=True)
class Window:
    tokens: int | None  # None: unknown
    counter: str | None  # how the backend counts tokens: LLAMA, VLLM or None
    failures: int  # the backend's down count when this was learned
    at: float


class Windows:
    """The windows learned so far, by backend URL."""

    def __init__(
        self, http: Http1Client, metrics: Metrics, fixed: int, headers: Mapping[str, str]
    ) -> None:
        self.http = http
        self.metrics = metrics
        self.fixed = fixed
        self.headers = dict(headers)
        self.known: dict[str, Window] = {}

    def of(self, backend: Backend) -> Window | None:
        """The backend's window as known now (no I/O): learned, or `--context-window`."""
        known = self.known.get(backend.url)
        if known is not None and known.failures == backend.failures:
            return known
        if self.fixed:  # kept until the probe learns how the backend counts
            known = self.known[backend.url] = Window(self.fixed, None, backend.failures, 0.0)
            return known
        return None

    def stale(self, backend: Backend) -> bool:
        """Whether the health probe should learn the window (again): never learned, the
        backend has been down since, or it told nothing a while ago."""
        known = self.known.get(backend.url)
        return (
            known is None
            or known.at == 0.0  # --context-window's, not asked yet
            or known.failures != backend.failures
            or (known.tokens is None and time.monotonic() - known.at >= RETRY_AFTER)
        )

    async def learn(self, backend: Backend) -> Window:
        failures = backend.failures
        tokens, counter = None, None
        props = await self._get(backend.url, "/props")
        if isinstance(props, dict):
            settings = props.get("default_generation_settings")
            n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
            tokens = _positive(n_ctx) or _positive(props.get("n_ctx"))
            counter = LLAMA
        else:
            models = await self._get(backend.url, "/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            lengths = [_positive(m.get("max_model_len")) for m in data or () if isinstance(m, dict)]
            known_lengths = [n for n in lengths if n is not None]
            if known_lengths:
                tokens, counter = min(known_lengths), VLLM
        if self.fixed:
            tokens = self.fixed
        window = Window(tokens, counter, failures, time.monotonic())
        self.known[backend.url] = window
        if tokens is not None:
            self.metrics.context_window.labels(backend.url).set(tokens)
            log.info("backend %s: context window %d tokens", backend.url, tokens)
        return window

    async def count(self, backend: Backend, window: Window, body: dict[str, Any]) -> int | None:
        """The tokens of `body` (a Responses create body, expanded) as the backend's
        template renders them; None when it cannot tell."""
        if window.counter is None:
            return None
        try:
            chat = to_chat({k: body[k] for k in _COUNTED if k in body}).body
        except InvalidRequest:
            return None  # an item the chat form cannot carry: estimated instead
        self.metrics.token_counts.labels(backend.url).inc()
        if window.counter == VLLM:
            answer = await self._post(backend.url, "/tokenize", chat)
            count = answer.get("count") if isinstance(answer, dict) else None
            return count if isinstance(count, int) else None
        fields = {
            "messages": chat["messages"],
            **({"tools": chat["tools"]} if "tools" in chat else {}),
        }
        rendered = await self._post(backend.url, "/apply-template", fields)
        prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
        if not isinstance(prompt, str):
            return None
        answer = await self._post(
            backend.url,
            "/tokenize",
            {"content": prompt, "add_special": True, "parse_special": True},
        )
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return len(tokens) if isinstance(tokens, list) else None

    async def _get(self, url: str, path: str) -> Any:
        return await self._ask("GET", url, path, None)

    async def _post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        headers = {**self.headers, "Content-Type": "application/json"}
        return await self._ask("POST", url, path, orjson.dumps(body), headers)

    async def _ask(
        self, method: str, url: str, path: str, body: bytes | None, headers: Any = None
    ) -> Any:
        try:
            async with asyncio.timeout(ASK_TIMEOUT):
                response = await self.http.request(method, url, path, headers or self.headers, body)
                try:
                    data = await response.read()
                except BaseException:
                    response.close()
                    raise
                response.release()
        except (Http1Error, TimeoutError, OSError):
            return None
        if response.status != 200:
            return None
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return None


_COUNTED = ("model", "input", "instructions", "tools")


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and value > 0 else None
