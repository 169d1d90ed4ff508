"""The committer: one task that appends the store's journal entries with group commit.

The store decides (synchronously, on the event loop) what must become durable and submits
journal entries here; the committer writes every entry queued since its last write with
one write and one fdatasync, then hands the outcome (where each entry landed, or the
error) back to the store, which applies it, and only then wakes the turns waiting for it.
Turns arriving while a write is in flight share the next one. This module never reads or
changes the store's index or segments: it sees opaque `subjects`.

How a commit is written: with the fsync helper (syncer.py), a small commit that fits the
journal file's allocated room is encoded on the loop and sent to the helper process,
which writes it there and fdatasyncs it while the next commits are sent (up to
MAX_FLIGHTS in flight, each down a lane of its own: here concurrent fdatasyncs of one
file took ~0.2 ms each where one at a time took ~4 ms under load). The loop never writes
to the file itself: a pwrite into the page cache stopped it for up to ~280 ms while the
disk was busy. A plain callback
(`call_soon`, not the committer task, whose wake-up cost ~30k instructions a commit)
cuts and sends the commit: with nothing in flight, once the callbacks the event loop
runs after the first entry's are done (a lone turn is never held back, and the turns
finishing in the same pass share its fsync), and so once a flight lands with entries
queued behind it; while commits are in flight, one more pass of the event loop later,
so the turns finishing in it join (at MAX_FLIGHTS, when the oldest lands). The helper's
answers are applied in its sockets' reader callback, with no task per commit. Outcomes are
applied in the order the commits were sent, each once its own answer and every earlier
one's have come (replay stops at the first gap, so a commit counts only with every
commit before it), and when one fails, every later one in flight fails with it and the
file is cut back to where the failed one began. The file's room grows ahead: once less
than GROW_BELOW is left, a thread allocates and syncs the next PREALLOCATE bytes while
commits go on (`Journal.grow`). An empty file (one a checkpoint just rotated to) has no
room: its first commit goes to the helper all the same, past the file's end (the
helper's fdatasync then syncs the new size too), and the room is made past it; a commit
that finds the growth under way and no room waits for it, then goes to the helper.
Anything else (a large commit, one with a segment that gets its own file, a file past
FILE_BYTES, room that could not be made, no helper, relaxed durability's window) is the
committer task's: it waits until no commit is in flight and no growth is under way, then
is encoded, written and synced in a thread (what the callback encoded on the loop before
finding it could not be sent is kept, not encoded again: a segment is compressed once).

The one asyncio.Lock `io` orders every write to the journal files: appends, rotation for a
checkpoint, and removal of files (`quiet()`: with no commit in flight). The room's growth
alone runs beside the helper's appends, into the room past theirs; every other change of
the file waits for it (`_quiesce`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ocxproxy.aio import spawn
from ocxproxy.store.local.journal import PREALLOCATE, Encoded, Journal
from ocxproxy.store.local.syncer import LANES, ChildGone, FsyncChild

log = logging.getLogger("ocxproxy.store")

Offload = Callable[..., Awaitable[Any]]

INLINE_BYTES = 64 * 1024  # segment bytes a commit may have to be encoded on the loop
MAX_FLIGHTS = LANES  # commits at the fsync helper at once: one down each lane
GROW_BELOW = PREALLOCATE // 2  # room left in the active file that starts its next growth


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


@dataclass(slots=True, eq=False)
class Flight:
    """A commit handed to the fsync helper, which writes and syncs it."""

    outcome: Outcome
    future: asyncio.Future[OSError | None]  # the turns'
    data: bytes  # its bytes (written again in a thread when the helper died)
    before: int  # where they begin in the active file
    synced: asyncio.Future[None]  # the helper's answer
    applied: asyncio.Future[None]  # its outcome is applied


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
        # The first entries of `_jobs`, encoded by `_cut` when they could not be sent at
        # once (a segment that gets its own file, no room): how many, and their encoding,
        # which the commit that takes them reuses (its segments are compressed once).
        self._encoded: tuple[int, Encoded] | None = None
        self._future: asyncio.Future[OSError | None] | None = None
        self._inflight: asyncio.Future[OSError | None] | None = None
        self._waiters: dict[asyncio.Future[OSError | None], list[asyncio.Future[Any]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._due: asyncio.Handle | None = None  # the callback that cuts the next commit
        self._flights: deque[Flight] = deque()  # oldest first
        self._slow: asyncio.Task[None] | None = None  # a landing that must wait (a thread)
        self._growing: asyncio.Task[None] | None = None  # the active file's next room
        self._dead = False  # stopped as a crash would: nothing lands any more
        self._broken: OSError | None = None  # a flight failed: the later ones fail with it
        self._cut_to = 0  # and then the file is cut back to where it began

    def __repr__(self) -> str:
        return f"<Committer queued={len(self._jobs)} {self.queued_bytes}B>"

    def start(self) -> None:
        if self._task is None:
            if self.child is not None:
                self.child.attach(self._loop)
                self.child.answered = self._answered
            self._task = spawn(self._run(), name="store-committer")

    async def stop(self, *, drain: bool) -> None:
        """Stop after writing what is queued (drain), or at once, as a crash would."""
        self._stopping = True
        self._wake.set()
        if self._task is None:
            return
        if not drain:
            self._dead = True
            self._task.cancel()
            if self._slow is not None:
                self._slow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._slow is not None:
            await asyncio.gather(self._slow, return_exceptions=True)
        if self._growing is not None:
            await asyncio.gather(self._growing, return_exceptions=True)
        self._task = None

    def submit(self, kind: int, job: Any, subject: Any, size: int = 0) -> asyncio.Future[Any]:
        """Queue one entry for the next commit; the future that commit resolves."""
        if self._future is None:
            self._future = self._loop.create_future()
            self.oldest = time.monotonic()
        self._jobs.append((kind, job))
        self._subjects.append(subject)
        self.queued_bytes += size
        if self._due is None:
            if self.child is None or self.window or self._stopping:
                self._wake.set()
            else:
                self._due = self._loop.call_soon(self._pass)
        return self._future

    def _pass(self) -> None:
        """The pass after a commit's first entry: with commits in flight (the disk is
        busy) the loop runs once more first, so the turns finishing meanwhile join it."""
        self._due = self._loop.call_soon(self._cut) if self._flights else None
        if self._due is None:
            self._cut()

    def _cut(self) -> None:
        """Send what is queued to the helper from a plain callback (waking a task costs
        ~30k instructions a commit); what cannot be sent so is the committer task's."""
        self._due = None
        child = self.child
        if not self._jobs or self._dead:
            return
        if (
            child is None
            or self._task is None  # not started: the task takes what is queued
            or self.window
            or self._stopping
            or self.io.locked()
            or self._broken is not None
            or self.queued_bytes > INLINE_BYTES
            or self._encoded is not None  # tried: the committer task writes it
        ):
            self._wake.set()
            return
        if len(self._flights) >= MAX_FLIGHTS:
            return  # the oldest flight's landing cuts it (`_landed`)
        encoded = self._encode()
        data, relative, own = encoded
        if not own and self.journal.takes(len(data)):
            self._fly(child, *self._take(), data, relative)
        else:
            self._encoded = (len(self._jobs), encoded)
            self._wake.set()

    def _encode(self) -> Encoded:
        """Everything queued, encoded on the loop (what `_cut` encoded before, reused)."""
        done = self._encoded
        if done is None:
            return self.journal.encode(self._jobs)
        n, encoded = done
        return encoded if n == len(self._jobs) else self.journal.encode(self._jobs[n:], encoded)

    def waiter(self, future: asyncio.Future[OSError | None]) -> asyncio.Future[OSError | None]:
        """A future of one turn's own, resolved with the commit `future` stands for. Unlike
        `asyncio.shield(future)` it is resolved by the commit itself, not by a callback a
        pass of the event loop later (a pass less a turn); cancelling it leaves the
        commit and the other turns in it alone."""
        if future.done():
            return future
        mine: asyncio.Future[OSError | None] = self._loop.create_future()
        self._waiters.setdefault(future, []).append(mine)
        return mine

    def pending(self) -> asyncio.Future[OSError | None] | None:
        """The future of the last commit holding anything submitted so far (None: all done)."""
        return self._future or self._inflight

    async def _run(self) -> None:
        while True:
            if not self._jobs:
                if self._stopping:
                    await self._quiesce()
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._flights and not self._stopping:
                # Commits are in flight (the disk is busy): the loop runs once more first,
                # so the turns finishing meanwhile share this commit's fsync.
                await asyncio.sleep(0)
            if self.window and not self._stopping:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.window):
                        while not self._stopping:
                            self._wake.clear()
                            await self._wake.wait()
            await self._start()

    async def write(self) -> None:
        """Commit everything queued now; returns once it is durable (or failed)."""
        future = await self._start()
        if future is not None:
            await asyncio.shield(future)

    async def _start(self) -> asyncio.Future[OSError | None] | None:
        """Write everything queued now: through the helper (in flight when this returns)
        or in a thread (done when this returns). The future its turns wait on."""
        async with self.io:
            while self._broken is not None or len(self._flights) >= MAX_FLIGHTS:
                await asyncio.shield(self._flights[0].applied)
            if not self._jobs:
                return None
            raw = self.queued_bytes
            journal, child = self.journal, self.child
            encoded = None
            if child is not None and raw <= INLINE_BYTES:
                encoded = self._encode()
            done = self._encoded
            outcome, future = self._take()
            if child is not None and encoded is not None:
                data, relative, own = encoded
                if not own and not journal.takes(len(data)) and self._growing is not None:
                    await self._grown()  # the room it needs is being made: the helper's then
                if not own and journal.takes(len(data)) and self._broken is None:
                    self._fly(child, outcome, future, data, relative)
                    return future
            await self._quiesce()
            pack, before = journal.active, journal.size
            try:
                if encoded is not None:
                    outcome.places = await self.offload(journal.write, *encoded)
                elif done is not None:  # the rest encoded in the thread, after `_cut`'s
                    n, first = done
                    outcome.places = await self.offload(journal.append, outcome.jobs[n:], first)
                else:
                    outcome.places = await self.offload(journal.append, outcome.jobs)
            except OSError as exc:
                outcome.error = exc
            else:
                outcome.pack, outcome.size = journal.active, journal.size
                outcome.written = journal.size - (before if journal.active == pack else 0)
            self._finish(outcome, future)
            return future

    def _take(self) -> tuple[Outcome, asyncio.Future[OSError | None]]:
        """Everything queued, as the next commit, and the future its turns wait on."""
        outcome, future = Outcome(self._jobs, self._subjects), self._future
        assert future is not None
        self._jobs, self._subjects, self._future = [], [], None
        self._encoded = None
        self.queued_bytes, self.oldest = 0, None
        self._inflight = future
        return outcome, future

    def _fly(
        self,
        child: FsyncChild,
        outcome: Outcome,
        future: asyncio.Future[OSError | None],
        data: bytes,
        relative: list[Any],
    ) -> None:
        """Hand a commit to the helper, to be written in the file's room and synced; its
        outcome is applied (`_answered`) once it and every earlier flight are answered."""
        journal = self.journal
        before = journal.size
        outcome.places = journal.claim(data, relative)
        synced: asyncio.Future[None]
        try:
            synced = child.write(journal.fd, journal.active, data, before)
        except ChildGone as exc:
            synced = self._loop.create_future()
            synced.set_exception(exc)
        outcome.pack, outcome.size = journal.active, journal.size
        outcome.written = journal.size - before
        flight = Flight(outcome, future, data, before, synced, self._loop.create_future())
        self._flights.append(flight)
        synced.add_done_callback(self._answered)
        if journal.room() < GROW_BELOW and self._growing is None and not self._stopping:
            self._growing = spawn(self._grow(journal.active, journal.end()), name="store-grow")

    async def _grow(self, pack: int, at: int) -> None:
        """The active file's next room from `at`, allocated in a thread while commits go
        on (a commit that found no room would wait for every flight to land, then grow the
        file and sync it in a thread). A failure is left to the next commit that does not
        fit to meet: it goes through the thread, which allocates the room itself."""
        try:
            await self.offload(self.journal.grow, pack, at)
        except OSError as exc:
            log.debug("journal room not grown ahead: %s", exc)
        finally:
            self._growing = None

    def _answered(self, _: object = None) -> None:
        """Land the answered flights at the front, in order, right away: called by the
        helper's reader as soon as answers arrive (a pass earlier than a task would), and
        when a flight's future is done. What must wait (a sync in a thread once the helper
        died, cutting the file back) lands in a task, and the later flights after it."""
        flights = self._flights
        while flights and self._slow is None and not self._dead:
            flight = flights[0]
            synced = flight.synced
            if not synced.done():
                return
            error = None if synced.cancelled() else synced.exception()
            if synced.cancelled() or isinstance(error, ChildGone):
                self._slow = spawn(self._land_slowly(flight, True), name="store-commit")
                return
            if error is not None and not isinstance(error, OSError):
                error = OSError(errno.EIO, repr(error))
            self._judge(flight, error)
            if self._broken is not None and len(flights) == 1:
                self._slow = spawn(self._land_slowly(flight, False), name="store-commit")
                return
            self._landed(flight)

    async def _land_slowly(self, flight: Flight, resync: bool) -> None:
        if resync:  # the helper died: write and sync in a thread (again is harmless)
            self.child = None
            error: OSError | None = None
            try:
                await self.offload(self.journal.rewrite, flight.data, flight.before)
            except OSError as exc:
                error = exc
            self._judge(flight, error)
        try:
            if self._broken is not None and len(self._flights) == 1:
                await self._grown()
                await self.offload(self.journal.cut_back, self._cut_to)
        finally:
            self._slow = None
            if not self._dead:
                self._landed(flight)
        self._answered()

    def _judge(self, flight: Flight, error: OSError | None) -> None:
        """A flight's sync answered `error` (or None): it fails when it did, or when an
        earlier one did (its bytes follow the failed commit's: they are cut back too)."""
        if self._broken is not None:
            error = error or self._broken
        elif error is not None:
            self._broken, self._cut_to = error, flight.before
        if error is not None:
            flight.outcome.error, flight.outcome.places = error, None

    def _landed(self, flight: Flight) -> None:
        assert self._flights[0] is flight
        self._flights.popleft()
        if not self._flights:
            self._broken = None
        self._finish(flight.outcome, flight.future)
        flight.applied.set_result(None)
        if self._jobs and self._due is None:  # queued meanwhile: the helper need not idle
            self._due = self._loop.call_soon(self._cut)

    def _finish(self, outcome: Outcome, future: asyncio.Future[OSError | None]) -> None:
        try:
            self.apply(outcome)
        except Exception:  # never leave a waiting turn hanging
            log.exception("applying a journal commit failed")
        if self._inflight is future:
            self._inflight = None
        if not future.done():
            future.set_result(outcome.error)
        for waiter in self._waiters.pop(future, ()):
            if not waiter.done():
                waiter.set_result(outcome.error)

    async def _quiesce(self) -> None:
        """Until every commit in flight is applied, and the file's growth is done."""
        while self._flights:
            await asyncio.shield(self._flights[-1].applied)
        await self._grown()

    async def _grown(self) -> None:
        """Until a growth under way is done: nothing else changes the file meanwhile."""
        if self._growing is not None:
            await asyncio.gather(asyncio.shield(self._growing), return_exceptions=True)

    @contextlib.asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """Hold the journal files still: no commit is written or in flight meanwhile."""
        async with self.io:
            await self._quiesce()
            yield

    async def run_locked(self, fn: Callable[..., Any], /, *args: Any) -> Any:
        """Run a blocking journal mutation (rotate, remove) between commits."""
        async with self.quiet():
            return await self.offload(fn, *args)
