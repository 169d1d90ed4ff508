"""Background responses' bookkeeping on one node (store/background.py's `Backgrounds`):
in process memory and, on a durable store, in `background.jsonl` in the state dir: one
JSON line per status change (the Response with it only when the store will not hold the
final one: queued, failed, cancelled), fdatasynced in a thread by `commit`. At start
`load` folds the file, turns a response left queued or in progress by a process that
died into `failed` (`background_lost`), and rewrites the file with what is still kept."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from ocxproxy.metrics import Metrics
from ocxproxy.store.background import (
    IN_PROGRESS,
    LOG_KEPT,
    QUEUED,
    STORED,
    TERMINAL,
    EventLog,
    Job,
    lost_response,
)

log = logging.getLogger("ocxproxy.background")

FILE = "background.jsonl"
DELETED = "deleted"  # a journal line's status: the response was deleted


class LocalBackgrounds:
    """Background bookkeeping in process memory, journaled to `background.jsonl` when
    `state_dir` is given."""

    def __init__(
        self, metrics: Metrics, *, state_dir: Path | None, log_bytes: int, ttl: float
    ) -> None:
        self.metrics = metrics
        self.path = state_dir / FILE if state_dir is not None else None
        self.log_bytes = log_bytes
        self.ttl = ttl  # how long a response the store does not keep stays here
        self.jobs: dict[tuple[str, str], Job] = {}
        self.ended: deque[Job] = deque()  # terminal jobs, oldest first
        self.kept: deque[Job] = deque()  # failed or cancelled, their logs gone, until the TTL
        self.log_size = 0  # bytes of every event log kept
        self._pending: list[bytes] = []
        self._writing: asyncio.Lock | None = None
        self._fd: int | None = None  # background.jsonl, open for appends once written
        # Read through a weak reference: the gauges must not make a cycle of it.
        ref = weakref.ref(self)

        def count(status: str) -> Callable[[], float]:
            return lambda: float(b._count(status)) if (b := ref()) is not None else 0.0

        for status in (QUEUED, IN_PROGRESS):
            metrics.background_jobs.labels(status=status).set_function(count(status))
        metrics.background_log_bytes.set_function(
            lambda: float(b.log_size) if (b := ref()) is not None else 0.0
        )

    def _count(self, status: str) -> int:
        return sum(1 for job in self.jobs.values() if job.status == status)

    def open(self, job: Job) -> None:
        self._prune()
        self.jobs[job.scope, job.id] = job
        if job.stream:
            job.log = EventLog()
        self._journal(job, job.response)

    async def get(self, scope: str, response_id: str) -> Job | None:
        return self.jobs.get((scope, response_id))

    def append(self, job: Job, event: bytes) -> None:
        """An event of `job`'s stream (its sequence_number is the log's length)."""
        if job.log is None:
            return
        job.log.append(event)
        self.log_size += len(event)
        if self.log_size > self.log_bytes:
            self._prune(over_budget=True)

    def moved(self, job: Job, status: str, response: bytes | None = None) -> None:
        if job.terminal:
            return
        job.status = status
        if response is not None:
            job.response = response
        if status in TERMINAL:
            job.ended = time.time()
            job.task = None
            if job.log is not None:
                job.log.close()
            self.ended.append(job)
            self.metrics.background_finished.labels(status=status).inc()
        self._journal(job, None if status in STORED or status == IN_PROGRESS else job.response)

    def drop(self, job: Job) -> None:
        if self.jobs.pop((job.scope, job.id), None) is None:
            return
        for kept in (self.ended, self.kept):
            if job in kept:
                kept.remove(job)
        if job.log is not None:
            self.log_size -= job.log.size
            job.log.close()
            job.log = None
        self._journal(job, None, status=DELETED)

    def _journal(self, job: Job, response: bytes | None, *, status: str | None = None) -> None:
        if self.path is None:
            return
        entry: dict[str, Any] = {"id": job.id, "scope": job.scope, "status": status or job.status}
        if job.stream:
            entry["stream"] = True
        if response is not None:
            entry["response"] = orjson.Fragment(response)
        self._pending.append(orjson.dumps(entry) + b"\n")

    async def commit(self) -> None:
        if self.path is None or not self._pending:
            return
        if self._writing is None:
            self._writing = asyncio.Lock()
        async with self._writing:  # the lines queued meanwhile go in the next write
            lines, self._pending = self._pending, []
            if lines:
                if self._fd is None:
                    self._fd = await asyncio.to_thread(_open, self.path)
                await asyncio.to_thread(_append, self._fd, b"".join(lines))

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
                self.log_size -= job.log.size
                job.log = None
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
        """Fold the journal: a response left queued or in progress is failed now."""
        if self.path is None:
            return
        entries = await asyncio.to_thread(_read, self.path)
        now = time.time()
        lost = 0
        for entry in entries:
            key = (entry["scope"], entry["id"])
            if entry["status"] == DELETED:
                self.jobs.pop(key, None)
                continue
            job = self.jobs.get(key)
            if job is None:
                job = Job(
                    entry["id"], entry["scope"], entry["status"], b"{}", entry.get("stream", False)
                )
                self.jobs[key] = job
            job.status = entry["status"]
            if "response" in entry:
                job.response = orjson.dumps(entry["response"])
        for key, job in list(self.jobs.items()):
            if job.status in STORED:
                del self.jobs[key]
                continue
            if not job.terminal:
                job.status, job.response = "failed", lost_response(job.response)
                lost += 1
            job.ended = now
            self.kept.append(job)
        if lost:
            log.warning("%d background responses were left running by a stop: failed", lost)
            self.metrics.background_lost.inc(lost)
        lines = [
            orjson.dumps(
                {
                    "id": job.id,
                    "scope": job.scope,
                    "status": job.status,
                    "response": orjson.Fragment(job.response),
                }
            )
            + b"\n"
            for job in self.jobs.values()
        ]
        await asyncio.to_thread(_rewrite, self.path, b"".join(lines))

    async def close(self) -> None:
        await self.commit()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _open(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def _append(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fdatasync(fd)


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    entries = []
    for line in data.splitlines():
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:  # a torn last line: the write never finished
            continue
        if type(entry) is dict and isinstance(entry.get("id"), str):
            entries.append(entry)
    return entries


def _rewrite(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
