"""The committer: one task that appends the store's journal entries with group commit.

The store decides (synchronously, on the event loop) what must become durable and submits
journal entries here; the committer writes every entry queued since its last write with
one write and one fdatasync, then hands the outcome (where each entry landed, or the
error) back to the store, which applies it, and only then wakes the turns waiting for it.
Turns arriving while a write is in flight share the next one. This module never reads or
changes the store's index or segments: it sees opaque `subjects`.

How a commit is written: with the fsync helper (syncer.py), a small commit that fits the
journal file's allocated room is encoded and written into the page cache on the loop, and
the helper process fdatasyncs it; anything else (a large commit, a file to grow or to
open, no helper) is encoded, written and synced in a thread.

The one asyncio.Lock `io` orders every mutation of the journal files: appends, rotation
for a checkpoint, and removal of files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ocxproxy.aio import spawn
from ocxproxy.store.journal import Journal, encode
from ocxproxy.store.syncer import ChildGone, FsyncChild

log = logging.getLogger("ocxproxy.store")

Offload = Callable[..., Awaitable[Any]]

INLINE_BYTES = 64 * 1024  # segment bytes a commit may have to be encoded on the loop


@dataclass(slots=True)
class Outcome:
    """One commit: its entries, what each was for, and where they landed or why not."""

    jobs: list[tuple[int, Any]]
    subjects: list[Any]
    places: list[Any] | None = None  # per job: (pack, offset, length) of a SEG, else None
    pack: int = 0  # the file written, and its size after
    size: int = 0
    written: int = 0  # bytes appended
    error: OSError | None = None


class Committer:
    def __init__(
        self,
        journal: Journal,
        *,
        offload: Offload,
        apply: Callable[[Outcome], None],
        window: float = 0.0,
        child: FsyncChild | None = None,
    ) -> None:
        self.journal = journal
        self.child = child  # the fsync helper, while it works
        self.offload = offload
        self.apply = apply
        self.window = window  # relaxed durability: gather this long before each write
        self.io = asyncio.Lock()
        self._loop = asyncio.get_running_loop()  # put() may run outside it (tests)
        self.queued_bytes = 0
        self.oldest: float | None = None  # monotonic time of the oldest queued entry
        self._jobs: list[tuple[int, Any]] = []
        self._subjects: list[Any] = []
        self._future: asyncio.Future[OSError | None] | None = None
        self._inflight: asyncio.Future[OSError | None] | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def __repr__(self) -> str:
        return f"<Committer queued={len(self._jobs)} {self.queued_bytes}B>"

    def start(self) -> None:
        if self._task is None:
            if self.child is not None:
                self.child.attach(self._loop)
            self._task = spawn(self._run(), name="store-committer")

    async def stop(self, *, drain: bool) -> None:
        """Stop after writing what is queued (drain), or at once, as a crash would."""
        self._stopping = True
        self._wake.set()
        if self._task is None:
            return
        if not drain:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    def submit(self, kind: int, job: Any, subject: Any, size: int = 0) -> asyncio.Future[Any]:
        """Queue one entry for the next commit; the future that commit resolves."""
        if self._future is None:
            self._future = self._loop.create_future()
            self.oldest = time.monotonic()
        self._jobs.append((kind, job))
        self._subjects.append(subject)
        self.queued_bytes += size
        self._wake.set()
        return self._future

    def pending(self) -> asyncio.Future[OSError | None] | None:
        """The future of the last commit holding anything submitted so far (None: all done)."""
        return self._future or self._inflight

    async def _run(self) -> None:
        while True:
            if not self._jobs:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.window and not self._stopping:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.window):
                        while not self._stopping:
                            self._wake.clear()
                            await self._wake.wait()
            await self.write()

    async def write(self) -> None:
        """Commit everything queued now (one write + one fsync)."""
        async with self.io:
            if not self._jobs:
                return
            outcome = Outcome(self._jobs, self._subjects)
            future, raw = self._future, self.queued_bytes
            self._jobs, self._subjects, self._future = [], [], None
            self.queued_bytes, self.oldest = 0, None
            self._inflight = future
            journal = self.journal
            pack, before = journal.active, journal.size
            try:
                outcome.places = await self._commit(outcome.jobs, raw)
            except OSError as exc:
                outcome.error = exc
            else:
                outcome.pack, outcome.size = journal.active, journal.size
                outcome.written = journal.size - (before if journal.active == pack else 0)
            try:
                self.apply(outcome)
            except Exception:  # never leave a waiting turn hanging
                log.exception("applying a journal commit failed")
            if self._inflight is future:
                self._inflight = None
            if future is not None and not future.done():
                future.set_result(outcome.error)

    async def _commit(self, jobs: list[tuple[int, Any]], raw: int) -> list[Any]:
        """Write and sync one commit; per job, where a SEG's blob landed."""
        journal, child = self.journal, self.child
        if child is None or raw > INLINE_BYTES:
            places: list[Any] = await self.offload(journal.append, jobs)
            return places
        data, relative = encode(jobs)
        if len(data) > journal.room():
            places = await self.offload(journal.write, data, relative)
            return places
        before = journal.size
        try:
            places = journal.write_unsynced(data, relative)
            try:
                await child.sync(journal.fd, journal.active)
            except ChildGone:
                self.child = None
                await self.offload(journal.sync)
        except OSError:
            await self.offload(journal.cut_back, before)
            raise
        return places

    async def run_locked(self, fn: Callable[..., Any], /, *args: Any) -> Any:
        """Run a blocking journal mutation (rotate, remove) between commits."""
        async with self.io:
            return await self.offload(fn, *args)
