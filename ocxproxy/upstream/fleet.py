"""Which backend serves a request: health state, cache affinity and admission (CONTRACT.md C6).

Decisions only. `Fleet.choose` is synchronous and does no I/O, so a choice and the slot it
reserves happen with no `await` in between; `Fleet.admit` adds the one bounded wait for a
free slot. Sending requests and probing health paths is upstream/pool.py's job: this
module never opens a socket.

Routing (affinity mode). A request carries an affinity key (continuation/affinity.py says
what a key means; here keys are only compared) and, for a continuation, the backend that
served its parent. Its *home* is that backend, else the backend its key was
last sent to. It goes home while home is up and has room ("hit"). A key seen for the first
time goes to the least-loaded backend, ties broken by rendezvous hash of the key ("new"),
and its home is remembered. A request whose home is down, or still full after the
admission wait, goes to the least-loaded other backend and takes its key along
("reroute"): a chain moves once and then sticks to its new backend.

Health. Two kinds of evidence, as Envoy's outlier detection has them. A refused
connection (or a failed probe) says the backend is not there: it is marked down. An
answer says less: a read timeout or three 5xx answers in a row may be the requests' doing
(a prompt too long to finish in time, an input the backend cannot take), so on that
passive evidence a backend is *ejected* only while at most half the fleet is (never the
last one up), and a 5xx to a request whose same body already got a 5xx counts against
the request, not the backend (its earlier count is taken back). When every backend is out
all the same, the ejected ones keep taking requests (panic routing) while the active
probe decides. While active probes run, only a probe brings a backend back; without them
a request is let through again after a backoff (1 s, doubling up to 30 s).

Admission. At most `max_concurrency` backend requests in flight overall and
`max_per_backend` on one backend (0: no bound). A request past a bound waits up to
`admission_timeout` for a slot, behind at most as many others as the overall bound allows,
then gets RateLimited (429). Never an unbounded queue.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ocxproxy.errors import RateLimited, UpstreamError
from ocxproxy.metrics import Metrics

log = logging.getLogger("ocxproxy.upstream")

BACKOFF_START = 1.0
BACKOFF_MAX = 30.0
ERRORS_BEFORE_DOWN = 3  # 5xx answers in a row that eject a backend
PASSIVE_SHARE = 0.5  # the most of the fleet that passive evidence may eject
FAULTS_KEPT = 256  # bodies that got a 5xx lately, to tell a bad request from a bad backend
MAX_KEYS = 65536  # remembered key → backend homes (least recently used forgotten first)
MAX_WAITING = 1024  # admission waiters when there is no overall bound


class Routing(enum.StrEnum):
    AFFINITY = "affinity"
    ROUND_ROBIN = "round-robin"  # ignores affinity; for comparison and benchmarks


class Placement(enum.StrEnum):
    """Where a keyed request went relative to its home; the `result` metric label."""

    HIT = "hit"  # its home backend
    NEW = "new"  # no home yet: placed by load
    REROUTE = "reroute"  # home down or full: moved


class Refusal(enum.StrEnum):
    """Why no backend can take a request right now."""

    DOWN = "down"  # no backend is up
    TOTAL = "total"  # the overall concurrency bound is reached
    BACKEND = "backend"  # the backends it may use are at their own bound


@dataclass(slots=True)
class Backend:
    """One backend's live state; only the Fleet changes it."""

    url: str  # server root, no trailing slash, no /v1
    dialect: str = "responses"  # the API it speaks: responses, or chat (upstream/dialect.py)
    healthy: bool = True
    in_flight: int = 0
    retry_at: float = 0.0  # without probes: when a request may test a down backend again
    backoff: float = BACKOFF_START
    failures: int = 0  # times it went down
    errors_in_row: int = 0  # consecutive 5xx answers
    ejected: bool = False  # down on passive evidence only (panic routing may still use it)
    restarts: int = 0  # times its process was started again (the embedded backend's watchdog)

    @property
    def epoch(self) -> int:
        """Changes whenever the backend may have lost its cache: it was down, or restarted."""
        return self.failures + self.restarts

    def is_available(self, now: float, *, probing: bool) -> bool:
        return self.healthy or (not probing and now >= self.retry_at)


@dataclass(frozen=True, slots=True)
class Choice:
    backend: Backend
    placement: Placement | None  # None: the request had no key and no home


@dataclass(frozen=True, slots=True)
class FleetStats:
    backends: int
    up: int
    in_flight: int
    waiting: int
    keys: int  # remembered key homes


class Fleet:
    """The backends, their health, the key → home table and the admission bounds."""

    def __init__(
        self,
        urls: tuple[str, ...],
        metrics: Metrics,
        *,
        routing: Routing = Routing.AFFINITY,
        max_concurrency: int = 0,
        max_per_backend: int = 0,
        admission_timeout: float = 1.0,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.metrics = metrics
        self.routing = routing
        self.max_concurrency = max_concurrency
        self.max_per_backend = max_per_backend
        self.admission_timeout = admission_timeout
        self.max_keys = max_keys
        self.probing = False  # set while the active health probe runs
        self.backends: list[Backend] = []
        self.in_flight = 0
        self._by_url: dict[str, Backend] = {}
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._turn = 0  # round-robin position
        self._waiting = 0  # requests waiting for a slot (on _released)
        self._watching = 0  # wait_for() callers (on _changed)
        self._released = asyncio.Event()  # a slot freed or a backend came back
        # A digest of each request body that got a 5xx lately → the backend that gave it.
        self._faults: OrderedDict[bytes, str] = OrderedDict()
        for limit in (Refusal.TOTAL, Refusal.BACKEND):  # exported at 0 from the start
            metrics.admission_rejected.labels(limit=str(limit))
        self._changed = asyncio.Event()  # any change of load or health
        for url in urls:
            self.add(url)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{b.url} {'up' if b.healthy else 'down'} {b.in_flight} in flight"
            for b in self.backends
        )
        return f"<Fleet {self.routing} [{parts}] waiting={self._waiting} keys={len(self._homes)}>"

    def stats(self) -> FleetStats:
        return FleetStats(
            backends=len(self.backends),
            up=sum(b.healthy for b in self.backends),
            in_flight=self.in_flight,
            waiting=self._waiting,
            keys=len(self._homes),
        )

    def add(self, url: str) -> Backend:
        backend = self._by_url.get(url)
        if backend is None:
            backend = self._by_url[url] = Backend(url)
            self.backends.append(backend)
            self.metrics.backend_up.labels(backend=url).set(1)
        return backend

    def is_ready(self, now: float) -> bool:
        return any(b.is_available(now, probing=self.probing) for b in self.backends)

    async def wait_for(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        """Wait until `predicate()` holds, re-checked on every change of load or health,
        e.g. `lambda: not fleet.backends[0].healthy`. TimeoutError after `within` s."""
        self._watching += 1
        try:
            async with asyncio.timeout(within):
                while not predicate():
                    await self._changed.wait()
        finally:
            self._watching -= 1

    # -- choice --------------------------------------------------------------------------

    def choose(
        self,
        key: str | None,
        preferred: str | None,
        now: float,
        *,
        exclude: frozenset[str] | set[str] = frozenset(),
        spill: bool = False,
    ) -> Choice | Refusal:
        """The backend for a request, or why there is none. `spill`: a full home may be
        left for another backend (after the admission wait)."""
        usable = [
            b
            for b in self.backends
            if b.url not in exclude and b.is_available(now, probing=self.probing)
        ]
        if not usable:  # panic: passive evidence alone never takes the whole fleet out
            usable = [b for b in self.backends if b.ejected and b.url not in exclude]
        if not usable:
            return Refusal.DOWN
        if self.max_concurrency and self.in_flight >= self.max_concurrency:
            return Refusal.TOTAL
        roomy = [b for b in usable if self._has_room(b)]
        if self.routing is Routing.ROUND_ROBIN:
            if not roomy:
                return Refusal.BACKEND
            self._turn += 1
            return Choice(roomy[self._turn % len(roomy)], None)
        home = self._home(key, preferred)
        if home is not None and home in usable:
            if home in roomy:
                self._remember(key, home)
                return Choice(home, Placement.HIT)
            if not spill:
                return Refusal.BACKEND
        if not roomy:
            return Refusal.BACKEND
        salt = key or ""
        backend = min(roomy, key=lambda b: (b.in_flight, _rendezvous(salt, b.url)))
        self._remember(key, backend)
        if key is None and preferred is None:
            return Choice(backend, None)
        return Choice(backend, Placement.NEW if home is None else Placement.REROUTE)

    def _has_room(self, backend: Backend) -> bool:
        return not self.max_per_backend or backend.in_flight < self.max_per_backend

    def _home(self, key: str | None, preferred: str | None) -> Backend | None:
        if preferred is not None and preferred in self._by_url:
            return self._by_url[preferred]
        if key is not None:
            url = self._homes.get(key)
            if url is not None:
                return self._by_url.get(url)
        return None

    def _remember(self, key: str | None, backend: Backend) -> None:
        if key is None:
            return
        self._homes[key] = backend.url
        self._homes.move_to_end(key)
        while len(self._homes) > self.max_keys:
            self._homes.popitem(last=False)

    # -- admission -----------------------------------------------------------------------

    async def admit(
        self,
        key: str | None,
        preferred: str | None,
        *,
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> Choice:
        """Choose a backend and reserve a slot on it; the caller must `release()` it.

        Raises UpstreamError (503) at once when no backend is up, and RateLimited when
        no slot frees up within the admission timeout.
        """
        deadline: float | None = None
        spill = False
        while True:
            now = time.monotonic()
            choice = self.choose(key, preferred, now, exclude=exclude, spill=spill)
            if isinstance(choice, Choice):
                self._reserve(choice.backend)
                return choice
            if choice is Refusal.DOWN:
                raise UpstreamError(
                    "No backend is available.", code="no_backend_available", status=503
                )
            if deadline is None:
                bound = self.max_concurrency or MAX_WAITING
                deadline = now + (self.admission_timeout if self._waiting < bound else 0.0)
            if now >= deadline:
                if not spill:  # last chance: any backend with room, even away from home
                    spill = True
                    continue
                self.metrics.admission_rejected.labels(limit=str(choice)).inc()
                raise RateLimited(
                    "Too many requests in flight to the backends; retry shortly.",
                    code="rate_limit_exceeded",
                )
            await self._wait_release(deadline - now)

    async def _wait_release(self, seconds: float) -> None:
        self._waiting += 1
        try:
            async with asyncio.timeout(seconds):
                await self._released.wait()
        except TimeoutError:
            pass
        finally:
            self._waiting -= 1

    def _reserve(self, backend: Backend) -> None:
        backend.in_flight += 1
        self.in_flight += 1
        self.metrics.upstream_in_flight.labels(backend=backend.url).inc()
        self._bump(freed=False)

    def release(self, backend: Backend) -> None:
        backend.in_flight -= 1
        self.in_flight -= 1
        self.metrics.upstream_in_flight.labels(backend=backend.url).dec()
        self._bump(freed=True)

    def _bump(self, *, freed: bool) -> None:
        """Wake who waits on a change (a fresh Event only when someone does: this runs
        twice per request)."""
        if self._watching:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()
        if freed and self._waiting:
            released, self._released = self._released, asyncio.Event()
            released.set()

    # -- health --------------------------------------------------------------------------

    def mark_down(self, backend: Backend, why: str, now: float | None = None) -> None:
        """Down on evidence that the backend is not there (a refused connection, a failed
        probe)."""
        now = time.monotonic() if now is None else now
        backend.ejected = False
        if backend.healthy:
            backend.failures += 1
            log.warning("backend %s is down: %s", backend.url, why)
            self.metrics.backend_up.labels(backend=backend.url).set(0)
            self._bump(freed=False)
        backend.healthy = False
        backend.errors_in_row = 0
        backend.retry_at = now + backend.backoff
        backend.backoff = min(backend.backoff * 2, BACKOFF_MAX)

    def eject(self, backend: Backend, why: str, now: float | None = None) -> bool:
        """Down on passive evidence (timeouts, 5xx), unless that would take out more than
        PASSIVE_SHARE of the fleet or its last backend up; whether it is out."""
        if not backend.healthy:  # let through on trial, and failed again: longer backoff
            self.mark_down(backend, why, now)
            backend.ejected = True
            return True
        out = sum(b.ejected for b in self.backends)
        up = sum(b.healthy for b in self.backends)
        if up <= 1 or out + 1 > int(len(self.backends) * PASSIVE_SHARE):
            log.warning("backend %s kept in despite %s: too few would be left", backend.url, why)
            self.metrics.backend_ejections.labels(backend=backend.url, outcome="kept").inc()
            backend.errors_in_row = 0
            return False
        self.mark_down(backend, why, now)
        backend.ejected = True
        self.metrics.backend_ejections.labels(backend=backend.url, outcome="ejected").inc()
        return True

    def restarted(self, backend: Backend) -> None:
        """Its process was started again (the embedded backend's watchdog, or warm
        resume's read of a llama-server's slot): a new epoch."""
        backend.restarts += 1
        self._bump(freed=False)

    def mark_up(self, backend: Backend) -> None:
        if not backend.healthy:
            log.info("backend %s is up again", backend.url)
            self.metrics.backend_up.labels(backend=backend.url).set(1)
            self._bump(freed=True)
        backend.healthy = True
        backend.ejected = False
        backend.errors_in_row = 0
        backend.backoff = BACKOFF_START

    def observe_status(
        self, backend: Backend, status: int, now: float | None = None, *, body: Any = None
    ) -> None:
        """Passive health from an answer's status: below 500 is up; 5xx in a row ejects.
        `body`: the request's, when it was sent whole: a 5xx to a body that already got
        one (the SDKs retry the same body) is the request's fault, not the backend's."""
        if status < 500:
            self.mark_up(backend)
            return
        digest = _digest(body)
        if digest is not None:
            first = self._faults.get(digest)
            if first is not None:  # the same request failed before: its own doing
                self._faults.move_to_end(digest)
                if first == backend.url and backend.errors_in_row:
                    backend.errors_in_row -= 1  # its first failure was not the backend's
                self.metrics.request_faults.inc()
                return
            self._faults[digest] = backend.url
            while len(self._faults) > FAULTS_KEPT:
                self._faults.popitem(last=False)
        backend.errors_in_row += 1
        if not backend.healthy or backend.errors_in_row >= ERRORS_BEFORE_DOWN:
            self.eject(backend, f"{backend.errors_in_row} answers of 5xx in a row", now)


def _digest(body: Any) -> bytes | None:
    """A request body's digest, when it was sent whole (bytes, or a list of bytes)."""
    if isinstance(body, bytes | bytearray | memoryview):
        return hashlib.blake2b(body, digest_size=16).digest()
    if isinstance(body, list | tuple) and all(isinstance(p, bytes) for p in body):
        digest = hashlib.blake2b(digest_size=16)
        for part in body:
            digest.update(part)
        return digest.digest()
    return None


def _rendezvous(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
