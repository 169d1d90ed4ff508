"""What every handler reaches through the app (config, store, backends, metrics), the
caller's scope, and where a create call's answer goes (`Reply`)."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from ocxproxy.config import Config
from ocxproxy.continuation.compaction import Sealer
from ocxproxy.continuation.window import TokenBook
from ocxproxy.errors import Unauthorized
from ocxproxy.http.access_log import AccessLog
from ocxproxy.metrics import Metrics, Timing
from ocxproxy.store import Backgrounds, StoreInterface
from ocxproxy.upstream.kvsave import KvSaves
from ocxproxy.upstream.misses import CacheBook
from ocxproxy.upstream.pool import UpstreamPool
from ocxproxy.upstream.sse import Event

ANONYMOUS = "anonymous"
CUT_GRACE = 1.0  # seconds a request cut at shutdown has to write its closing error


@dataclass(slots=True)
class Stopping:
    """A graceful stop under way: requests in flight may run until `deadline` (loop time);
    then `cut` is set and what still runs is cancelled, and ends with ShuttingDown."""

    deadline: float
    cut: bool = False

    def left(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def expire(self) -> None:
        self.cut = True

    async def finish(self, tasks: Collection[asyncio.Task[Any]]) -> None:
        """Let `tasks` (requests in flight) finish by the deadline; then cut the rest."""
        if not tasks:
            return
        _, running = await asyncio.wait(tasks, timeout=self.left())
        if running:
            self.expire()
            for task in running:
                task.cancel()
            await asyncio.wait(running, timeout=CUT_GRACE)


@dataclass(slots=True)
class BackgroundRuns:
    """Background runs (http/background.py): at most `--max-background` at once
    (`slots`, None: no bound), and how many wait for one."""

    slots: asyncio.Semaphore | None
    waiting: int = 0
    # The create exchange of each queued or running one, by (scope, id): its input items.
    exchanges: dict[tuple[str, str], Any] = field(default_factory=dict)


@dataclass(slots=True)
class Proxy:
    config: Config
    store: StoreInterface
    pool: UpstreamPool
    metrics: Metrics
    ready: bool = False
    access_log: AccessLog | None = None  # --access-log off: None
    book: TokenBook = field(default_factory=TokenBook)  # tokens of recent turns (window)
    cache_book: CacheBook = field(default_factory=CacheBook)  # where turns left their prefix
    kv_saves: KvSaves | None = None  # warm resume's KV saves (llama.cpp backends')
    # The model names clients see (--served-model-name, or the embedded model's); ():
    # each backend's own.
    served_models: tuple[str, ...] = ()
    sealer: Sealer = field(default_factory=Sealer.ephemeral)  # compaction items' key
    stopping: Stopping | None = None  # set when a graceful stop begins
    handlers: set[asyncio.Task[Any]] = field(default_factory=set)  # aiohttp's, in flight
    backgrounds: Backgrounds = field(init=False)  # background responses' status and logs
    background_runs: BackgroundRuns = field(init=False)

    def stop(self) -> Stopping:
        """The graceful stop, begun now if it had not been: requests in flight have
        `--shutdown-timeout` to finish."""
        if self.stopping is None:
            loop = asyncio.get_running_loop()
            self.stopping = Stopping(loop.time() + self.config.shutdown_timeout)
            loop.call_at(self.stopping.deadline, self.stopping.expire)
        return self.stopping

    @property
    def lease_duration(self) -> float:
        """How long a conversation's lock or an in-flight Idempotency-Key outlasts its
        holder's last progress: a live holder renews it with every chunk from the
        backend, so one silent for longer than the backend's read timeout is failing
        anyway."""
        return self.config.read_timeout

    def cut_by_shutdown(self) -> bool:
        """Whether a cancellation now is the graceful stop's deadline (not a client leaving)."""
        return self.stopping is not None and self.stopping.cut

    def __post_init__(self) -> None:
        self.served_models = self.served_models or self.config.served_model_name
        config = self.config
        self.backgrounds = self.store.backgrounds(config)
        limit = config.max_background
        self.background_runs = BackgroundRuns(asyncio.Semaphore(limit) if limit else None)


PROXY = web.AppKey("proxy", Proxy)
V1 = "/v1"
# The canonical paths of the proxy's own routes as served without /v1 (server.py).
UNPREFIXED: web.AppKey[frozenset[str]] = web.AppKey("unprefixed", frozenset)
TIMING_KEY = web.RequestKey("timing", Timing)


def proxy_of(request: web.Request) -> Proxy:
    return request.app[PROXY]


def timing_of(request: web.Request) -> Timing:
    return request[TIMING_KEY]


def unprefixed(request: web.Request) -> bool:
    """The request came to one of the proxy's own routes without `/v1` (a client whose
    base URL lacks it)."""
    resource = request.match_info.route.resource
    return resource is not None and resource.canonical in request.app.get(UNPREFIXED, ())


def upstream_path(request: web.Request) -> str:
    """The path and query the backend gets: under `/v1` whatever the client's base URL."""
    return V1 + request.path_qs if unprefixed(request) else request.path_qs


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
    # Interned: what 100,000s of turns remember it in (records, the cache book) share one.
    return sys.intern(hashlib.sha256(token.encode()).hexdigest()[:32])


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

    async def write_events(self, events: list[Event]) -> None:
        """A batch of relayed events: their bytes as one piece, not joined first where the
        transport takes them as parts (a background run's Reply reads the events)."""

    async def end(self) -> None: ...
