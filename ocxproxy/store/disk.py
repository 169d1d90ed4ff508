"""The disk tier: spill files, the snapshot, and the one writer task that changes them.

Decide, then do: the store changes its index synchronously and hands this tier segments
to write (`enqueue`) or files to drop (`discard`); the writer task performs all disk
mutations one at a time, in a thread, and applies their results back on the event loop.
Because a single task writes, renames and unlinks, no write races an unlink of the same
file. Order of durability, so a crash never leaves the snapshot pointing at a lost file:
  1. a segment counts as on disk only after its file and directory are fsynced;
  2. a snapshot is written only after every segment it references is on disk;
  3. a file is unlinked only after a snapshot captured *after* it was dropped is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ocxproxy.aio import spawn
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import Record, Segment
from ocxproxy.store import files, snapshot
from ocxproxy.store.resident import ResidentTier
from ocxproxy.store.spill import Scan, SpillDir

log = logging.getLogger("ocxproxy.store")

Offload = Callable[..., Awaitable[Any]]

BATCH_SEGMENTS = 64
BATCH_BYTES = 8 * 1024**2


@dataclass(slots=True)
class Opened:
    """What start-up found in the state dir."""

    index: snapshot.Index | None
    error: snapshot.SnapshotError | None
    scan: Scan
    root_temps: list[Path] = field(default_factory=list)


@dataclass(slots=True)
class _SnapshotOutcome:
    written: list[tuple[Segment, int | StoreFailure]]
    records: int = 0
    error: snapshot.SnapshotError | None = None


class DiskTier:
    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        snapshot_delay: float,
        metrics: Metrics,
        clock: Callable[[], float],
        offload: Offload,
        index: dict[str, Segment],
        resident: ResidentTier,
        durable_records: Callable[[], list[Record]],
    ) -> None:
        self.root = root
        self.spill = SpillDir(root / "spill")
        self.max_bytes = max_bytes
        self.snapshot_delay = snapshot_delay
        self.metrics = metrics
        self.clock = clock
        self.offload = offload
        self.enabled = False  # the dir is ours and usable (set by open)
        self.files: OrderedDict[str, Segment] = OrderedDict()  # on disk, oldest first
        self.bytes = 0
        self.pending: OrderedDict[str, Segment] = OrderedDict()  # demoted, not yet written
        self.pending_bytes = 0
        self._progress = asyncio.Event()  # set (and replaced) after each written batch
        self.doomed: dict[str, tuple[int, int, bool]] = {}  # key -> (capture, size, reusable)
        self.captures = 0
        self.dirty_at: float | None = None  # monotonic time of the first unsaved change
        self.last_snapshot: float | None = None
        self._index = index
        self._resident = resident
        self._durable_records = durable_records
        self._lock = files.DirLock(root)
        self._wake = asyncio.Event()
        self._io = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        metrics.snapshot_age.set_function(self._snapshot_age)

    def __repr__(self) -> str:
        return (
            f"<DiskTier {len(self.files)} files {self.bytes}/{self.max_bytes}B "
            f"pending={len(self.pending)} doomed={len(self.doomed)} captures={self.captures}>"
        )

    def _snapshot_age(self) -> float:
        return 0.0 if self.last_snapshot is None else max(0.0, self.clock() - self.last_snapshot)

    # -- start and stop ----------------------------------------------------------------

    def open(self) -> Opened | None:
        """Blocking: take the dir, read the snapshot, list the files. None: run memory-only."""
        try:
            files.ensure_root(self.root)
            if not self._lock.acquire():
                self._unusable("locked", "in use by another ocxproxy process")
                return None
            self.spill.prepare()
        except OSError as exc:
            self._lock.release()
            self._unusable("unsafe", str(exc))
            return None
        index: snapshot.Index | None = None
        error: snapshot.SnapshotError | None = None
        try:
            index = snapshot.load(self.root)
        except snapshot.SnapshotError as exc:
            error = exc
        scan = self.spill.scan()
        temps = [p for p in self.root.iterdir() if files.is_temp_name(p.name)]
        self.enabled = True
        if index is not None:
            self.last_snapshot = index.written_at
        return Opened(index, error, scan, temps)

    def _unusable(self, reason: str, detail: str) -> None:
        self.metrics.snapshot_failures.labels(reason=reason).inc()
        log.error("state dir %s unusable (%s): running memory-only", self.root, detail)

    def sweep(self, opened: Opened, keep: set[str]) -> int:
        """Blocking: remove temp files, stray links and (when the index was readable)
        spill files no record needs. Returns how many entries went."""
        doomed = [*opened.root_temps, *opened.scan.temps, *opened.scan.unsafe]
        if opened.error is None:
            doomed += [self.spill.path(k) for k in opened.scan.files if k not in keep]
        removed = 0
        for path in doomed:
            with contextlib.suppress(OSError):  # a directory in the way stays, logged below
                path.unlink()
                removed += 1
        if removed < len(doomed):
            log.warning("state dir: %d entries could not be removed", len(doomed) - removed)
        return removed

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = spawn(self._run(), name="store-writer")

    async def close(self) -> None:
        """Stop the writer, then write everything out and the final snapshot."""
        await self._stop()
        if self.enabled:
            await self.flush()
            self._lock.release()
            self.enabled = False

    async def abandon(self) -> None:
        """Stop without writing anything more, as a crash would (for tests)."""
        await self._stop()
        self._lock.release()
        self.enabled = False

    async def _stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    # -- what the store asks for (synchronous: decide now, do later) ----------------------

    def enqueue(self, segment: Segment) -> None:
        if segment.key not in self.pending:
            self.pending[segment.key] = segment
            self.pending_bytes += segment.size
        self._wake.set()

    def discard(self, segment: Segment, *, reusable: bool = True) -> None:
        """The segment no longer keeps its file; it goes after the next snapshot."""
        if self.files.get(segment.key) is segment:
            del self.files[segment.key]
            self.bytes -= segment.disk_size
            self._doom(segment.key, segment.disk_size, reusable)
        segment.on_disk = False

    def resurrect(self, segment: Segment) -> bool:
        """Take back a dropped file whose deletion has not happened yet."""
        entry = self.doomed.get(segment.key)
        if entry is None or not entry[2]:
            return False
        del self.doomed[segment.key]
        self._add_file(segment, entry[1])
        return True

    def mark_dirty(self) -> None:
        if self.dirty_at is None:
            self.dirty_at = time.monotonic()
            self._wake.set()

    def _doom(self, key: str, size: int, reusable: bool) -> None:
        self.doomed[key] = (self.captures, size, reusable)
        self.mark_dirty()

    def _add_file(self, segment: Segment, size: int) -> None:
        self.doomed.pop(segment.key, None)
        if self.files.get(segment.key) is segment:
            self.bytes -= segment.disk_size
        segment.on_disk, segment.disk_size, segment.lost = True, size, None
        self.files[segment.key] = segment
        self.files.move_to_end(segment.key)
        self.bytes += size

    # -- the writer --------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            delay = self._idle_delay()
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                continue
            try:
                async with self._io:
                    if self.pending:
                        await self._write_pending()
                    else:
                        await self._snapshot()
            except Exception:  # never let the writer die; the next change retries
                log.exception("store writer step failed")
                self.dirty_at = time.monotonic()
                await asyncio.sleep(min(1.0, self.snapshot_delay + 0.01))

    def _idle_delay(self) -> float | None:
        if self.pending:
            return 0.0
        if self.dirty_at is None:
            return None
        return max(0.0, self.dirty_at + self.snapshot_delay - time.monotonic())

    async def flush(self) -> bool:
        """Write every pending segment and a snapshot now; True when it is durable."""
        if not self.enabled:
            return False
        async with self._io:
            while self.pending:
                await self._write_pending()
            return await self._snapshot()

    async def _write_pending(self) -> None:
        batch: list[Segment] = []
        size = 0
        while self.pending and len(batch) < BATCH_SEGMENTS and size < BATCH_BYTES:
            _, segment = self.pending.popitem(last=False)
            self.pending_bytes -= segment.size
            batch.append(segment)
            size += segment.size
        jobs: list[tuple[Segment, bytes]] = []
        for segment in batch:
            data = segment.data
            if self._index.get(segment.key) is not segment or data is None:
                continue  # dropped meanwhile
            if not segment.durable:  # its durable records went meanwhile: not to disk
                self._evict(segment)
                continue
            if segment.on_disk:
                self._release(segment)
            else:
                jobs.append((segment, data))
        if jobs:
            results = await self.offload(self.spill.write_many, [(s.key, d) for s, d in jobs])
            for (segment, _), result in zip(jobs, results, strict=True):
                self._written(segment, result, release=True)
        self._enforce_cap()
        self._progress.set()
        self._progress = asyncio.Event()

    async def wait_progress(self) -> None:
        """Until the writer has finished its next batch."""
        await self._progress.wait()

    def _release(self, segment: Segment) -> None:
        if segment.key not in self._resident:  # read again meanwhile: keep it resident
            segment.data = None

    def _evict(self, segment: Segment) -> None:
        """A demoted segment that may not be written: its bytes go, unless read again."""
        if segment.key not in self._resident:
            segment.data = None
            segment.lost = str(FailureReason.EVICTED)

    def _written(self, segment: Segment, result: int | StoreFailure, *, release: bool) -> None:
        current = self._index.get(segment.key)
        if isinstance(result, int):
            self.metrics.spill_writes.inc()
            if current is None or not current.durable:  # dropped, or no durable holder now
                self._doom(segment.key, result, True)
                if release and current is segment:
                    self._evict(segment)
                return
            if not current.on_disk:
                self._add_file(current, result)
            if current is segment and not segment.n_items and segment.key in self._resident:
                # A response object (no items): only GET /v1/responses/{id} reads it, so
                # once its file is durable it leaves memory to the hot chain segments.
                self._resident.remove(segment)
                release = True
            if release and current is segment:
                self._release(segment)
            return
        self.metrics.spill_failures.labels(reason=str(result.reason)).inc()
        log.warning("spill write failed for segment %s: %s", segment.key[:12], result.detail)
        if release and current is segment and segment.key not in self._resident:
            segment.data = None
            segment.lost = str(FailureReason.WRITE_FAILED)

    def _enforce_cap(self) -> None:
        while self.bytes > self.max_bytes and self.files:
            _, segment = self.files.popitem(last=False)
            self.bytes -= segment.disk_size
            self._doom(segment.key, segment.disk_size, False)
            segment.on_disk = False
            if segment.data is None:
                segment.lost = str(FailureReason.EVICTED)
            self.metrics.store_evictions.labels(reason="disk_bytes").inc()

    async def _snapshot(self) -> bool:
        self.captures += 1
        capture = self.captures
        self.dirty_at = None
        records = self._durable_records()
        outcome: _SnapshotOutcome = await self.offload(self._snapshot_job, records, self.clock())
        for segment, result in outcome.written:
            self._written(segment, result, release=False)
        self._enforce_cap()
        if outcome.error is not None:
            self.metrics.snapshot_failures.labels(reason=outcome.error.reason).inc()
            log.warning("snapshot not written: %s", outcome.error)
            self.dirty_at = time.monotonic()
            return False
        self.metrics.snapshot_writes.inc()
        self.last_snapshot = self.clock()
        log.debug("snapshot %d: %d records", capture, outcome.records)
        gone = [key for key, (tag, _, _) in self.doomed.items() if tag < capture]
        for key in gone:
            del self.doomed[key]
        if gone:
            await self.offload(self.spill.remove_many, gone)
        return True

    def _snapshot_job(self, records: Sequence[Record], now: float) -> _SnapshotOutcome:
        """In the writer's thread: put every referenced segment on disk, then the index.

        Reads segment flags the loop may flip concurrently; that is safe because only this
        task sets `on_disk` or unlinks, and unlinks wait for a later capture (rule 3).
        """
        needed: dict[str, tuple[Segment, bytes]] = {}

        def ready(segment: Segment) -> bool:
            """On disk, or its bytes are in hand to be written now."""
            if segment.size == 0 or segment.on_disk or segment.key in needed:
                return True
            data = segment.data
            if data is None or not segment.durable:
                return False
            needed[segment.key] = (segment, data)
            return True

        # Whether a chain can be written, by its segments: a child's chain is its parent's
        # plus one segment, so most records check one (see snapshot.encode).
        chain_ready: dict[tuple[Segment, ...], bool] = {}
        included: list[Record] = []
        for record in records:
            chain = record.segments
            ok = chain_ready.get(chain)
            if ok is None:
                prefix = chain_ready.get(chain[:-1]) if len(chain) > 1 else None
                if prefix is None:
                    ok = all(ready(segment) for segment in chain)
                else:
                    ok = prefix and ready(chain[-1])
                chain_ready[chain] = ok
            if ok and ready(record.response):
                included.append(record)
        todo = list(needed.values())
        results = self.spill.write_many([(s.key, d) for s, d in todo])
        outcome = _SnapshotOutcome([(s, r) for (s, _), r in zip(todo, results, strict=True)])
        failed = {s.key for (s, _), r in zip(todo, results, strict=True) if not isinstance(r, int)}
        if failed:
            included = [
                r for r in included if not any(s.key in failed for s in (*r.segments, r.response))
            ]
        blob, outcome.records = snapshot.encode(included, now)
        try:
            snapshot.write(self.root, blob)
        except snapshot.SnapshotError as exc:
            outcome.error = exc
        return outcome

    # -- reads -------------------------------------------------------------------------

    async def read(self, segments: Sequence[Segment]) -> list[bytes | StoreFailure]:
        return list(await self.offload(self.spill.read_many, [(s.key, s.size) for s in segments]))
