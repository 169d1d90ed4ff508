"""What every handler reaches through the app (config, store, backends, metrics), the
caller's scope, and where a create call's answer goes (`Reply`)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict

from ocxproxy.config import Config
from ocxproxy.continuation.compaction import Sealer
from ocxproxy.continuation.locks import InFlight, Leases
from ocxproxy.errors import Unauthorized
from ocxproxy.http.access_log import AccessLog
from ocxproxy.metrics import Metrics, Timing
from ocxproxy.store import Store
from ocxproxy.upstream.pool import UpstreamPool

ANONYMOUS = "anonymous"


@dataclass(slots=True)
class Proxy:
    config: Config
    store: Store
    pool: UpstreamPool
    metrics: Metrics
    ready: bool = False
    access_log: AccessLog | None = None  # --access-log off: None
    leases: Leases = field(init=False)  # one writer per conversation (process memory)
    in_flight: InFlight = field(default_factory=InFlight)  # running Idempotency-Keys
    sealer: Sealer = field(default_factory=Sealer.ephemeral)  # compaction items' key

    def __post_init__(self) -> None:
        # A live holder renews its lease with every chunk from the backend, so a holder
        # silent for longer than the backend's read timeout is failing anyway.
        self.leases = Leases(self.config.read_timeout)


PROXY = web.AppKey("proxy", Proxy)
TIMING_KEY = web.RequestKey("timing", Timing)


def proxy_of(request: web.Request) -> Proxy:
    return request.app[PROXY]


def timing_of(request: web.Request) -> Timing:
    return request[TIMING_KEY]


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization", "")
    if value[:7].lower() == "bearer " and value[7:].strip():
        return value[7:].strip()
    return None


def scope_of(headers: Mapping[str, str]) -> str:
    """A stored turn belongs to a hash of the caller's bearer token, never the token
    (CONTRACT.md C5)."""
    token = bearer_token(headers)
    if token is None:
        return ANONYMOUS
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def check_client_key(headers: Mapping[str, str], keys: tuple[str, ...]) -> None:
    if keys and bearer_token(headers) not in keys:
        raise Unauthorized("Incorrect API key provided.")


class Reply(Protocol):
    """Where a create call's answer goes: an aiohttp response (WebReply), or the front
    end's own connection (http/front.py)."""

    def answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        """The whole answer at once. Synchronous on purpose: create() remembers the turn
        right after, before anything else can run."""

    async def start(self, status: int, headers: CIMultiDict[str]) -> None:
        """The head of a streamed answer."""

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...
