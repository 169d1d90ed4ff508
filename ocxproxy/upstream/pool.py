"""The backend pool's I/O: keep-alive connections, requests, health probes.

`open()` is the only way to talk to a backend; every connection or timeout error that
escapes it is an UpstreamError. The choice of backend, health state and admission are
upstream/fleet.py's (the Fleet); this module sends, probes and tells the Fleet what it saw.
A request is sent again only when no byte of it reached a backend (a refused connect, a
connection closed before sending), or when it is safe to repeat (RFC 9110 §9.2.2): an
idempotent method, or a POST with an `Idempotency-Key`, which goes to another backend. A
POST the backend read and then dropped is never sent again: the generation may be costly,
or may be what crashed the backend. A response head ends all retrying, so a client never
sees two answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias, cast

from ocxproxy.config import Config
from ocxproxy.errors import UpstreamError
from ocxproxy.metrics import Metrics, Timing
from ocxproxy.upstream.dialect import Translator, UpstreamResponse
from ocxproxy.upstream.fleet import Backend, Choice, Fleet, Placement, Routing
from ocxproxy.upstream.http1 import (
    ConnectFailed,
    Disconnected,
    Http1Client,
    Http1Error,
    Http1Response,
    Unsent,
)
from ocxproxy.upstream.window import Window, Windows

log = logging.getLogger("ocxproxy.upstream")

__all__ = ["Backend", "BackendRequest", "UpstreamPool", "read_chunk"]

PROBE_TIMEOUT = 5.0  # seconds; a health path that takes longer counts as down
MODELS_PATH = "/v1/models"  # the probe's second proof when the health path is a 404
# Awaited with the backend chosen for a request, before it is sent: a body to send instead.
Prepare: TypeAlias = Callable[[Backend], Awaitable[bytes | None]]
IDEMPOTENT = frozenset(("GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"))  # RFC 9110 §9.2.2


async def read_chunk(response: UpstreamResponse) -> bytes:
    """The next chunk of a backend's body, b"" at its end. A backend that breaks off or
    goes silent mid-body is an UpstreamError."""
    try:
        return await response.content.readany()
    except (TimeoutError, Http1Error) as exc:
        raise _mid_body(exc) from None


def _mid_body(exc: BaseException) -> UpstreamError:
    """A backend that went silent or broke off after its status line, as the client sees it."""
    if isinstance(exc, TimeoutError):
        return UpstreamError(
            "The backend went silent mid-response.", code="upstream_timeout", status=504
        )
    return UpstreamError("The backend broke off its response.")


class UpstreamPool:
    """The backends behind keep-alive connections: sends requests, probes health.

    Which backend serves a request, and whether it may be sent at all, is the Fleet's
    decision (upstream/fleet.py); this class does the I/O and maps its errors.
    """

    def __init__(self, urls: tuple[str, ...], config: Config, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.fleet = Fleet(
            urls,
            metrics,
            routing=Routing(config.routing),
            max_concurrency=config.max_concurrency,
            max_per_backend=config.max_concurrency_per_backend,
            admission_timeout=config.admission_timeout,
        )
        for backend in self.fleet.backends:
            backend.dialect = config.dialect_of(backend.url)
        self.http = Http1Client(
            connect_timeout=config.connect_timeout, read_timeout=config.read_timeout
        )
        auth = {"Authorization": f"Bearer {config.upstream_api_key}"}
        self.windows = Windows(
            self.http, metrics, config.context_window, auth if config.upstream_api_key else {}
        )

    def __repr__(self) -> str:
        return f"<UpstreamPool {self.fleet!r}>"

    @property
    def backends(self) -> list[Backend]:
        return self.fleet.backends

    def add(self, url: str) -> Backend:
        backend = self.fleet.add(url)
        backend.dialect = self.config.dialect_of(url)
        return backend

    async def close(self) -> None:
        self.http.close()

    def is_ready(self) -> bool:
        return self.fleet.is_ready(time.monotonic())

    def window_for(self, preferred: str | None) -> tuple[Backend, Window] | None:
        """The context window a request must fit: its chain's backend's, else the smallest
        of the backends' (upstream/window.py); None when none is known."""
        backends = self.fleet.backends
        if len(backends) == 1:
            window = self.windows.of(backends[0])
            return None if window is None or window.tokens is None else (backends[0], window)
        candidates = [b for b in backends if b.url == preferred] or backends
        best: tuple[Backend, Window] | None = None
        for backend in candidates:
            window = self.windows.of(backend)
            tokens = window.tokens if window is not None else None
            if tokens is not None and (best is None or tokens < cast(int, best[1].tokens)):
                best = backend, cast(Window, window)
        return best

    # -- active health -------------------------------------------------------------------

    async def watch(self, interval: float) -> None:
        """Probe every backend's health path every `interval` seconds, until cancelled.
        While this runs, only a probe brings a down backend back."""
        self.fleet.probing = True
        try:
            while True:
                await self.probe()
                await asyncio.sleep(interval)
        finally:
            self.fleet.probing = False

    async def probe(self) -> None:
        """One round: GET the health path of every backend; 2xx-4xx is up, but a 404 only
        when `GET /v1/models` answers 200 (a server without a health path, e.g. Ollama's):
        a URL that is not a backend's base answers 404 to everything."""
        await asyncio.gather(*(self._probe(b) for b in list(self.fleet.backends)))

    async def _probe(self, backend: Backend) -> None:
        try:
            status = await self._get_status(backend, self.config.health_path)
            if status == 404:
                models = await self._get_status(backend, MODELS_PATH)
                if models != 200:
                    self.fleet.mark_down(
                        backend,
                        f"health probe answered 404, and {MODELS_PATH} {models}: "
                        "is the upstream URL the backend's base URL?",
                    )
                    return
        except (Http1Error, TimeoutError) as exc:
            self.fleet.mark_down(backend, f"health probe failed: {type(exc).__name__}")
            return
        if status < 500:
            self.fleet.mark_up(backend)
            if self.windows.stale(backend):
                await self.windows.learn(backend)
        else:
            self.fleet.mark_down(backend, f"health probe answered {status}")

    async def _get_status(self, backend: Backend, path: str) -> int:
        headers = {}
        if self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        async with asyncio.timeout(min(self.config.connect_timeout, PROBE_TIMEOUT)):
            response = await self.http.request("GET", backend.url, path, headers, None)
        response.close()
        return response.status

    # -- requests ------------------------------------------------------------------------

    def open(
        self,
        method: str,
        path_qs: str,
        headers: Mapping[str, str],
        data: Any,
        *,
        timing: Timing,
        affinity_key: str | None = None,
        preferred: str | None = None,
        retry: bool = True,
        prepare: Prepare | None = None,
    ) -> BackendRequest:
        """`async with pool.open(...) as (backend, response)`: send the request; the
        backend and its response with headers read.

        The backend is the Fleet's choice (affinity key, then `preferred`, the backend that
        served the chain). With `retry`, a request that got no answer is sent again when
        that is safe (the module's docstring says when); once the headers are in, it is
        never sent again, so a client never sees two answers. `prepare`: awaited with
        each backend chosen, before the request goes to it; the body it returns, if
        any, is sent instead (warm resume restores a chain's KV state there first).
        """
        translator = Translator(method, path_qs, data)
        return BackendRequest(
            self, method, headers, translator, timing, affinity_key, preferred, retry, prepare
        )

    async def dial(self, request: BackendRequest) -> tuple[Backend, Http1Response, float]:
        """Send `request` until a backend answers; its slot stays reserved."""
        fleet, metrics, timing = self.fleet, self.metrics, request.timing
        tried: set[str] = set()  # backends that failed this request
        redialed: set[str] = set()  # backends that dropped a connection once already
        first: Choice | None = None
        last_error: UpstreamError | None = None
        preferred = request.preferred
        while True:
            try:
                with timing.waiting():  # waiting for a slot is waiting on the backends
                    choice = await fleet.admit(request.affinity_key, preferred, exclude=tried)
            except UpstreamError:
                if last_error is not None:
                    raise last_error from None
                raise
            backend = choice.backend
            timing.backend = backend.url
            first = first or choice
            start = time.perf_counter()
            answered = False
            try:
                if request.prepare is not None:
                    data = await request.prepare(backend)
                    if data is not None:
                        request.translator = Translator(
                            request.method, request.translator.path_qs, data
                        )
                # A chat backend gets the request translated (InvalidRequest: unsent).
                path, body = request.translator.request(backend.dialect)
                try:
                    with timing.waiting():
                        response = await self.http.request(
                            request.method, backend.url, path, request.headers, body
                        )
                except ConnectFailed as exc:
                    fleet.mark_down(backend, str(exc))
                    metrics.upstream_requests.labels(backend.url, "connect_error").inc()
                    last_error = UpstreamError(
                        f"The backend at {backend.url} is unreachable.",
                        code="upstream_unreachable",
                    )
                    tried.add(backend.url)
                    if request.retry:
                        continue
                    raise last_error from None
                except (Unsent, Disconnected) as exc:
                    metrics.upstream_requests.labels(backend.url, "disconnected").inc()
                    if isinstance(exc, Unsent) or request.method in IDEMPOTENT:
                        # Often a keep-alive connection the backend had just closed: one
                        # more try on the same backend, then it counts as down.
                        last_error = UpstreamError(
                            f"The backend at {backend.url} dropped the connection.",
                            code="upstream_unreachable",
                        )
                        if backend.url in redialed:
                            fleet.mark_down(backend, f"dropped connections: {type(exc).__name__}")
                            tried.add(backend.url)
                        else:
                            redialed.add(backend.url)
                            preferred = backend.url
                    else:
                        last_error = UpstreamError(
                            f"The backend at {backend.url} closed the connection after "
                            "receiving the request, before answering. The request was not "
                            "sent again: the backend may have acted on it.",
                            code="upstream_disconnected",
                        )
                        if not request.idempotency_key:
                            raise last_error from None
                        tried.add(backend.url)  # safe to repeat, but not where it broke
                    if request.retry:
                        continue
                    raise last_error from None
                except TimeoutError:  # a long prompt may cause it: passive evidence
                    fleet.eject(backend, "no answer within the read timeout")
                    metrics.upstream_requests.labels(backend.url, "timeout").inc()
                    raise UpstreamError(
                        "The backend did not answer in time.",
                        code="upstream_timeout",
                        status=504,
                    ) from None
                except Http1Error as exc:
                    metrics.upstream_requests.labels(backend.url, "error").inc()
                    raise UpstreamError(
                        f"The backend request failed: {type(exc).__name__}."
                    ) from None
                metrics.upstream_ttfb.labels(backend.url).observe(time.perf_counter() - start)
                fleet.observe_status(backend, response.status, body=body)
                metrics.upstream_requests.labels(backend.url, f"{response.status // 100}xx").inc()
                placement = first.placement
                if placement is not None:
                    if backend is not first.backend:
                        placement = Placement.REROUTE
                    metrics.affinity.labels(result=str(placement)).inc()
                answered = True
                return backend, response, start
            finally:
                if not answered:
                    fleet.release(backend)


class BackendRequest:
    """One backend request as an async context manager (a class, not a generator: it
    runs on every turn). Entering sends it (UpstreamPool.dial); leaving maps what went
    wrong reading the answer to UpstreamError, keeps the connection if the body was read
    to its end or else closes it (which cancels the backend's work), and frees the slot."""

    __slots__ = (
        "_backend",
        "_response",
        "_start",
        "affinity_key",
        "headers",
        "idempotency_key",
        "method",
        "pool",
        "preferred",
        "prepare",
        "retry",
        "timing",
        "translator",
    )

    def __init__(
        self,
        pool: UpstreamPool,
        method: str,
        headers: Mapping[str, str],
        translator: Translator,
        timing: Timing,
        affinity_key: str | None,
        preferred: str | None,
        retry: bool,
        prepare: Prepare | None = None,
    ) -> None:
        self.pool = pool
        self.method = method
        self.headers = headers
        self.translator = translator
        self.timing = timing
        self.affinity_key = affinity_key
        self.preferred = preferred
        self.retry = retry
        self.prepare = prepare
        self.idempotency_key = headers.get("Idempotency-Key") is not None

    async def __aenter__(self) -> tuple[Backend, UpstreamResponse]:
        backend, response, self._start = await self.pool.dial(self)
        self._backend, self._response = backend, response
        return backend, self.translator.response(backend.dialect, response)

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        backend, response = self._backend, self._response
        try:
            if response.content.at_eof():
                response.release()
            else:
                response.close()
            self.pool.metrics.upstream_latency.labels(backend.url).observe(
                time.perf_counter() - self._start
            )
        finally:
            self.pool.fleet.release(backend)
        if isinstance(exc, TimeoutError | Http1Error):
            raise _mid_body(exc) from None
