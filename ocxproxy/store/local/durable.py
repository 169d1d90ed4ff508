"""The disk side of a store with a state dir (`Durable`): the directory's lock, the
journal, its committer (committer.py), the checkpoint and the maintenance that schedules it,
and whether the disk takes writes (`available`).

It owns no record and no segment state: it is given work (entries to commit, a checkpoint
to write) and hands outcomes back through narrow calls: the committer's to `apply` (the
Ledger's) after its own accounting, start-up's and the disk cap's to the store,
compaction's and the checkpoint's to the SegmentTable.

The checkpoint (journal.py) is the index at a journal position; it is written when the
journal since the last one passes `checkpoint_bytes` (or the checkpoint's own size, up to
twice that: `checkpoint_after`) or `checkpoint_age`, encoded in
chunks between which the event loop runs. Journal files before the checkpoint that hold
few live segments are compacted (their live segments re-appended, and the live responses
their records' entries hold, each as an RSP entry) and then removed; a journal file is
removed only when a checkpoint captured after its last live segment or response left it
is durable, and so is a large segment's own file (segment_files.py) after its segment
left; compaction never copies those.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import operator
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

import orjson

from ocxproxy import heap
from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.config import ConfigError
from ocxproxy.errors import FailureReason
from ocxproxy.metrics import Metrics
from ocxproxy.model import Record, Segment, unplace
from ocxproxy.store.local import files, journal, segment_files, stateformat
from ocxproxy.store.local.codec import NOP, RSP, Loaded
from ocxproxy.store.local.committer import Committer, Offload, Outcome
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.segments import SegmentTable
from ocxproxy.store.local.syncer import FsyncChild
from ocxproxy.store.local.upkeep import (
    CAP_BACKOFF,
    CAP_GAP,
    COMPACT_BATCH,
    COMPACT_BELOW,
    COMPACT_BYTES,
    DISK_KEEP,
    DISK_LOW,
    MAINTAIN_EVERY,
    SCAN,
    ChunkRows,
    FileRows,
    Pacer,
    encode_checkpoint,
)

log = logging.getLogger("ocxproxy.store")

LOG_EVERY = 10.0  # seconds between repeated write-failure warnings
_OFFSET = operator.attrgetter("offset")
_FIX = "or choose another --state-dir (--zdr is the mode that keeps nothing on disk)"


class StateDirUnusable(ConfigError):
    """The state dir cannot be taken at start-up: the proxy refuses to start rather than
    acknowledge turns a restart would lose."""


class Owner(Protocol):
    """What the disk side asks of the store that owns the records."""

    def __len__(self) -> int: ...

    def restore(self, loaded: Loaded) -> None:
        """Build the records and segments start-up read."""

    async def evict_for_disk(self, target: float, limit: float, per_record: float) -> bool:
        """Drop whole chains, the least recently extended first, until live segments and
        the next checkpoint (`per_record` bytes a record) take `target` bytes (the newest
        chain only while they take more than `limit`); True when they still take more
        than `limit` with nothing more to drop."""

    def record(self, record_id: str) -> Record | None:
        """The live record of this id."""

    def checkpoint_view(self) -> tuple[list[Record], list[tuple[int, int]], set[str]]:
        """Every record, oldest first, the number and count of each chunk of that order
        (records.Records), and the ids whose PUT is not committed yet: a checkpoint names
        the durable ones but those (filtered while encoding, not all at once here)."""

    def unchanged(self, number: int, count: int, since: int) -> bool:
        """Chunk `number` of the records' order still holds `count` records, and none
        changed its checkpoint row in place (or lost a segment) at or after capture
        `since` (records.Records.unchanged)."""


class Durable:
    def __init__(
        self,
        root: Path,
        owner: Owner,
        table: SegmentTable,
        apply: Callable[[Outcome], None],
        *,
        metrics: Metrics,
        clock: Callable[[], float],
        offload: Offload,
        window: float,
        max_disk_bytes: int,
        checkpoint_bytes: int,
        checkpoint_age: float,
        fsync_child: bool = False,
        make_parents: bool = True,
        large_segment_bytes: int = segment_files.LARGE,
    ) -> None:
        self.root = root
        self.large = large_segment_bytes  # compressed bytes that get a segment its own file
        self.make_parents = make_parents  # else a missing parent is refused (a typo?)
        self.owner = owner
        self.table = table
        self.apply = apply  # a commit's outcome, to the records and segments
        self.metrics = metrics
        self.clock = clock
        self.offload = offload
        self.window = window
        self.max_disk_bytes = max_disk_bytes
        self.checkpoint_bytes = checkpoint_bytes
        self.checkpoint_age = checkpoint_age
        self.fsync_child = fsync_child  # sync commits in a helper process (syncer.py)
        self.child: FsyncChild | None = None
        self.others: list[Callable[[], int]] = []  # bytes of others' files (Store.count_on_disk)
        self.journal: Journal | None = None
        self.committer: Committer | None = None
        self._lock: files.DirLock | None = None
        self._maintainer: asyncio.Task[None] | None = None
        self.replay_from = (0, 0)  # the durable checkpoint's journal position
        self.checkpoint_size = 0
        self.checkpoint_records = 0  # the records it names
        # The checkpoint file's rows of each journal file and of each chunk of the records'
        # order, and the capture it was taken at: the next checkpoint copies those of
        # files and chunks unchanged since (upkeep.encode_checkpoint).
        self.rows: dict[int, FileRows] = {}
        self.record_rows: dict[int, ChunkRows] = {}
        self.rows_capture = 0
        self.since_checkpoint = 0  # journal bytes appended since the checkpoint's position
        self.dirty_at: float | None = None  # monotonic: oldest change not in the checkpoint
        self._wanted = asyncio.Event()  # maintenance has work (checkpoint, cap)
        self._checkpointing = asyncio.Lock()
        self.available = True
        # The disk cap cannot be met by evicting: new turns are refused (Store.put) until
        # the store is back under it. Checkpoints the cap calls for wait until `_cap_next`.
        self.full = False
        self._cap_wait = CAP_GAP
        self._cap_next = 0.0  # monotonic
        self._failures_unlogged = 0
        self._logged_at = 0.0

    # -- lifecycle -----------------------------------------------------------------------

    async def load(self) -> None:
        """Take the dir, load the checkpoint and replay the journal into the store (every
        intact chain), then start the committer and the maintainer. StateDirUnusable when
        the dir cannot be taken."""
        started = time.monotonic()
        # The fsync helper starts (~30-60 ms, most of it its interpreter's) meanwhile.
        helper = asyncio.ensure_future(self.offload(FsyncChild.spawn)) if self.fsync_child else None
        gc.disable()  # reading builds the objects the index keeps (see below)
        try:
            j, loaded = await self.offload(self._open, self.root)
        except BaseException:
            gc.enable()
            await self._discard(helper)
            raise
        self.journal = j
        if loaded.error is not None:
            self.metrics.snapshot_failures.labels(reason="corrupt").inc()
            log.error("checkpoint unusable (%s): replaying the whole journal", loaded.error)
        if loaded.cut:
            self.metrics.journal_cut.inc(loaded.cut)
            log.warning("journal: cut %d torn or corrupt tail(s) at %s", loaded.cut, loaded.cut_at)
        # Building 100,000s of long-lived objects at once: the cyclic GC would rescan them
        # all, several times over, for nothing (none of them is garbage, none is in a
        # cycle); frozen, later collections (each a pause of the event loop) skip them.
        gc.disable()
        try:
            self.owner.restore(loaded)
            loaded.records.clear()
            loaded.segments.clear()
            gc.freeze()
        finally:
            gc.enable()
        self._restored(loaded)
        self.checkpoint_records = len(self.owner)  # (with those the journal after it added)
        # Files before the checkpoint that no live segment needs: a crash came between a
        # checkpoint and their removal, or the journal after it deleted what they held
        # (never when the checkpoint was unreadable; the caps evict only later, journaled:
        # Store.start). And empty files earlier starts left, but the last: file numbers
        # must only grow.
        first, live = loaded.replay_from[0], self.table.keydir.live
        last = max(loaded.sizes, default=0)
        stale = [
            p
            for p, size in loaded.sizes.items()
            if not live.get(p) and ((p < first and not loaded.error) or (not size and p != last))
        ]
        self.table.dropped(stale)
        # Segment files no entry names: written for a commit that did not count, or no
        # longer needed by a checkpoint when a crash came before their removal.
        files_kept = None if loaded.error else self.table.keydir.files
        await self.offload(self._sweep_files, j, stale, files_kept)
        await self.offload(j.open_next)
        self.table.sized(j.active, 0)
        if helper is not None:
            self.child = await helper
        self.committer = Committer(
            j, offload=self.offload, apply=self._applied, window=self.window, child=self.child
        )
        self.committer.start()
        self._maintainer = spawn(self._maintain(), name="store-maintainer")
        keydir = self.table.keydir
        log.info(
            "store loaded in %.2fs: %d records, %d segments (%d bytes in %d journal files), "
            "%d entries replayed, %d stale files removed",
            time.monotonic() - started, len(self.owner), len(self.table),
            keydir.live_bytes, len(keydir.sizes), loaded.entries, len(stale),
        )  # fmt: skip

    async def _discard(self, helper: asyncio.Future[FsyncChild | None] | None) -> None:
        """The fsync helper started for a load that failed: told to exit, and reaped."""
        if helper is None:
            return
        child = await asyncio.shield(helper)  # (its start cannot be cancelled midway)
        if child is not None:
            child.close()
            await self.offload(child.wait)

    def _open(self, root: Path) -> tuple[Journal, Loaded]:
        """Blocking: take the dir, check and mark its format, read checkpoint and journal."""
        lock = files.DirLock(root)
        try:
            parent = root.parent  # stat()s below may fail too: a permission error
            if not self.make_parents and not root.exists() and not parent.is_dir():
                why = "is not a directory" if parent.exists() else "does not exist"
                raise StateDirUnusable(
                    f"state dir {root} cannot be used: its parent {parent} {why}; create it "
                    f"(or mount its volume), {_FIX}"
                )
            files.ensure_root(root)
            if not lock.acquire():
                raise StateDirUnusable(
                    f"state dir {root} cannot be used: another ocxproxy process holds it "
                    f"({lock.path}); stop that one, {_FIX}"
                )
            try:  # before anything in the dir changes
                stateformat.mark(root, stateformat.read(root))
            except ConfigError:
                lock.release()
                raise
            j = Journal(root, large=self.large)
            j.prepare()
            loaded = j.load(repair=True)
        except OSError as exc:
            lock.release()
            why = exc.strerror or str(exc)
            where = f" ({exc.filename})" if exc.filename else ""
            raise StateDirUnusable(
                f"state dir {root} cannot be used: {why}{where}; make it a directory this "
                f"user can write, {_FIX}"
            ) from None
        self._lock = lock
        return j, loaded

    def _restored(self, loaded: Loaded) -> None:
        """Where the loaded checkpoint and journal leave the checkpoint's schedule."""
        self.replay_from = loaded.replay_from
        first, start = loaded.replay_from
        self.since_checkpoint = sum(
            size - (start if p == first else 0) for p, size in loaded.sizes.items() if p >= first
        )
        if self.since_checkpoint or loaded.error:
            self.dirty_at = time.monotonic()
        with contextlib.suppress(OSError):
            self.checkpoint_size = (self.root / journal.CHECKPOINT).lstat().st_size

    @staticmethod
    def _sweep_files(j: Journal, stale: list[int], needed: Collection[str] | None) -> None:
        j.remove(stale)
        if needed is not None:
            on_disk = segment_files.on_disk(j.root)
            segment_files.remove(j.root, [k for k in on_disk if k not in needed])
        for path in j.temps():
            with contextlib.suppress(OSError):
                files.fs.unlink(path)

    async def shutdown(self, *, drain: bool) -> None:
        """Stop maintenance and the committer (after writing what is queued, with
        `drain`), close the journal and let go of the directory."""
        if self._maintainer is not None:
            await cancel_and_wait(self._maintainer)
            self._maintainer = None
        if self.committer is not None:
            await self.committer.stop(drain=drain)
            self.committer = None
        if self.child is not None:
            child, self.child = self.child, None
            child.close()
            await self.offload(child.wait)
        if self.journal is not None:
            self.journal.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- commits -------------------------------------------------------------------------

    def changed(self) -> None:
        """A change the checkpoint does not hold yet was queued."""
        if self.dirty_at is None:
            self.dirty_at = time.monotonic()

    def _applied(self, outcome: Outcome) -> None:
        """The committer's callback: its own accounting, then the store's."""
        if outcome.error is not None:
            self._write_failed(outcome.error)
            self.apply(outcome)
            return
        self.metrics.journal_commits.inc()
        if not self.available:
            log.warning("journal writes succeed again: store available")
        self.available = True
        self.since_checkpoint += outcome.written
        self.apply(outcome)
        if self.over_disk() or self.since_checkpoint >= self.checkpoint_after():
            self._wanted.set()

    def checkpoint_after(self) -> int:
        """Journal bytes since the checkpoint that call for the next: `checkpoint_bytes`,
        or the checkpoint's own size where that is larger, up to twice `checkpoint_bytes`.
        A checkpoint's CPU grows with the records (~5 ms per 1,000 here), so at a fixed
        trigger every turn pays more for it as the store grows; waiting for as much journal
        as the checkpoint holds keeps that per byte written, while start-up replays at
        most twice as much (~0.03 s a MiB here)."""
        return max(self.checkpoint_bytes, min(self.checkpoint_size, 2 * self.checkpoint_bytes))

    def _write_failed(self, error: OSError) -> None:
        reason = errno.errorcode.get(error.errno or 0, "error")
        self.metrics.store_write_failures.labels(reason=reason).inc()
        self.metrics.spill_failures.labels(reason=str(FailureReason.WRITE_FAILED)).inc()
        self.available = False
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            more = f" ({self._failures_unlogged} more since the last warning)"
            log.warning(
                "journal write failed (%s): turns are not acknowledged%s",
                error,
                more if self._failures_unlogged else "",
            )
            self._logged_at, self._failures_unlogged = now, 0
        else:
            self._failures_unlogged += 1

    # -- maintenance: disk cap, compaction, checkpoint -------------------------------------

    async def _maintain(self) -> None:
        probed = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(MAINTAIN_EVERY):
                    await self._wanted.wait()
            self._wanted.clear()
            try:
                committer = self.committer
                if committer is None:
                    return
                if not self.available and committer.pending() is None:
                    if time.monotonic() - probed >= 1.0:  # does the disk take writes again?
                        probed = time.monotonic()
                        committer.submit(NOP, b"", None)
                    continue
                over = self.over_disk()
                if self.full and not over:  # deletes, expiry or others' files made room
                    self._room_again()
                due = self.since_checkpoint >= self.checkpoint_after() or (
                    self.dirty_at is not None
                    and time.monotonic() - self.dirty_at >= self.checkpoint_age
                )
                if over and not due and time.monotonic() < self._cap_next:
                    continue  # the last pass for the cap was too recent (`_cap_passed`)
                if over or due:
                    await self.checkpoint()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let maintenance die; the next round retries
                log.exception("store maintenance failed")

    def over_disk(self) -> bool:
        keep = self.max_disk_bytes * DISK_KEEP
        return self.table.keydir.live_bytes + self.checkpoint_size + self.others_bytes() > keep

    def others_bytes(self) -> int:
        return sum(bytes_used() for bytes_used in self.others)

    async def _compact(self) -> None:
        """Re-append the live segments of sparse files the checkpoint covers, in batches
        (the loop runs between them), at most COMPACT_BYTES per checkpoint. They are
        found (from the keys the keydir lists per file: no pass over every segment) and
        ordered SCAN keys at a time (a file's keys come in the order they were appended:
        one sort of a whole file's took 4 ms), and queued in steps of `STEP` seconds
        (Pacer)."""
        assert self.journal is not None and self.committer is not None
        first = self.replay_from[0]
        sparse = self.table.keydir.sparse(first, COMPACT_BELOW, COMPACT_BYTES)
        if not sparse:
            return
        pacer = Pacer()
        moves: list[Segment] = []
        responses: dict[str, tuple[Record, int]] = {}  # id -> (record, its place)
        record = self.owner.record
        for pack in sorted(sparse):  # in journal order
            keys = self.table.keydir.keys.get(pack, [])  # (only the active file's grows)
            for start in range(0, len(keys), SCAN):
                # (A key listed twice in different slices moves once: move() skips it.)
                found = {s.digest: s for s in self.table.in_file(pack, keys[start : start + SCAN])}
                moves += sorted(found.values(), key=_OFFSET)
                await pacer.pause()
            ids = self.table.keydir.responses.get(pack, [])
            for start in range(0, len(ids), SCAN):
                for rid in ids[start : start + SCAN]:
                    r = record(rid)
                    if r is not None and type(r.response) is int and unplace(r.response)[0] == pack:
                        responses[rid] = (r, r.response)
                await pacer.pause()
        await self._move_responses(list(responses.values()), pacer)
        for start in range(0, len(moves), COMPACT_BATCH):
            batch = moves[start : start + COMPACT_BATCH]
            jobs = [(s.pack, s.offset, s.length) for s in batch]
            blobs = await self.offload(self.journal.read_blobs, jobs)
            for segment, blob, (pack, offset, _) in zip(batch, blobs, jobs, strict=True):
                self.table.move(segment, blob, pack, offset)
                await pacer.pause()
            await self.committer.write()

    async def _move_responses(self, moves: list[tuple[Record, int]], pacer: Pacer) -> None:
        """Re-append each response (kept in its record's entry) as an RSP entry, unless its
        record went or its response moved meanwhile (the outcome checks again: ledger.py)."""
        assert self.journal is not None and self.committer is not None
        for start in range(0, len(moves), COMPACT_BATCH):
            batch = moves[start : start + COMPACT_BATCH]
            jobs = [unplace(at)[:3] for _, at in batch]
            blobs = await self.offload(self.journal.read_blobs, jobs)
            for (r, at), blob in zip(batch, blobs, strict=True):
                if blob is not None and r.response == at and self.owner.record(r.id) is r:
                    self.committer.submit(RSP, (orjson.dumps(r.id), blob), (r, at), len(blob))
                await pacer.pause()
            await self.committer.write()

    async def checkpoint(self) -> bool:
        """Evict for the disk cap when over it, compact, then capture the index at a fresh
        journal file, encode it in chunks (the loop runs between them), write it, and
        remove the files it makes unneeded."""
        async with self._checkpointing:
            exhausted = await self._evict() if self.over_disk() else None
            written = await self._checkpoint_now()
            if exhausted is not None:
                self._cap_passed(exhausted)
            return written

    async def _evict(self) -> bool | None:
        """What the store keeps on disk (live segments, with the checkpoint) down to
        DISK_LOW of --max-disk-bytes, whole chains at a time (Expiry.for_disk): the rest is
        room for the journal's tail, compaction's garbage and the next checkpoint, and the
        next pass waits for DISK_KEEP - DISK_LOW of the cap in new turns. The chain
        extended last goes only when it alone keeps the store over DISK_KEEP. The
        checkpoint shrinks too once it no longer names the evicted records. True when
        still over DISK_KEEP with nothing more to evict (None: no journal)."""
        if self.committer is None or self.journal is None:
            return None
        others = self.others_bytes()
        low = self.max_disk_bytes * DISK_LOW - others
        keep = self.max_disk_bytes * DISK_KEEP - others
        per_record = self.checkpoint_size / max(self.checkpoint_records, 1)
        return await self.owner.evict_for_disk(low, keep, per_record)

    def _cap_passed(self, exhausted: bool) -> None:
        """After a checkpoint the disk cap called for: the next waits CAP_GAP when it
        brought the store under the cap, else twice as long as the last (at most
        CAP_BACKOFF): a pass that cannot free enough is not repeated at every commit.
        With nothing left to evict the store is full: said once, counted, and new turns
        are refused until there is room."""
        now = time.monotonic()
        if not self.over_disk():
            self._cap_wait, self._cap_next = CAP_GAP, now + CAP_GAP
            if self.full:
                self._room_again()
            return
        self._cap_next = now + self._cap_wait
        self._cap_wait = min(2 * self._cap_wait, CAP_BACKOFF)
        if exhausted and not self.full:
            self.full = True
            self.metrics.store_disk_full.inc()
            mib = 2**20
            log.warning(
                "store full: %.1f MiB of live data, checkpoint and background files, over "
                "the %.1f MiB it may keep (%d%% of --max-disk-bytes %.1f MiB), and nothing "
                "more can be evicted (what is left is pinned: conversations, or others' "
                "files); new turns to store are refused (507 store_full) until there is room: "
                "delete conversations or raise --max-disk-bytes",
                (self.table.keydir.live_bytes + self.checkpoint_size + self.others_bytes())
                / mib, self.max_disk_bytes * DISK_KEEP / mib, round(DISK_KEEP * 100),
                self.max_disk_bytes / mib,
            )  # fmt: skip

    def _room_again(self) -> None:
        self.full = False
        self._cap_wait = CAP_GAP
        log.warning("store back under --max-disk-bytes: new turns are stored again")

    async def _checkpoint_now(self) -> bool:
        committer, j = self.committer, self.journal
        if committer is None or j is None:
            return False
        await self._compact()
        # The next file is made (and synced) while commits go on: the rotation, while they
        # wait, is a swap; the old file is sealed once they go on again.
        await self.offload(j.ready_next)
        heap.settle()  # (what is collectable goes now, not frozen with the capture below)
        async with committer.quiet():
            position = await self.offload(j.rotate)
            capture = self.table.captured(position[0])
            records, layout, uncommitted = self.owner.checkpoint_view()
            # Frozen before the loop runs again: until it is encoded the list holds every
            # record, and any GC collection meanwhile, of any generation, would visit
            # each of them (10-35 ms with the loop stopped at 100,000 records, under
            # `serve`). The encoding lets go of it as it goes.
            gc.freeze()
            placed = self.table.keydir.placed(position[0])
            next_sid = self.table.sid + 1
            dirty_before = self.dirty_at
            since = self.since_checkpoint
            self.dirty_at = None if not committer.pending() else time.monotonic()
            self.since_checkpoint = 0
        await self.offload(j.seal_retired)
        keydir, owner, since_capture = self.table.keydir, self.owner, self.rows_capture
        try:
            chunks, n_recs, rows, record_rows = await encode_checkpoint(
                position, self.clock(), next_sid, placed, self.table.by_key, records, layout,
                uncommitted, self.rows, lambda pack: keydir.unchanged_since(pack, since_capture),
                self.record_rows,
                lambda number, count: owner.unchanged(number, count, since_capture),
            )  # fmt: skip
        finally:
            self.table.encoded()
        self.rows, self.record_rows = {}, {}  # (the file they are in is being replaced)
        try:
            written = await self.offload(j.write_checkpoint, chunks)
        except OSError as exc:
            self.metrics.snapshot_failures.labels(reason="write_failed").inc()
            log.warning("checkpoint not written: %s", exc)
            self.dirty_at = dirty_before or time.monotonic()
            self.since_checkpoint += since
            return False
        self.metrics.snapshot_writes.inc()
        places, size = [], 0
        for length, crc in written:
            places.append((size, length, crc))
            size += length
        for file_rows in (*rows.values(), *record_rows.values()):
            file_rows.written(places)
        self.rows, self.record_rows, self.rows_capture = rows, record_rows, capture
        self.replay_from, self.checkpoint_size = position, size
        self.checkpoint_records = n_recs
        # What encoding it took (~36 MiB at 100,000 records) goes back to the system now,
        # not at the next half-minute trim (heap.py); in a thread (it walks malloc's lists).
        del chunks
        await self.offload(heap.trim)
        doomed = self.table.keydir.removable(position[0], capture)
        if doomed:
            await committer.run_locked(j.remove, doomed)
            self.table.dropped(doomed)
        if self.table.keydir.gone:
            async with committer.quiet():  # (no commit lands a segment meanwhile)
                keys = self.table.keydir.unneeded(capture)
                self.table.keydir.removed(await self.offload(segment_files.remove, j.root, keys))
        log.debug("checkpoint %d: %d records, %d bytes", capture, n_recs, size)
        return True

    # -- introspection -------------------------------------------------------------------

    def snapshot_age(self) -> float:
        return 0.0 if self.dirty_at is None else time.monotonic() - self.dirty_at

    def journal_lag(self) -> float:
        committer = self.committer
        if committer is None or committer.oldest is None:
            return 0.0
        return time.monotonic() - committer.oldest

    def queued_bytes(self) -> int:
        return self.committer.queued_bytes if self.committer is not None else 0

    def disk_bytes(self) -> int:
        j = self.journal
        room = j.allocated - j.size if j is not None and self.committer is not None else 0
        keydir = self.table.keydir
        own = keydir.live.get(segment_files.FILES, 0)  # (a segment's file, and its SEG entry)
        files = sum(keydir.sizes.values()) + own + self.checkpoint_size + self.others_bytes()
        return files + max(room, 0)
