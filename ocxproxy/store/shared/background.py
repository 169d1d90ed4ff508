"""Background responses' bookkeeping on the shared store (store/background.py's
`Backgrounds`), so that every replica polls, resumes and cancels any of them.

A background response is a hash on the server (keys.py's `Keys.background`: status, the
latest Response, stream, owner, and until the store holds its turn its own input items
and the id of the response it continues) and,
for `stream: true`, a list of its events' SSE bytes (index = sequence_number). The replica
that runs it writes both through one script (background_scripts.WRITE) in order: each
response's changes since its last write go in one round trip, a terminal status with its
terminal event, and every write publishes a wake on the tier's channel. A replica that
follows a stream it does not run reads the list from where it is (`RemoteLog`), woken by
the channel (or every POLL seconds, should a message be lost), so a resume on any replica
is the same log, gap-free, to its end. The replica running a response follows it from
memory (its own `EventLog`).

The runner holds a lease: the response's key in `bgrunning`, scored by the lease's end
(LEASE seconds on the server's clock, renewed every RENEW_EVERY seconds and by every
write). Every replica claims, every RENEW_EVERY seconds, the responses whose lease ended
(their owner was killed, or lost the server) and fails them (`background_lost`): an owner
dead at kill -9 leaves its responses `failed` within LEASE + RENEW_EVERY seconds. An
owner that finds its lease gone, or its response cancelled by another replica (the
channel tells it at once, the renewal within RENEW_EVERY), stops the run.

Logs are kept LOG_KEPT seconds after the end, within --background-log-bytes (the oldest
ended log goes first); a response the store keeps (completed, incomplete) for as long as
its log, a failed or cancelled one for --ttl.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.errors import OcxError, StorageUnavailable, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.store.background import (
    LOG_KEPT,
    LOST,
    STORED,
    TERMINAL,
    EventLog,
    Inputs,
    Job,
    lost_response,
    register_gauges,
)
from ocxproxy.store.shared.background_scripts import SHAS
from ocxproxy.store.shared.keys import ScopeKeys, background_keys, background_log
from ocxproxy.store.shared.server import UNAVAILABLE, Server
from ocxproxy.store.shared.wire import ReplyError, Wire, open_wire, pack

log = logging.getLogger("ocxproxy.background")

LEASE = 5.0  # seconds a replica's hold on a response it runs outlives its last renewal
RENEW_EVERY = 1.0  # seconds between renewals (and between claims of lapsed leases)
POLL = 1.0  # seconds a follower waits for a wake before it reads the log anyway
OUTAGE = LEASE  # seconds a follower reads again (every POLL) a log the server cannot give
RETRY = 0.5  # seconds before a write the server refused is tried again
_CLAIMS = 16  # lapsed responses a replica claims per round


@dataclass(slots=True, eq=False)
class _Pending:
    """A response's changes not written yet."""

    job: Job
    mode: str  # 'open', 'own' or 'cancel'
    start: int = 0  # the sequence number of the first event
    events: list[bytes] = field(default_factory=list)
    status: str = ""
    response: bytes = b""
    inputs: bytes = b""  # (an open's) its own input items, a JSON array
    parent: str = ""  # (an open's) the response whose chain comes before them
    drop: bool = False  # then the response is deleted

    def merge(self, later: _Pending) -> None:
        if not self.events:
            self.start = later.start
        self.events += later.events
        if later.status:
            self.status, self.response = later.status, later.response or self.response
        self.inputs, self.parent = self.inputs or later.inputs, self.parent or later.parent
        self.drop = self.drop or later.drop


class SharedBackgrounds:
    """Background bookkeeping on the shared server; the responses this replica runs also in
    memory (`jobs`), until their terminal write is in."""

    def __init__(
        self, server: Server, url: str, prefix: str, metrics: Metrics, *, log_bytes: int,
        ttl: float, stored: Callable[[str, str], Awaitable[bytes | None]] | None = None,
        forget: Callable[[Job], Coroutine[Any, Any, object]] | None = None,
    ) -> None:  # fmt: skip
        self.server, self.url, self.metrics = server, url, metrics
        # The store's Response of a turn it keeps (scope, id), or None: a run whose replica
        # died after its turn was stored ends as stored, not lost.
        self.stored = stored
        # Deletes the stored turn of a run that finished here while the server had it end
        # otherwise (cancelled from another replica, its lease lost), and takes its items
        # out of its conversation.
        self.forget = forget
        self.keys = ScopeKeys(prefix)
        self.running_key, self.ended_key, self.sizes_key, self.total_key, self.channel = (
            background_keys(prefix)
        )
        self.log_bytes, self.ttl = log_bytes, ttl
        self.token = secrets.token_hex(16)  # this replica, as the owner of what it runs
        self.jobs: dict[bytes, Job] = {}  # the ones it runs, by key
        self._opening: set[bytes] = set()  # of them, those not on the server yet
        # Of them, those that ended here, until the server takes the end (the first to
        # write an end wins: another replica's cancel may): each one's terminal event,
        # which its followers here see only then (None: not streamed).
        self._ending: dict[bytes, bytes | None] = {}
        self.log_size = 0  # the server's total of logs' bytes, as the last write saw it
        self._pending: dict[bytes, _Pending] = {}
        self._queued = 0  # changes queued so far
        self._written = 0  # of them, written (or refused for good)
        self._failed = 0  # of them, up to which a write failed (commit raises)
        self._flushed: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._watchers: dict[bytes, set[asyncio.Event]] = {}
        self._abandoned = False
        register_gauges(metrics, self)

    # -- the Backgrounds interface -------------------------------------------------------

    def open(self, job: Job) -> None:
        key = self.keys(job.scope).background(job.id)
        self.jobs[key] = job
        self._opening.add(key)
        if job.stream:
            job.log = EventLog()
        inputs, parent = b"", ""
        if job.inputs is not None and job.durable:
            inputs, parent = b"[" + job.inputs + b"]", job.parent or ""
        self._queue(key, _Pending(job, "open", status=job.status, response=job.response,
                                  inputs=inputs, parent=parent))  # fmt: skip

    async def get(self, scope: str, response_id: str) -> Job | None:
        key = self.keys(scope).background(response_id)
        job = self.jobs.get(key)
        if job is not None:
            if key in self._ending:  # (its end as the server takes it)
                await self.commit()
            return job
        packed = pack("HMGET", key, "status", "response", "stream") + pack(
            "EXISTS", background_log(key)
        )
        fields, exists = await self._read("background_get", packed, 2)
        status, response, stream = fields
        if status is None:
            return None
        job = Job(response_id, scope, status.decode(), response or b"{}", stream == b"1")
        if job.stream and exists:
            job.log = RemoteLog(self, key)
        return job

    async def inputs(self, job: Job) -> Inputs | None:
        key = self.keys(job.scope).background(job.id)
        if self.jobs.get(key) is job:
            return None if job.inputs is None else (job.parent, job.inputs)
        packed = pack("HMGET", key, "own", "parent", "input")
        ((own, parent, whole),) = await self._read("background_inputs", packed, 1)
        if own is not None:
            return (parent.decode() if parent else None), own[1:-1]
        return (None, whole[1:-1]) if whole else None  # (an earlier version's: whole)

    async def continuing(self, scope: str, response_id: str) -> list[Job]:
        packed = pack("SMEMBERS", self.keys(scope).continuing(response_id))
        (ids,) = await self._read("background_continuing", packed, 1)
        jobs = [await self.get(scope, job_id.decode()) for job_id in ids]
        return [job for job in jobs if job is not None and job.status not in STORED]

    async def keep_whole(self, job: Job, parent: str, inputs: bytes) -> None:
        key = self.keys(job.scope).background(job.id)
        mine = self.jobs.get(key)
        if mine is not None and mine.parent == parent:
            mine.inputs, mine.parent, mine.parent_record = inputs, None, None
        sha, whole = SHAS["background_keep_whole"], b"[" + inputs + b"]"
        await self.server.write(
            "background_keep_whole", lambda: ("EVALSHA", sha, 1, key, parent, whole)
        )

    def append(self, job: Job, *events: bytes, ends: bool = False) -> None:
        if job.log is None:
            return
        key = self.keys(job.scope).background(job.id)
        if isinstance(job.log, RemoteLog):  # another replica's (a cancel's last event)
            self._queue(key, _Pending(job, "cancel", -1, [*events]))  # numbered there
            return
        start = len(job.log.events)
        if ends:  # the terminal event: into the log once the server has it (_write_changes)
            self._ending[key] = events[-1]
            job.log.append(*events[:-1])
        else:
            job.log.append(*events)
        self._queue(key, _Pending(job, "own", start, [*events]))

    def drop(self, job: Job) -> None:
        key = self.keys(job.scope).background(job.id)
        if self.jobs.get(key) is job:
            del self.jobs[key]
            self._opening.discard(key)
            self._ending.pop(key, None)
        if job.log is not None:
            job.log.close()
            job.log = None
        self._queue(key, _Pending(job, "own", drop=True))

    def moved(self, job: Job, status: str, response: bytes | None = None) -> None:
        if job.terminal:
            return
        key = self.keys(job.scope).background(job.id)
        mine = self.jobs.get(key) is job
        job.status = status
        if response is not None:
            job.response = response
        if status in TERMINAL:
            if mine:
                self._ending.setdefault(key, None)
            self._ended(job, close=not mine)
        # Another replica's response (a cancel): written if it has not ended meanwhile.
        mode = "own" if mine else "cancel"
        self._queue(key, _Pending(job, mode, status=status, response=response or b""))

    async def commit(self) -> None:
        """Until every change queued so far is on the server; StorageUnavailable when the
        server refused it (it is tried again, and the lease lapses if it never is)."""
        target = self._queued
        while self._written < target and not self._abandoned:
            if self._failed >= target:
                raise StorageUnavailable(UNAVAILABLE)
            if self._flushed is None:
                self._flushed = asyncio.Event()
            flushed = self._flushed
            self._kick()
            await flushed.wait()

    async def load(self) -> None:
        """Start renewing this replica's leases, claiming lapsed ones, and listening."""
        self._ticker = spawn(self._tick(), name="background-leases")
        self._listener = spawn(self._listen(), name="background-channel")

    async def close(self) -> None:
        with contextlib.suppress(StorageUnavailable, StoreFailure, OcxError, TimeoutError):
            async with asyncio.timeout(2.0):
                await self.commit()
        await self._stop()

    async def _stop(self) -> None:
        for task in (self._ticker, self._listener, self._writer):
            if task is not None:
                await cancel_and_wait(task)
        self._ticker = self._listener = self._writer = None

    async def abandon(self) -> None:
        """Stop as a killed process would (for tests): nothing more is written or renewed,
        and the runs here are cut; their leases lapse on the server."""
        self._abandoned = True
        self._pending.clear()
        await self._stop()
        if self._flushed is not None:  # (a commit waiting ends)
            self._flushed.set()
        for task in self.running():
            task.cancel()

    def running(self) -> list[asyncio.Task[Any]]:
        return [job.task for job in self.jobs.values() if job.task is not None]

    # -- writes ----------------------------------------------------------------------------

    def _ended(self, job: Job, *, close: bool = True) -> None:
        job.ended = time.time()
        job.task = None
        job.parent_record = None  # (ended: its chain is read from the store, as anywhere)
        if close and job.log is not None:
            job.log.close()

    def _queue(self, key: bytes, change: _Pending) -> None:
        if self._abandoned:
            return
        pending = self._pending.get(key)
        if pending is None:
            self._pending[key] = change
        else:
            pending.merge(change)
        self._queued += 1
        self._kick()

    def _kick(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = spawn(self._write(), name="background-writer")

    async def _write(self) -> None:
        """Write what is pending, each response's changes in one script, all of them in one
        round trip; again while more came meanwhile."""
        while self._pending:
            batch, self._pending = self._pending, {}
            target = self._queued
            results = await asyncio.gather(
                *(self._write_one(key, change) for key, change in batch.items()),
                return_exceptions=True,
            )
            failed = False
            for (key, change), result in zip(batch.items(), results, strict=True):
                if isinstance(result, BaseException):
                    failed = True
                    later = self._pending.get(key)
                    if later is not None:  # (kept in order: the failed ones first)
                        change.merge(later)
                    self._pending[key] = change
            if failed:
                self._failed = target
            else:
                self._written = target
            flushed, self._flushed = self._flushed, None
            if flushed is not None:
                flushed.set()
            if failed:
                await asyncio.sleep(RETRY)

    async def _write_one(self, key: bytes, change: _Pending) -> None:
        if change.events or change.status:
            await self._write_changes(key, change)
        if change.drop:
            keys = (key, self.running_key, self.ended_key, self.sizes_key, self.total_key)
            sha = SHAS["background_drop"]
            await self.server.write(
                "background_drop", lambda: ("EVALSHA", sha, len(keys), *keys, self.channel)
            )

    async def _write_changes(self, key: bytes, change: _Pending) -> None:
        job = change.job
        kept = LOG_KEPT if change.status in STORED else self.ttl
        keys: tuple[bytes, ...] = (
            key, self.running_key, self.ended_key, self.sizes_key, self.total_key
        )  # fmt: skip
        # (a stored end in the same write: no input to keep, so no place in the set,
        # whose life would be cut to the log's)
        parent = change.parent if change.status not in STORED else ""
        if parent:
            keys += (self.keys(job.scope).continuing(parent),)
        args = (
            change.mode, self.token, change.start, change.status, change.response,
            int(LEASE * 1000), int(LOG_KEPT * 1000), int(kept * 1000), self.log_bytes,
            self.channel, job.id, job.scope, "1" if job.stream else "0", change.inputs,
            parent, *change.events,
        )  # fmt: skip
        sha = SHAS["background_write"]
        answer = await self.server.write(
            "background_write", lambda: ("EVALSHA", sha, len(keys), *keys, *args)
        )
        if change.mode == "open":
            self._opening.discard(key)
        if answer[0] == b"ok":
            self.log_size = int(answer[1])
            if change.status in TERMINAL:  # (counted once, by the replica whose end won)
                self.metrics.background_finished.labels(status=change.status).inc()
            if change.status in TERMINAL and self.jobs.get(key) is job:
                del self.jobs[key]  # (its end is on the server: the server's from now on)
                end = self._ending.pop(key, None)
                if job.log is not None and not isinstance(job.log, RemoteLog):
                    if end is not None:
                        job.log.append(end)
                    job.log.close()
            return
        # Refused: it ended (a cancel from another replica), its lease went elsewhere, or
        # the server no longer has it.
        if answer[0] == b"ended":
            self._settle(key, job, answer[1].decode(), answer[2])
        elif answer[0] == b"gone" and self.jobs.get(key) is job:
            self._gone(key, job)
        else:
            self._settle(key, job, "failed", lost_response(job.response), lost=True)

    def _gone(self, key: bytes, job: Job) -> None:
        """The server no longer has a response this replica runs (it came back without
        its data, or the key was deleted): failed, lost, and counted here, since no other
        replica can claim what it does not know of."""
        log.warning("background response %s: the shared store lost it: failed", job.id)
        self.metrics.background_lost.inc()
        self._settle(key, job, "failed", lost_response(job.response), lost=True)

    def _settle(
        self, key: bytes, job: Job, status: str, response: bytes, *, lost: bool = False
    ) -> None:
        """What the server says of a response this replica thought it ran, or cancelled:
        so it is (an end this replica wrote loses to the one the server took first), and
        its run (if any) stops. `lost`: its lease went to another replica, which ends it
        as the store has it."""
        task = job.task
        self._ending.pop(key, None)
        if status in TERMINAL:
            if job.status in STORED and status not in STORED and not lost and self.forget:
                spawn(self.forget(job), name=f"background-forget-{job.id}")
            job.status, job.response = status, response
            log = job.log
            if log is not None and not isinstance(log, RemoteLog) and not log.closed:
                log.append(_terminal_event(status, len(log.events), response))  # (followers)
            self._ended(job)
        if self.jobs.get(key) is job:
            del self.jobs[key]
        if task is not None and not task.done():
            job.cancelling = status == "cancelled"
            task.cancel()

    # -- leases ----------------------------------------------------------------------------

    async def _tick(self) -> None:
        """Renew, then claim, every RENEW_EVERY seconds; a round that fails is tried again
        next time (this task must not end: without it this replica's leases lapse)."""
        while True:
            await asyncio.sleep(RENEW_EVERY)
            for step in (self._renew, self._claim):
                try:
                    await step()
                except (StorageUnavailable, StoreFailure, OcxError):
                    pass  # the server is unavailable: its probe says so
                except Exception:
                    log.exception("background leases: %s failed", step.__name__)

    async def _renew(self) -> None:
        keys = [key for key in self.jobs if key not in self._opening]
        if not keys:
            return
        sha = SHAS["background_renew"]
        args = (self.token, int(LEASE * 1000), *keys)
        renewal = self.server.write(
            "background_renew", lambda: ("EVALSHA", sha, 1, self.running_key, *args)
        )
        refused = await self.server.probing("background_renew", renewal)
        for key, status, response in refused:
            job = self.jobs.get(key)
            if job is None or (status == b"" and job.terminal):
                continue
            if status == b"":
                self._gone(key, job)
            elif status.decode() in TERMINAL:
                self._settle(key, job, status.decode(), response)
            else:
                self._settle(key, job, "failed", lost_response(job.response), lost=True)

    async def _claim(self) -> None:
        """End the responses whose owner's lease lapsed: failed (lost), or as the store
        keeps them when their turn was stored before the owner died."""
        sha = SHAS["background_claim"]
        args = (self.token, int(LEASE * 1000), _CLAIMS)
        claim = self.server.write(
            "background_claim", lambda: ("EVALSHA", sha, 1, self.running_key, *args)
        )
        claimed = await self.server.probing("background_claim", claim)
        for key, response_id, scope, status, response, stream, length in claimed:
            job = Job(response_id.decode(), scope.decode(), status.decode(), response or b"{}",
                      stream == b"1")  # fmt: skip
            final = await self._final(job)
            if final is None:
                status, final = "failed", lost_response(job.response)
                log.warning("background response %s: its replica's lease lapsed: failed", job.id)
                self.metrics.background_lost.inc()
            else:
                status = str(loads_or_none(final)["status"])
            events = [_terminal_event(status, int(length), final)] if job.stream else []
            job.status, job.response = status, final
            self._queue(key, _Pending(job, "own", int(length), events, status, final))
        if claimed:
            await self.commit()

    async def _final(self, job: Job) -> bytes | None:
        """The Response the store keeps of `job`'s turn (completed, incomplete), or None."""
        if self.stored is None:
            return None
        final = await self.stored(job.scope, job.id)
        if final is None:
            return None
        body = loads_or_none(final)
        return final if type(body) is dict and body.get("status") in STORED else None

    # -- the channel: wakes for followers, cancels for owners -------------------------------

    async def _listen(self) -> None:
        """Subscribed to the channel, again after a lost connection."""
        while True:
            subscriber: _Subscriber | None = None
            try:
                subscriber = await open_wire(self.url, lambda: _Subscriber(self._heard))
                await subscriber.ask("SUBSCRIBE", self.channel)
                await subscriber.closed
            except (OSError, ReplyError, TimeoutError) as exc:
                log.debug("background channel: %s", exc)
            finally:
                if subscriber is not None:
                    subscriber.close()
            for watchers in self._watchers.values():  # (what was missed meanwhile: read)
                for watcher in watchers:
                    watcher.set()
            await asyncio.sleep(POLL)

    def _heard(self, message: bytes) -> None:
        kind, key = message[:1], message[1:]
        if kind == b"e":
            for watcher in self._watchers.get(key, ()):
                watcher.set()
        elif kind == b"c" and (job := self.jobs.get(key)) is not None and key not in self._ending:
            # Cancelled by another replica (which wrote it): the run stops here at once
            # (one that ended here meanwhile learns which end won from its own write).
            response = loads_or_none(job.response)
            if type(response) is dict:
                response["status"] = "cancelled"
            self._settle(key, job, "cancelled", orjson.dumps(response or {}))

    async def _read(self, op: str, packed: bytes, answers: int) -> list[Any]:
        replies = await self.server.round_trip(op, packed, answers)
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise StorageUnavailable(UNAVAILABLE)
        return replies

    async def read_log(self, remote: RemoteLog) -> None:
        """What a followed log has gained, and whether it is complete (the status read
        before the events: a terminal one's last event is in by then)."""
        packed = pack("HGET", remote.key, "status") + pack(
            "LRANGE", background_log(remote.key), len(remote.events), -1
        )
        status, events = await self._read("background_read", packed, 2)
        if status is None:  # (its running replica fails it, and counts it: _gone)
            raise OcxError(f"{LOST}: the shared store no longer has this background response.")
        for event in events:
            remote.append(event)
        if status.decode() in TERMINAL:
            remote.close()

    @contextlib.contextmanager
    def watching(self, key: bytes, woken: asyncio.Event) -> Any:
        self._watchers.setdefault(key, set()).add(woken)
        try:
            yield
        finally:
            watchers = self._watchers.get(key)
            if watchers is not None:
                watchers.discard(woken)
                if not watchers:
                    del self._watchers[key]


class RemoteLog(EventLog):
    """A background response's log as another replica writes it: read from the server."""

    __slots__ = ("book", "key", "read")

    def __init__(self, book: SharedBackgrounds, key: bytes) -> None:
        super().__init__()
        self.book, self.key = book, key
        self.read = False

    async def changed(self) -> None:
        """Until the log has more events or is complete; StorageUnavailable once the
        server has not answered for OUTAGE seconds (a restart of it is waited out)."""
        woken = asyncio.Event()
        down: float | None = None  # since when reads fail
        with self.book.watching(self.key, woken):
            while True:
                had = len(self.events)
                if self.read:
                    with contextlib.suppress(TimeoutError):  # (server.py's probing: why)
                        async with asyncio.timeout(POLL):
                            await woken.wait()
                    woken.clear()
                self.read = True
                try:
                    await self.book.read_log(self)
                except StorageUnavailable:
                    down = down or time.monotonic()
                    if time.monotonic() - down >= OUTAGE:
                        raise
                    continue
                down = None
                if len(self.events) > had or self.closed:
                    return


class _Subscriber(Wire):
    """The channel's connection: published messages go to `heard`, other answers (AUTH,
    SELECT, SUBSCRIBE's) to their callers; `closed` is done when the connection is lost."""

    def __init__(self, heard: Callable[[bytes], None]) -> None:
        super().__init__()
        self.heard = heard
        self.closed: asyncio.Future[None] = self._loop.create_future()

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        parser.feed(data)
        try:
            while (reply := parser.gets()) is not False:
                if type(reply) is list and len(reply) == 3 and reply[0] == b"message":
                    self.heard(reply[2])
                elif self._waiting:
                    future = self._waiting.popleft()
                    if not future.done():
                        future.set_result(reply)
        except Exception as exc:  # garbage from the server: a new connection
            self.close(ConnectionError(f"background channel: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.closed.done():
            self.closed.set_result(None)


def _terminal_event(status: str, sequence_number: int, response: bytes) -> bytes:
    """The SSE event that ends a log the proxy ended (`response.failed` of a lost one,
    `response.cancelled`)."""
    kind = "response." + status
    payload = {
        "type": kind,
        "sequence_number": sequence_number,
        "response": orjson.Fragment(response),
    }
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def loads_or_none(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
