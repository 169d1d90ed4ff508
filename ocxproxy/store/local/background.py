"""Background responses' bookkeeping on one node (store/background.py's `Backgrounds`):
in process memory and, on a durable store, in the state dir:

    background.jsonl       one JSON line per status change (the Response with it only
                           when the store will not hold the final one: queued, failed,
                           cancelled; with the first, the input items: its own, and
                           the response whose chain comes before them), fdatasynced
                           by `commit`
    background/<id>.log    an ended stream's event log, written once, within
                           LOG_WRITE_DELAY of its end (a header line, then the events'
                           bytes), removed with it
    background/<id>.part   a running stream's events so far, appended every
                           LOG_WRITE_DELAY once it has run that long (each event's
                           length on a line, then its bytes), removed once its .log is
                           written

`commit` writes the lines queued since the last one, and has them fdatasynced by a
helper process of its own (store/local/syncer.py's `FsyncChild`, the journal's helper,
started at the first background response), so neither the write nor the sync runs on the
event loop nor costs a thread's return to it; without the helper, in a thread. Commits
are grouped: up to MAX_FLIGHTS writes sync side by side, and the lines queued while they
do go out together in the next one, one sync for every create waiting. The event log
files are written beside, never holding up a status line (a rewrite waits for both). Event
logs are not synced: a process killed with -9 leaves them in the page cache, and one torn
by a power loss is refused when read (its sizes do not add up). When the file has grown
past twice what a rewrite would write, `commit` rewrites it with what is still kept; so
does the first commit after a write failed (the lines it held may be missing or torn). A
failed write is counted (`ocxproxy_store_write_failures_total`) and the commits awaiting
it raise StorageUnavailable.

At start `load` folds the file, turns a response left queued or in progress by a process
that died into `failed` (`background_lost`), reads back the event logs still within
LOG_KEPT and the budget (newest first; a finished stream can be resumed after a restart),
and rewrites the file. A stream it fails keeps the events its .part holds (up to the
first torn one; its `response.created` alone when none reached the disk), then ends with
its `response.failed`, numbered next: it is resumed like any ended one."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.errors import StorageUnavailable
from ocxproxy.metrics import Metrics
from ocxproxy.store.background import (
    IN_PROGRESS,
    LOG_KEPT,
    STORED,
    TERMINAL,
    EventLog,
    Inputs,
    Job,
    lost_response,
    register_gauges,
    response_event,
)
from ocxproxy.store.local.syncer import ChildGone, FsyncChild

log = logging.getLogger("ocxproxy.background")

FILE = "background.jsonl"
LOGS = "background"  # the streams' event logs
PART = ".part"  # a running stream's event log file's suffix
DELETED = "deleted"  # a journal line's status: the response was deleted
REWRITE_BYTES = 1024**2  # the file is not rewritten below this size
LOG_WRITE_DELAY = 0.5  # seconds an ended stream's log waits to be written with others
MAX_FLIGHTS = 2  # status line writes at the fsync helper at once
UNAVAILABLE = (
    "The background response could not be stored: the proxy's storage is unavailable "
    "(e.g. its disk is full). Retry later."
)

Found = tuple[dict[str, Any], list[bytes], int]  # an event log file read: header, events, size


class LocalBackgrounds:
    """Background bookkeeping in process memory, journaled in `state_dir` when given."""

    def __init__(
        self, metrics: Metrics, *, state_dir: Path | None, log_bytes: int, ttl: float
    ) -> None:
        self.metrics = metrics
        self.path = state_dir / FILE if state_dir is not None else None
        self.logs = state_dir / LOGS if state_dir is not None else None
        self.log_bytes = log_bytes
        self.ttl = ttl  # how long a response the store does not keep stays here
        self.jobs: dict[tuple[str, str], Job] = {}
        self.ended: deque[Job] = deque()  # terminal jobs, oldest first
        self.kept: deque[Job] = deque()  # failed or cancelled, their logs gone, until the TTL
        self.log_size = 0  # bytes of every event log kept
        self.file_bytes = 0  # background.jsonl's size
        self.logs_on_disk: dict[str, int] = {}  # event log files' sizes, by file name
        self.logs_bytes = 0  # their sum
        self._pending: list[bytes] = []  # lines to append
        # Event log files to write: (id, bytes, whether it is the .part), in order; bytes
        # None removes that file.
        self._files: list[tuple[str, bytes | None, bool]] = []
        self._running: dict[str, Job] = {}  # streams running, their .part written as they go
        self._parts: dict[str, int] = {}  # events in each one's .part
        self._rewrite_at = REWRITE_BYTES
        # A write failed: the file may lack lines (or hold a torn one), so the next commit
        # rewrites it whole from what is kept in memory.
        self._failed = False
        self._writing: asyncio.Lock | None = None  # event log files, or a rewrite
        self._fd: int | None = None  # background.jsonl, open for writes once written
        self._flights: deque[asyncio.Future[None]] = deque()  # writes being synced
        self._slow: asyncio.Task[None] | None = None  # the file rewritten or opened
        self._generation = 0  # the file's: a rewrite replaces it (the helper's key)
        self._child: FsyncChild | None = None
        self._starting: asyncio.Task[None] | None = None  # the helper's start
        self._flushing: asyncio.Task[None] | None = None  # event log files being written
        finished = metrics.background_finished
        self._finished = {status: finished.labels(status=status) for status in TERMINAL}
        register_gauges(metrics, self)

    def disk_bytes(self) -> int:
        """What background responses take in the state dir (counted in --max-disk-bytes)."""
        return self.file_bytes + self.logs_bytes

    def open(self, job: Job) -> None:
        self._prune()
        self.jobs[job.scope, job.id] = job
        if job.stream:
            job.log = EventLog()
            if self.logs is not None:
                self._running[job.id] = job
                self._flush_soon()
        self._journal(job, job.response, inputs=True)
        if self.path is not None and self._child is None and self._starting is None:
            self._starting = spawn(self._start_child(), name="background-fsync-helper")

    async def get(self, scope: str, response_id: str) -> Job | None:
        return self.jobs.get((scope, response_id))

    async def inputs(self, job: Job) -> Inputs | None:
        return None if job.inputs is None else (job.parent, job.inputs)

    async def continuing(self, scope: str, response_id: str) -> list[Job]:
        return [
            job
            for job in self.jobs.values()
            if job.parent == response_id and job.scope == scope and job.inputs is not None
        ]

    async def keep_whole(self, job: Job, parent: str, inputs: bytes) -> None:
        if job.parent != parent or self.jobs.get((job.scope, job.id)) is not job:
            return  # (its turn stored meanwhile, or it was deleted: a line would revive it)
        job.inputs, job.parent, job.parent_record = inputs, None, None
        self._journal(job, job.response, inputs=True)

    def append(self, job: Job, *events: bytes, ends: bool = False) -> None:
        """Events of `job`'s stream, in order (the first one's sequence_number is the
        log's length)."""
        log = job.log
        if log is None:
            return
        size = log.size
        log.append(*events)
        self.log_size += log.size - size
        if self.log_size > self.log_bytes:
            self._prune(over_budget=True)

    def moved(self, job: Job, status: str, response: bytes | None = None) -> None:
        if job.terminal:
            return
        job.status = status
        if response is not None:
            job.response = response
        if status in STORED:
            job.inputs = job.parent = job.parent_record = None  # (the store's now)
        if status in TERMINAL:
            job.ended = time.time()
            job.task = None
            job.parent_record = None  # (ended: its chain is read from the store, as anywhere)
            self._running.pop(job.id, None)
            if job.log is not None:
                job.log.close()
                self._save_log(job)
            self.ended.append(job)
            self._finished[status].inc()
        if status != IN_PROGRESS:  # (queued or in progress, a restart fails it all the same)
            self._journal(job, None if status in STORED else job.response)

    def drop(self, job: Job) -> None:
        if self.jobs.pop((job.scope, job.id), None) is None:
            return
        for kept in (self.ended, self.kept):
            if job in kept:
                kept.remove(job)
        self._forget_log(job)
        self._journal(job, None, status=DELETED)

    def _journal(
        self, job: Job, response: bytes | None, *, status: str | None = None, inputs: bool = False
    ) -> None:
        if self.path is not None:
            self._pending.append(_line(job, response, status, inputs=inputs))

    # -- event log files -------------------------------------------------------------

    def _save_log(self, job: Job) -> None:
        """An ended stream's log, to its file (written off the loop, not awaited)."""
        if self.logs is None or job.log is None:
            return
        events = job.log.events
        sizes = list(map(len, events))
        head = {"id": job.id, "scope": job.scope, "status": job.status, "ended": job.ended}
        head_bytes = orjson.dumps({**head, "sizes": sizes})
        self._files.append((job.id, head_bytes + b"\n" + b"".join(events), False))
        if self._parts.pop(job.id, None) is not None:  # (written: the .log replaces it)
            self._files.append((job.id, None, True))
        self._flush_soon()

    def _forget_log(self, job: Job) -> None:
        """Drop `job`'s event log, in memory and on disk."""
        if job.log is not None:
            self.log_size -= job.log.size
            job.log.close()
            job.log = None
        self._running.pop(job.id, None)
        queued = len(self._files)
        if self._parts.pop(job.id, None) is not None:
            self._files.append((job.id, None, True))
        if f"{job.id}.log" in self.logs_on_disk or any(
            name == job.id and data is not None for name, data, _ in self._files
        ):
            self._files.append((job.id, None, False))
        if len(self._files) > queued:
            self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flushing is None or self._flushing.done():
            self._flushing = spawn(self._flush(), name="background-logs")

    async def _flush(self) -> None:
        while self._files or self._running:
            await asyncio.sleep(LOG_WRITE_DELAY)  # (the logs ended meanwhile go with it)
            async with self._lock():
                self._queue_parts()
                await self._write_files()

    def _queue_parts(self) -> None:
        """What each running stream logged since its last write, onto its .part (once it
        has run LOG_WRITE_DELAY: most end sooner, and write only their .log)."""
        young = time.time() - LOG_WRITE_DELAY
        for name, job in self._running.items():
            log, written = job.log, self._parts.get(name, 0)
            if log is None or len(log.events) <= written or job.created > young:
                continue
            self._parts[name] = len(log.events)
            framed = b"".join(b"%d\n%s" % (len(event), event) for event in log.events[written:])
            self._files.append((name, framed, True))

    async def _write_files(self) -> None:
        """The event log files queued (under the lock), in order: a removal after its write."""
        files, self._files = self._files, []
        if not files or self.logs is None:
            return
        done = await asyncio.to_thread(_write_logs, self.logs, files)
        for name, size in done.items():
            self.logs_bytes -= self.logs_on_disk.pop(name, 0)
            if size is not None:
                self.logs_on_disk[name] = size
                self.logs_bytes += size

    # -- background.jsonl ------------------------------------------------------------

    def _lock(self) -> asyncio.Lock:
        if self._writing is None:
            self._writing = asyncio.Lock()
        return self._writing

    async def commit(self) -> None:
        """Until every status line queued so far is durable. A commit sends what is
        queued at once, while up to MAX_FLIGHTS writes are in flight (the helper syncs
        them side by side); past that it waits for the oldest to land, and then one write
        takes every line queued meanwhile: one sync serves all the commits waiting.
        StorageUnavailable (counted by errno) when the file could not be written."""
        if self.path is None:
            return
        try:
            await self._commit()
        except OSError as error:
            reason = errno.errorcode.get(error.errno or 0, "error")
            self.metrics.store_write_failures.labels(reason=reason).inc()
            log.warning("%s could not be written: %s", FILE, error)
            self._failed = True
            raise StorageUnavailable(UNAVAILABLE) from error

    async def _commit(self) -> None:
        while self._pending or self._failed:
            if self._slow is not None:  # a rewrite (or the file's opening): after it
                await asyncio.shield(self._slow)
            elif self._fd is None or self._failed or self.file_bytes > self._rewrite_at:
                self._slow = spawn(self._write_slowly(), name="background-rewrite")
            elif len(self._flights) >= MAX_FLIGHTS:
                # (_landing yields even to a flight that has landed but whose _landed has
                # not run yet: awaiting the done future itself would spin here forever.)
                with contextlib.suppress(OSError):  # (its own commits raise it)
                    await _landing(self._flights[0])
            else:
                self._send()
        if self._slow is not None:  # (it took the lines)
            await asyncio.shield(self._slow)
        for flight in tuple(self._flights):  # ours last: the lines before it land first
            await _landing(flight)

    def _send(self) -> None:
        """Every line queued, in one write at the file's end (a flight until synced)."""
        assert self._fd is not None
        data = b"".join(self._pending)
        self._pending = []
        at, self.file_bytes = self.file_bytes, self.file_bytes + len(data)
        flight: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flights.append(flight)
        flight.add_done_callback(self._landed)
        child = self._child
        if child is not None and not child.gone:
            try:
                synced = child.write(self._fd, self._generation, data, at)
            except ChildGone:
                pass
            else:
                synced.add_done_callback(partial(self._synced, flight, data, at))
                return
        spawn(self._in_thread(flight, data, at), name="background-sync")

    def _synced(
        self, flight: asyncio.Future[None], data: bytes, at: int, synced: asyncio.Future[None]
    ) -> None:
        error = synced.exception()
        if isinstance(error, ChildGone):  # the same bytes at the same place, in a thread
            spawn(self._in_thread(flight, data, at), name="background-sync")
        elif error is not None:
            flight.set_exception(error)
        else:
            flight.set_result(None)

    async def _in_thread(self, flight: asyncio.Future[None], data: bytes, at: int) -> None:
        assert self._fd is not None
        try:
            await asyncio.to_thread(_pwrite, self._fd, data, at)
        except OSError as error:
            flight.set_exception(error)
        else:
            flight.set_result(None)

    def _landed(self, flight: asyncio.Future[None]) -> None:
        self._flights.remove(flight)
        if not flight.cancelled() and flight.exception() is not None:
            self._failed = True  # (the commits that wait for it raise it)

    async def _write_slowly(self) -> None:
        """Once the writes in flight have landed: the file opened, or rewritten once it
        has grown past twice what a rewrite would write."""
        try:
            if self._flights:
                await asyncio.wait(tuple(self._flights))
            assert self.path is not None
            async with self._lock():
                if self._failed or self.file_bytes > self._rewrite_at:
                    # (A deleted one's log goes first: no line names it once rewritten.)
                    await self._write_files()
                    self._pending = []  # (what the rewrite writes includes their changes)
                    await self._rewrite()
                if self._fd is None:
                    self._fd, self.file_bytes = await asyncio.to_thread(_open, self.path)
        finally:
            self._slow = None

    async def _rewrite(self) -> None:
        """background.jsonl again, with what is still kept (under the lock)."""
        assert self.path is not None
        data = b"".join(
            _line(job, job.response, None, inputs=True)
            for job in self.jobs.values()
            if job.status not in STORED
        )
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        await asyncio.to_thread(_rewrite, self.path, data)
        self._generation += 1
        self.file_bytes = len(data)
        self._rewrite_at = max(REWRITE_BYTES, 2 * len(data))
        self._failed = False

    async def _start_child(self) -> None:
        child = await asyncio.to_thread(FsyncChild.spawn)
        if child is None:
            return
        if self._starting is None:  # closed meanwhile
            child.close()
            await asyncio.to_thread(child.wait)
            return
        child.attach(asyncio.get_running_loop())
        self._child = child

    # -- upkeep ----------------------------------------------------------------------

    def _prune(self, *, over_budget: bool = False) -> None:
        """Drop the event logs past LOG_KEPT (or, over the budget, the oldest ended
        ones); then the jobs the store answers for, and the others past the TTL."""
        now = time.time()
        while self.ended:
            job = self.ended[0]
            assert job.ended is not None
            old = now - job.ended > LOG_KEPT or (over_budget and self.log_size > self.log_bytes)
            if job.log is not None:
                if not old:
                    break
                self._forget_log(job)
            self.ended.popleft()
            if job.status in STORED:
                self.jobs.pop((job.scope, job.id), None)
            else:
                self.kept.append(job)
        while self.kept and now - (self.kept[0].ended or now) > self.ttl:
            job = self.kept.popleft()
            self.jobs.pop((job.scope, job.id), None)

    def running(self) -> list[asyncio.Task[Any]]:
        return [job.task for job in self.jobs.values() if job.task is not None]

    async def load(self) -> None:
        """Fold the journal and read the event logs back: a response left queued or in
        progress is failed now."""
        if self.path is None or self.logs is None:
            return
        entries, logs, parts = await asyncio.to_thread(_read, self.path, self.logs)
        now = time.time()
        lost = 0
        deleted: set[str] = set()
        for entry in entries:
            key = (entry["scope"], entry["id"])
            if entry["status"] == DELETED:
                self.jobs.pop(key, None)
                deleted.add(entry["id"])
                continue
            deleted.discard(entry["id"])
            job = self.jobs.get(key)
            if job is None:
                job = Job(
                    entry["id"], entry["scope"], entry["status"], b"{}", entry.get("stream", False)
                )
                self.jobs[key] = job
            job.status = entry["status"]
            if "response" in entry:
                job.response = orjson.dumps(entry["response"])
            if "own" in entry:
                job.inputs = b",".join(map(orjson.dumps, entry["own"]))
                job.parent = entry.get("parent")
            elif "input" in entry:  # (written by an earlier version: the whole input)
                job.inputs = b",".join(map(orjson.dumps, entry["input"]))
        doomed = self._attach_logs(logs, deleted, now)
        for key, job in list(self.jobs.items()):
            if job.status in STORED and job.log is None:
                del self.jobs[key]
                continue
            if not job.terminal:
                queued = job.response
                job.status, job.response = "failed", lost_response(job.response)
                job.ended = now
                lost += 1
                if job.stream and job.log is None:
                    self._attach_lost(job, queued, parts.get(job.id, []))
            job.ended = job.ended or now
        for job in sorted(self.jobs.values(), key=lambda job: job.ended or now):
            self.ended.append(job)  # (the logs go by age, then the jobs, as they would have)
        if lost:
            log.warning("%d background responses were left running by a stop: failed", lost)
            self.metrics.background_lost.inc(lost)
        async with self._lock():
            removed = [(name, None, False) for name in doomed]
            removed += [(name, None, True) for name in parts]  # (read: a .log replaces it)
            self._files = [*removed, *self._files]
            await self._write_files()
            await self._rewrite()

    def _attach_lost(self, job: Job, queued: bytes, events: list[bytes]) -> None:
        """The log of a stream a dead process ran, as far as it reached the disk
        (`events`, its .part's; else its `response.created`, from the Response it was
        created with), ended with its `response.failed`; written as an ended one's."""
        if not events:
            events = [response_event("response.created", 0, queued)]
        events.append(response_event("response.failed", len(events), job.response))
        size = sum(map(len, events))
        if self.log_size + size > self.log_bytes:
            return
        job.log = EventLog()
        job.log.append(*events)
        job.log.close()
        self.log_size += size
        self._save_log(job)

    def _attach_logs(self, logs: list[Found], deleted: set[str], now: float) -> list[str]:
        """The event logs read back, newest first within the budget, onto their jobs;
        the names of the files to remove (too old, deleted, over the budget)."""
        doomed = []
        for head, events, file_size in sorted(logs, key=lambda found: -found[0]["ended"]):
            name, size = head["id"], sum(map(len, events))
            if name in deleted or now - head["ended"] > LOG_KEPT or not events:
                doomed.append(name)
                continue
            if self.log_size + size > self.log_bytes:
                doomed.append(name)
                continue
            key = (head["scope"], name)
            job = self.jobs.get(key)
            if job is None:  # (a line that was not needed: a stored one's)
                job = self.jobs[key] = Job(name, head["scope"], head["status"], b"{}", True)
            if head["status"] in STORED:  # its line has no Response: the terminal event's
                job.response = _response_of(events[-1]) or job.response
            job.status, job.stream, job.ended = head["status"], True, head["ended"]
            job.log = EventLog()
            for event in events:
                job.log.append(event)
            job.log.close()
            self.log_size += size
            self.logs_on_disk[f"{name}.log"] = file_size
            self.logs_bytes += file_size
        return doomed

    async def close(self) -> None:
        flushing, self._flushing = self._flushing, None
        if flushing is not None:
            await cancel_and_wait(flushing)
        async with self._lock():
            await self._write_files()
        with contextlib.suppress(StorageUnavailable):  # (logged: the next start fails the rest)
            await self.commit()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        starting, self._starting = self._starting, None
        if starting is not None:
            await starting
        child, self._child = self._child, None
        if child is not None:
            child.close()
            await asyncio.to_thread(child.wait)


def _landing(flight: asyncio.Future[None]) -> asyncio.Future[None]:
    """A future that ends as `flight` does, whose cancel (a commit's caller cancelled)
    leaves `flight` be: `asyncio.shield`, for a future that only ever gets a result or
    an exception, at a third of its cost."""
    landing = flight.get_loop().create_future()
    flight.add_done_callback(partial(_landed_as, landing))
    return landing


def _landed_as(landing: asyncio.Future[None], flight: asyncio.Future[None]) -> None:
    if landing.done():  # (its commit was cancelled)
        return
    error = flight.exception()
    if error is not None:
        landing.set_exception(error)
    else:
        landing.set_result(None)


def _line(job: Job, response: bytes | None, status: str | None, *, inputs: bool = False) -> bytes:
    entry: dict[str, Any] = {"id": job.id, "scope": job.scope, "status": status or job.status}
    if job.stream:
        entry["stream"] = True
    if response is not None:
        entry["response"] = orjson.Fragment(response)
    if inputs and job.inputs is not None and job.durable:
        entry["own"] = orjson.Fragment(b"[" + job.inputs + b"]")
        if job.parent is not None:
            entry["parent"] = job.parent
    return orjson.dumps(entry) + b"\n"


def _response_of(event: bytes) -> bytes | None:
    """The Response an SSE event carries, re-encoded; None if it carries none."""
    try:
        payload = orjson.loads(event.partition(b"data: ")[2])
    except orjson.JSONDecodeError:
        return None
    found = payload.get("response") if type(payload) is dict else None
    return orjson.dumps(found) if type(found) is dict else None


def _open(path: Path) -> tuple[int, int]:
    """The file open for writes, and its size (where the next line goes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    return fd, os.fstat(fd).st_size


def _pwrite(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    os.fdatasync(fd)


def _write_logs(
    directory: Path, files: list[tuple[str, bytes | None, bool]]
) -> dict[str, int | None]:
    """Write each event log file, in order: a .log whole, a .part appended to; or, for
    None, remove it. Each file's size after, by its name (None: removed). Plain os calls:
    a Path and a file object per file cost more than the writing (one of these runs
    for every streamed turn)."""
    done: dict[str, int | None] = {}
    folder = os.fspath(directory)
    made = False
    for name, data, part in files:
        file_name = name + (PART if part else ".log")
        path = f"{folder}/{file_name}"
        if data is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            done[file_name] = None
            continue
        try:
            if not made and not os.path.isdir(folder):
                os.makedirs(folder, mode=0o700, exist_ok=True)
            made = True
            flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if part else os.O_TRUNC)
            fd = os.open(path, flags, 0o600)
            try:
                _write_all(fd, data)
                done[file_name] = os.lseek(fd, 0, os.SEEK_CUR)
            finally:
                os.close(fd)
        except OSError as exc:  # the stream is not resumable after a restart; nothing else
            log.warning("background event log %s not written: %s", name, exc)
    return done


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read(
    path: Path, logs: Path
) -> tuple[list[dict[str, Any]], list[Found], dict[str, list[bytes]]]:
    """background.jsonl's entries, each whole event log file (its header, events, its
    size), and the events of each .part, by id."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = b""
    entries = []
    for line in data.splitlines():
        try:  # (a hole left by a write that never landed reads as zeros)
            entry = orjson.loads(line.lstrip(b"\0"))
        except orjson.JSONDecodeError:  # a torn last line: the write never finished
            continue
        if type(entry) is dict and isinstance(entry.get("id"), str):
            entries.append(entry)
    found, parts = [], {}
    with contextlib.suppress(FileNotFoundError):
        for file in logs.iterdir():
            if file.name.endswith(PART):
                with contextlib.suppress(OSError):
                    parts[file.name.removesuffix(PART)] = _read_part(file.read_bytes())
                continue
            read = _read_log(file)
            if read is None:
                with contextlib.suppress(OSError):
                    file.unlink()
            else:
                found.append(read)
    return entries, found, parts


def _read_part(data: bytes) -> list[bytes]:
    """A .part's events, up to the first one a write did not finish (or never made)."""
    events, at = [], 0
    while at < len(data):
        line_end = data.find(b"\n", at)
        size = data[at:line_end]
        if line_end < 0 or not size.isdigit() or line_end + 1 + int(size) > len(data):
            break
        at = line_end + 1 + int(size)
        events.append(data[line_end + 1 : at])
    return events


def _read_log(file: Path) -> Found | None:
    try:
        data = file.read_bytes()
        head_line, _, body = data.partition(b"\n")
        head = orjson.loads(head_line)
        sizes = head["sizes"]
        if sum(sizes) != len(body) or file.name != f"{head['id']}.log":
            return None
        float(head["ended"]), str(head["scope"]), str(head["status"])
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    events, at = [], 0
    for size in sizes:
        events.append(body[at : at + size])
        at += size
    return head, events, len(data)


def _rewrite(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
