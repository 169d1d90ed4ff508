"""The backend pool: one keep-alive session, backend choice by affinity, passive health.

`open()` is the only way to talk to a backend; every aiohttp or timeout error that
escapes it is an UpstreamError. A request is tried on another backend only when the
failure happened before anything was sent back (connect errors).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ocxproxy.config import Config
from ocxproxy.errors import UpstreamError
from ocxproxy.metrics import Metrics

log = logging.getLogger("ocxproxy.upstream")

_BACKOFF_START = 1.0
_BACKOFF_MAX = 30.0


@dataclass(slots=True)
class Backend:
    url: str  # server root, no trailing slash, no /v1
    healthy: bool = True
    in_flight: int = 0
    down_until: float = 0.0
    backoff: float = _BACKOFF_START
    failures: int = field(default=0)

    def is_available(self, now: float) -> bool:
        return self.healthy or now >= self.down_until

    def mark_down(self, now: float) -> None:
        self.healthy = False
        self.failures += 1
        self.down_until = now + self.backoff
        self.backoff = min(self.backoff * 2, _BACKOFF_MAX)

    def mark_up(self) -> None:
        self.healthy = True
        self.backoff = _BACKOFF_START


@dataclass(slots=True)
class Timing:
    """Where a request's time went; the handler subtracts it from its own wall time."""

    upstream: float = 0.0  # seconds spent waiting on the backend

    @contextlib.contextmanager
    def waiting(self) -> Any:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.upstream += time.perf_counter() - start


class UpstreamPool:
    def __init__(self, urls: tuple[str, ...], config: Config, metrics: Metrics) -> None:
        self.backends = [Backend(url) for url in urls]
        self.config = config
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{b.url} {'up' if b.healthy else 'down'} {b.in_flight} in flight"
            for b in self.backends
        )
        return f"<UpstreamPool {parts}>"

    def add(self, url: str) -> None:
        if all(b.url != url for b in self.backends):
            self.backends.append(Backend(url))

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.config.connect_timeout,
                    sock_read=self.config.read_timeout,
                ),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def is_ready(self) -> bool:
        now = time.monotonic()
        return any(b.is_available(now) for b in self.backends)

    def candidates(self, affinity_key: str | None, preferred: str | None) -> list[Backend]:
        """Backends in the order to try: the chain's own first, then by rendezvous hash."""
        now = time.monotonic()
        available = [b for b in self.backends if b.is_available(now)] or list(self.backends)
        if affinity_key is None:
            ranked = sorted(available, key=lambda b: b.in_flight)
        else:
            ranked = sorted(available, key=lambda b: _rendezvous(affinity_key, b.url))
        if preferred is not None:
            ranked.sort(key=lambda b: b.url != preferred)
        return ranked

    @contextlib.asynccontextmanager
    async def open(
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
    ) -> AsyncIterator[tuple[Backend, aiohttp.ClientResponse]]:
        """Send the request; yield the backend and its response with headers read."""
        candidates = self.candidates(affinity_key, preferred)
        if not retry:
            candidates = candidates[:1]
        last_error = UpstreamError("No backend is configured.", code="upstream_unreachable")
        for backend in candidates:
            start = time.perf_counter()
            backend.in_flight += 1
            gauge = self.metrics.upstream_in_flight.labels(backend=backend.url)
            gauge.inc()
            try:
                try:
                    with timing.waiting():
                        response = await self.session.request(
                            method,
                            backend.url + path_qs,
                            headers=headers,
                            data=data,
                            allow_redirects=False,
                        )
                except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                    backend.mark_down(time.monotonic())
                    self.metrics.upstream_requests.labels(backend.url, "connect_error").inc()
                    log.warning("backend %s unreachable: %s", backend.url, type(exc).__name__)
                    last_error = UpstreamError(
                        f"The backend at {backend.url} is unreachable.",
                        code="upstream_unreachable",
                    )
                    continue
                except TimeoutError:
                    self.metrics.upstream_requests.labels(backend.url, "timeout").inc()
                    raise UpstreamError(
                        "The backend did not answer in time.",
                        code="upstream_timeout",
                        status=504,
                    ) from None
                except aiohttp.ClientError as exc:
                    self.metrics.upstream_requests.labels(backend.url, "error").inc()
                    raise UpstreamError(
                        f"The backend request failed: {type(exc).__name__}."
                    ) from None
                self.metrics.upstream_ttfb.labels(backend.url).observe(time.perf_counter() - start)
                if response.status < 500:
                    backend.mark_up()
                outcome = str(response.status // 100) + "xx"
                self.metrics.upstream_requests.labels(backend.url, outcome).inc()
                try:
                    yield backend, response
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
                    raise UpstreamError(
                        f"The backend broke off its response: {type(exc).__name__}."
                    ) from None
                except TimeoutError:
                    raise UpstreamError(
                        "The backend went silent mid-response.",
                        code="upstream_timeout",
                        status=504,
                    ) from None
                finally:
                    # A body read to its end returns the connection to the pool; anything
                    # else (client gone, error) closes it, which cancels the backend's work.
                    if response.content.at_eof():
                        response.release()
                    else:
                        response.close()
                    self.metrics.upstream_latency.labels(backend.url).observe(
                        time.perf_counter() - start
                    )
                return
            finally:
                backend.in_flight -= 1
                gauge.dec()
        raise last_error


def _rendezvous(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
