"""Store: the one owner of the continuation store's state (records, segments, tiers).

Segments live in the resident tier (memory, byte-capped LRU) and, for durable ones, in
the journal (journal.py): a new durable turn's segments and record are appended as
entries, group-committed by the committer (disk.py), which reports back where they landed;
only this class changes a Segment's or Record's state. Past the memory cap the oldest
segments just drop their bytes when the journal holds them; content no durable record
holds (store:false turns) is dropped instead: it never reaches disk.

Durability (`ack`, the default): `await commit(record)` returns once the record's entries
are fsynced, raising StoreFailure when they could not be written; the HTTP layer awaits
it before acknowledging the turn. `relaxed`: commits happen every `window` seconds and
nobody waits. No state dir (--zdr): memory only.

The checkpoint (journal.py) is the index at a journal position; it is written when the
journal since the last one passes `checkpoint_bytes` or `checkpoint_age`, encoded in
chunks between which the event loop runs. Journal files before the checkpoint that hold
few live segments are compacted (their live segments re-appended) and then removed.
Order of durability, so a crash never loses an acknowledged turn:
  1. a segment's bytes and a record's entry count as durable only after their fsync;
  2. a record's entry is appended after (or with) the entries of every segment it needs;
  3. a journal file is removed only when a checkpoint captured after its last live
     segment left it is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import platformdirs

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.config import Config
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store import codec, files, journal
from ocxproxy.store.codec import DEL, NOP, PUT, SEG, Loaded
from ocxproxy.store.disk import Committer, Offload, Outcome
from ocxproxy.store.items import ItemIndex
from ocxproxy.store.journal import Journal
from ocxproxy.store.output import split_output
from ocxproxy.store.resident import ResidentTier
from ocxproxy.store.segments import SegmentTable
from ocxproxy.store.upkeep import (
    CHECKPOINT_AGE,
    CHECKPOINT_BYTES,
    COMPACT_BATCH,
    COMPACT_BELOW,
    COMPACT_BYTES,
    DISK_KEEP,
    MAINTAIN_EVERY,
    encode_checkpoint,
)

__all__ = ["Store", "StoreStats", "default_state_dir"]

log = logging.getLogger("ocxproxy.store")

_TOMBSTONES = 10_000  # remembered ids of dropped records, to count why a lookup failed
BACKPRESSURE_TIMEOUT = 5.0  # seconds a turn may wait while the journal is behind
LOG_EVERY = 10.0  # seconds between repeated write-failure warnings
NEVER = 1e18  # the expiry of a record kept until deleted (a conversation)
KEPT_PREFIXES = ("conv_", "idem_")  # ids of records `keep` writes; never a response


def default_state_dir() -> Path:
    return platformdirs.user_state_path("ocxproxy")


@dataclass(frozen=True, slots=True)
class StoreStats:
    records: int
    segments: int
    resident_segments: int
    resident_bytes: int
    disk_segments: int  # segments whose bytes the journal holds
    disk_bytes: int  # what the state dir occupies: journal files + checkpoint
    live_bytes: int = 0  # of that, what the store needs: live segments, tail, checkpoint
    pending_segments: int = 0  # queued for the next commit
    pending_bytes: int = 0
    snapshot_age: float | None = None  # oldest change not in the checkpoint (None: none)
    available: bool = True


class Store:
    """Records by id, their shared segments, and where segment bytes are.

    `put`, `lookup`, `delete` and `sweep` are synchronous and never touch disk; `history`
    and `response_bytes` only leave the event loop when a segment is not resident. With a
    `state_dir`, `start()` loads the checkpoint and journal and starts the committer.
    """

    def __init__(
        self,
        *,
        max_resident_bytes: int,
        max_entries: int,
        ttl: float,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        state_dir: Path | None = None,
        max_disk_bytes: int = 1024**3,
        durability: str = "ack",
        snapshot_delay: float = 2.0,
        offload: Offload = asyncio.to_thread,
        checkpoint_bytes: int = CHECKPOINT_BYTES,
        checkpoint_age: float = CHECKPOINT_AGE,
    ) -> None:
        if durability not in ("ack", "relaxed"):
            raise ValueError(f"unknown durability {durability!r} (ack or relaxed)")
        self.max_entries = max_entries
        self.ttl = ttl
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.resident = ResidentTier(max_resident_bytes)
        self.backpressure_timeout = BACKPRESSURE_TIMEOUT
        self.state_dir = state_dir
        self.max_disk_bytes = max_disk_bytes
        self.durability = durability
        self.window = snapshot_delay if durability == "relaxed" else 0.0
        self.checkpoint_bytes = max(4096, min(checkpoint_bytes, max_disk_bytes // 8))
        self.checkpoint_age = checkpoint_age
        self._offload = offload
        self._records: OrderedDict[str, Record] = OrderedDict()
        self.table = SegmentTable(self.resident, self.metrics, offload)
        self._tombstones: OrderedDict[str, FailureReason] = OrderedDict()
        self.items = ItemIndex()
        self._pinned: dict[str, int] = {}  # id -> bytes of each record kept until deleted
        self._pinned_bytes = 0  # their sum
        self._failed: OrderedDict[str, StoreFailure] = OrderedDict()  # ids whose commit failed
        self._started = False
        # The disk side, all owned here: where segment bytes are, per journal file.
        self.journal: Journal | None = None
        self._committer: Committer | None = None
        self._lock: files.DirLock | None = None
        self._maintainer: asyncio.Task[None] | None = None
        self._uncommitted: dict[str, tuple[Record, asyncio.Future[Any]]] = {}
        self._replay_from = (0, 0)  # the durable checkpoint's journal position
        self._checkpoint_size = 0
        self._since_checkpoint = 0  # journal bytes appended since the checkpoint's position
        self._dirty_at: float | None = None  # monotonic: oldest change not in the checkpoint
        self._wanted = asyncio.Event()  # maintenance has work (checkpoint, cap)
        self._checkpointing = asyncio.Lock()
        self.available = True
        self._failures_unlogged = 0
        self._logged_at = 0.0
        self._closing = False
        self._gauges()

    @classmethod
    def from_config(cls, config: Config, metrics: Metrics | None = None) -> Store:
        """The proxy's shared store: memory-only under --zdr, else backed by the state dir."""
        state_dir = None if config.zdr else (config.state_dir or default_state_dir())
        return cls(
            max_resident_bytes=config.max_resident_bytes,
            max_entries=config.max_entries,
            ttl=config.ttl,
            metrics=metrics,
            state_dir=state_dir,
            max_disk_bytes=config.max_disk_bytes,
            durability=config.durability,
            snapshot_delay=config.snapshot_delay,
        )

    def __repr__(self) -> str:
        return (
            f"<Store {len(self._records)} records {len(self.table)} segments "
            f"{self.resident!r} {self.journal!r}>"
        )

    def __len__(self) -> int:
        return len(self._records)

    @property
    def durable(self) -> bool:
        """Writes reach the journal (a state dir, opened)."""
        return self._committer is not None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the checkpoint and replay the journal (serving every intact chain), then
        start the committer. Idempotent."""
        if self._started:
            return
        self._started = True
        if self.state_dir is None:
            return
        started = time.monotonic()
        opened = await self._offload(self._open, self.state_dir)
        if opened is None:
            return
        journal_, loaded = opened
        self.journal = journal_
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
            self._restore(loaded)
            loaded.records.clear()
            loaded.segments.clear()
            gc.freeze()
        finally:
            gc.enable()
        # Files before the checkpoint that no live segment needs: a crash came between a
        # checkpoint and their removal (never when the checkpoint was unreadable).
        first = loaded.replay_from[0]
        stale = [
            p
            for p in loaded.sizes
            if p < first and not self.table.keydir.live.get(p) and not loaded.error
        ]
        self.table.dropped(stale)
        await self._offload(self._sweep_files, journal_, stale)
        await self._offload(journal_.open_next)
        self.table.sized(journal_.active, 0)
        self._committer = Committer(
            journal_, offload=self._offload, apply=self._applied, window=self.window
        )
        self.table.committer, self.table.journal = self._committer, journal_
        self._committer.start()
        self._maintainer = spawn(self._maintain(), name="store-maintainer")
        log.info(
            "store loaded in %.2fs: %d records, %d segments (%d bytes in %d journal files), "
            "%d entries replayed, %d stale files removed",
            time.monotonic() - started, len(self._records), len(self.table),
            self.table.keydir.live_bytes, len(self.table.keydir.sizes), loaded.entries, len(stale),
        )  # fmt: skip

    def _open(self, root: Path) -> tuple[Journal, Loaded] | None:
        """Blocking: take the dir, read checkpoint and journal. None: run memory-only."""
        lock = files.DirLock(root)
        try:
            files.ensure_root(root)
            if not lock.acquire():
                self._unusable(root, "locked", "in use by another ocxproxy process")
                return None
            j = Journal(root)
            j.prepare()
            loaded = j.load(repair=True)
        except OSError as exc:
            lock.release()
            self._unusable(root, "unsafe", str(exc))
            return None
        self._lock = lock
        return j, loaded

    def _unusable(self, root: Path, reason: str, detail: str) -> None:
        self.metrics.snapshot_failures.labels(reason=reason).inc()
        log.error("state dir %s unusable (%s): running memory-only", root, detail)

    @staticmethod
    def _sweep_files(j: Journal, stale: list[int]) -> None:
        j.remove(stale)
        for path in j.temps():
            with contextlib.suppress(OSError):
                path.unlink()

    async def close(self) -> None:
        """Write what is queued (one commit: quick at any backlog) and stop."""
        await self._shutdown(drain=True)

    async def abandon(self) -> None:
        """Stop without writing anything more, as a crash would (for tests)."""
        await self._shutdown(drain=False)

    async def _shutdown(self, *, drain: bool) -> None:
        self._closing = True
        if self._maintainer is not None:
            await cancel_and_wait(self._maintainer)
            self._maintainer = None
        if self._committer is not None:
            await self._committer.stop(drain=drain)
            self._committer = None
        if self.journal is not None:
            self.journal.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    async def flush(self) -> bool:
        """Commit what is queued, compact, and write a checkpoint now; True when durable."""
        if self._committer is None:
            return False
        await self._committer.write()
        return await self._checkpoint()

    async def commit(self, record: Record | None = None) -> None:
        """Until `record`'s entries (or, without one, everything queued so far) are durable.

        In `ack` mode raises StoreFailure(WRITE_FAILED) when they could not be written:
        the turn must not be acknowledged. `relaxed` and memory-only stores return at once.
        """
        committer = self._committer
        if record is not None:
            failure = self._failed.get(record.id)
            if failure is not None and record.id not in self._records:
                raise failure
            pending = self._uncommitted.get(record.id)
            if pending is None or pending[0] is not record:
                return
            future: asyncio.Future[Any] | None = pending[1]
        else:
            future = committer.pending() if committer is not None else None
        if future is None or self.durability != "ack":
            return
        error = await asyncio.shield(future)
        if error is not None:
            raise _unavailable(error)

    async def wait_for_room(self) -> None:
        """Backpressure: while more bytes wait for the journal than half the resident
        budget, a new turn waits (at most `backpressure_timeout`) for a commit."""
        committer, budget = self._committer, self.resident.max_bytes // 2
        if committer is None or committer.queued_bytes <= budget:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.backpressure_timeout):
                while committer.queued_bytes > budget and (f := committer.pending()):
                    await asyncio.shield(f)

    def _restore(self, loaded: Loaded) -> None:
        """Build records and segments from what start-up read."""
        records, missing = self.table.restore(loaded, self.clock())
        for rid in missing:
            self._tombstone(rid, FailureReason.MISSING)
        for record in records:
            self._records[record.id] = record
            self.items.add(record)
            if record.expires_at >= NEVER:
                kept = {s.key: s.size for s in (*record.segments, record.response)}
                self._pinned[record.id] = sum(kept.values())
                self._pinned_bytes += self._pinned[record.id]
        if missing:
            self.metrics.spill_failures.labels(reason=str(FailureReason.MISSING)).inc(len(missing))
            log.warning("journal: %d records need segments that are gone", len(missing))
        self._replay_from = loaded.replay_from
        first, start = loaded.replay_from
        self._since_checkpoint = sum(
            size - (start if p == first else 0) for p, size in loaded.sizes.items() if p >= first
        )
        if self._since_checkpoint or loaded.error:
            self._dirty_at = time.monotonic()
        with contextlib.suppress(OSError):
            self._checkpoint_size = (self.state_dir / journal.CHECKPOINT).lstat().st_size  # type: ignore[operator]
        self._enforce_bounds()

    # -- lookups -------------------------------------------------------------------------

    def lookup(self, scope: str, response_id: str) -> Record:
        """The caller's record for `response_id`, or StoreFailure (another scope = unknown)."""
        if response_id.startswith(KEPT_PREFIXES):
            raise StoreFailure(FailureReason.UNKNOWN)
        return self.record(scope, response_id)

    def record(self, scope: str, record_id: str) -> Record:
        """The caller's record of any kind (a response, or one `keep` wrote)."""
        record = self._records.get(record_id)
        if record is None or record.scope != scope:
            if record is None and record_id in self._tombstones:
                raise StoreFailure(self._tombstones[record_id])
            raise StoreFailure(FailureReason.UNKNOWN)
        if record.expires_at <= self.clock():
            self._drop(record, FailureReason.EXPIRED, "expired", journaled=False)
            raise StoreFailure(FailureReason.EXPIRED)
        return record

    async def history(self, record: Record) -> list[bytes]:
        """The chain's segment bytes, oldest first (empty segments left out)."""
        segments = record.segments
        datas = [s.data for s in segments]
        if None in datas:
            return [d for d in await self.table.fetch(segments) if d]
        self.resident.touch_all(segments)
        return [d for d in datas if d]

    async def segment_bytes(self, segments: Sequence[Segment]) -> list[bytes]:
        """The bytes of each segment, empty ones included."""
        return await self.table.fetch(segments)

    async def response_bytes(self, record: Record) -> bytes:
        """The stored response object, with its output items put back when they were cut."""
        if record.output_at is None:
            (skeleton,) = await self.table.fetch((record.response,))
            return skeleton
        skeleton, own = await self.table.fetch((record.response, record.segments[-1]))
        offset, length = record.output_at
        return b"".join((skeleton[:offset], own[len(own) - length :], skeleton[offset:]))

    def find_item(self, scope: str, item_id: str, *, unstored: bool = False) -> Record:
        """The newest live record of `scope` whose turn added an item with this id (one a
        client did not ask to store only with `unstored`), or StoreFailure."""
        now = self.clock()
        expired: list[Record] = []
        found: Record | None = None
        for record in self.items.newest(scope, item_id):
            own = record.segments[-1]
            if record.expires_at <= now:
                expired.append(record)
            elif (record.stored or unstored) and (own.data is not None or own.on_disk):
                found = record  # (a holder whose bytes were dropped cannot serve it)
                break
        for record in expired:
            self._drop(record, FailureReason.EXPIRED, "expired", journaled=False)
        if found is None:
            raise StoreFailure(FailureReason.UNKNOWN)
        return found

    async def item_bytes(self, found: Sequence[tuple[Record, str]]) -> list[bytes]:
        """Each (record, item id)'s item, as the bytes its record's own segment holds."""
        segments = [record.segments[-1] for record, _ in found]
        datas = await self.table.fetch(segments)
        self.resident.touch_all(segments)
        result = []
        for segment, data, (_, item_id) in zip(segments, datas, found, strict=True):
            span = segment.item_ids.span(item_id)
            if span is None:  # cannot happen: the index holds only ids of own segments
                raise StoreFailure(FailureReason.UNKNOWN)
            result.append(data[span[0] : span[1]])
        return result

    # -- changes -------------------------------------------------------------------------

    def put(self, turn: Turn, parent: Record | None) -> Record:
        """Remember a finished turn on top of its parent's chain. A durable one is queued
        for the journal: `await commit(record)` before acknowledging it."""
        now = self.clock()
        old = self._records.get(turn.response_id)
        if old is not None:  # a reused id: drop the old record before its segments are shared
            self._drop(old, None, None, journaled=False)  # the new PUT supersedes it
        durable = turn.durable and (parent is None or parent.durable)
        own = self.table.intern(
            Segment(turn.items, turn.n_items, turn.call_ids, durable=False, item_ids=turn.item_ids)
        )
        skeleton, output_at = split_output(turn.response, turn.items)
        response = self.table.intern(Segment(skeleton, 0, frozenset(), durable=False))
        if parent is None:
            chain: tuple[Segment, ...] = (own,)
        elif self._records.get(parent.id) is parent:
            chain = (*parent.segments, own)
        else:  # dropped meanwhile, or another store's record: take its segments in
            adopt = self.table.adopt
            chain = (*(adopt(s, durable) for s in parent.segments), own)
        record = Record(
            id=turn.response_id,
            scope=turn.scope,
            created_at=now,
            expires_at=now + self.ttl,
            durable=durable,
            segments=chain,
            response=response,
            backend=turn.backend,
            affinity_key=turn.affinity_key,
            n_items=(parent.n_items if parent else 0) + turn.n_items,
            output_at=output_at,
            stored=turn.stored,
        )
        self.table.hold((*chain, response), durable=durable)
        self._records[record.id] = record
        self.items.add(record)
        self._tombstones.pop(record.id, None)
        self._failed.pop(record.id, None)
        if durable and self._committer is not None:
            self._journal_put(record, parent)
        self._enforce_bounds()
        return record

    def delete(self, scope: str, response_id: str, *, kept: bool = False) -> bool:
        """Forget a record (one `keep` wrote when `kept`; journaled: `await commit()`
        before acknowledging)."""
        record = self._records.get(response_id)
        if record is None or record.scope != scope:
            return False
        if response_id.startswith(KEPT_PREFIXES) != kept:
            return False
        self._drop(record, None, None)
        return True

    def keep(
        self,
        record_id: str,
        scope: str,
        chain: Sequence[Segment],
        meta: bytes,
        *,
        created_at: float,
        expires_at: float = NEVER,
        durable: bool = True,
        backend: str | None = None,
        affinity_key: str | None = None,
        force: bool = False,
    ) -> Record:
        """Write (or rewrite) a record that is not a response: `chain` reuses the segments
        of records already held (the same objects) and interns new ones; `meta` is kept as
        its response segment. Journaled like `put` (`await commit(record)` before
        acknowledging). With `expires_at=NEVER` it is pinned: no count or byte cap drops
        it, and StoreFailure(FULL) refuses a write that would need that, unless `force`
        (a turn already answered: taken even past the caps)."""
        durable = durable and self._committer is not None
        pinned = expires_at >= NEVER
        # A chain is never empty (a row needs a chain): one empty segment.
        chain = chain or (Segment(b"", 0, frozenset(), durable=False),)
        old = self._records.get(record_id)
        shared = 0  # leading segments the old record holds too, the same objects (an append)
        if (
            old is not None
            and old.durable == durable
            and tuple(chain[: len(old.segments)]) == old.segments
        ):
            shared = len(old.segments)
        fresh = chain[shared:]
        if old is not None and shared and record_id in self._pinned:
            size = self._pinned[record_id] - old.response.size
            size += sum(s.size for s in fresh) + len(meta)
        else:
            size = sum(s.size for s in {s.key: s for s in chain}.values()) + len(meta)
        if pinned and not force and not self._fits(record_id, size, durable=durable):
            raise StoreFailure(FailureReason.FULL, record_id)
        take = self.table.take
        segments = tuple(chain[:shared]) + tuple(take(s, durable) for s in fresh)
        response = self.table.intern(Segment(meta, 0, frozenset(), durable=False))
        record = Record(
            id=record_id,
            scope=scope,
            created_at=created_at,
            expires_at=expires_at,
            durable=durable,
            segments=segments,
            response=response,
            backend=backend,
            affinity_key=affinity_key,
            n_items=(old.n_items if shared and old else 0) + sum(s.n_items for s in fresh),
            stored=False,
        )
        self.table.hold((*segments[shared:], response), durable=durable)  # before old goes
        journaled = durable and self._committer is not None
        pending = self._uncommitted.get(record_id)
        if old is not None and pending is not None and pending[0] is old:
            # Its PUT is still queued: a DEL after it, then this record's whole row.
            self._drop(old, None, None, shared=shared)
            if journaled:
                self._journal_put(record, None)
        elif old is not None:
            if journaled:  # a PUT of the same id supersedes the old row; name it if it is
                parent = old if shared and shared == len(segments) - 1 else None
                self._journal_put(record, parent)
            self._drop(old, None, None, journaled=False, shared=shared)
        elif journaled:
            self._journal_put(record, None)
        self._records[record_id] = record
        self.items.add(record)
        if pinned:
            self._pinned[record_id] = size
            self._pinned_bytes += size
        self._tombstones.pop(record_id, None)
        self._failed.pop(record_id, None)
        self._enforce_bounds()
        return record

    def room_for(self, record_id: str, extra: int) -> bool:
        """Can the pinned record `record_id` (or a new one) grow by `extra` bytes with no
        cap having to drop pinned records?"""
        return self._fits(record_id, self._pinned.get(record_id, 0) + extra, durable=True)

    def _fits(self, record_id: str, size: int, *, durable: bool) -> bool:
        """Pinned bytes count against the share of the disk cap the store keeps when
        durable, else against the memory cap; their number against the entry cap."""
        others = self._pinned_bytes - self._pinned.get(record_id, 0)
        on_disk = durable and self._committer is not None
        cap = self.max_disk_bytes * DISK_KEEP if on_disk else self.resident.max_bytes
        if record_id not in self._pinned and len(self._pinned) >= self.max_entries:
            return False
        return others + size <= cap

    def sweep(self) -> int:
        """Drop expired records; returns how many (not journaled: replay drops them too)."""
        now = self.clock()
        expired = [r for r in self._records.values() if r.expires_at <= now]
        for record in expired:
            self._drop(record, FailureReason.EXPIRED, "expired", journaled=False)
        return len(expired)

    def _journal_put(self, record: Record, parent: Record | None) -> None:
        committer = self._committer
        assert committer is not None
        self.table.queue_missing((*record.segments, record.response))
        # A live durable parent's PUT precedes this one in the journal: name it.
        named = parent is not None and self._records.get(parent.id) is parent and parent.durable
        row = codec.record_row(record, parent.id if named and parent else None)
        future = committer.submit(PUT, orjson.dumps(row), record)
        self._uncommitted[record.id] = (record, future)
        self._changed()

    def _changed(self) -> None:
        if self._dirty_at is None:
            self._dirty_at = time.monotonic()

    def _applied(self, outcome: Outcome) -> None:
        """A commit's outcome, applied to the index (the committer's callback)."""
        subjects = outcome.subjects
        if outcome.error is not None:
            self._commit_failed(outcome)
            return
        self.metrics.journal_commits.inc()
        if not self.available:
            log.warning("journal writes succeed again: store available")
        self.available = True
        assert outcome.places is not None
        self.table.sized(outcome.pack, outcome.size)
        self._since_checkpoint += outcome.written
        for (kind, _), subject, place in zip(outcome.jobs, subjects, outcome.places, strict=True):
            if kind == SEG:
                self.table.written(subject, place)
            elif kind == PUT:
                pending = self._uncommitted.get(subject.id)
                if pending is not None and pending[0] is subject:
                    del self._uncommitted[subject.id]
        if self._over_disk() or self._since_checkpoint >= self.checkpoint_bytes:
            self._wanted.set()

    def _commit_failed(self, outcome: Outcome) -> None:
        error = outcome.error
        assert error is not None
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
        failure = _unavailable(error)
        for (kind, _), subject in zip(outcome.jobs, outcome.subjects, strict=True):
            if kind == SEG:
                self.table.not_written(subject)
            elif kind == PUT:
                pending = self._uncommitted.get(subject.id)
                if pending is None or pending[0] is not subject:
                    continue
                del self._uncommitted[subject.id]
                if self._records.get(subject.id) is subject:
                    # Not durable: in ack mode never acknowledged; in relaxed mode within
                    # the window it may lose. Its children name it in the journal: it goes.
                    self._drop(subject, None, None, journaled=False)
                    self._failed[subject.id] = failure
                    if len(self._failed) > _TOMBSTONES:
                        self._failed.popitem(last=False)
        self._enforce_bounds()

    def _tombstone(self, response_id: str, reason: FailureReason) -> None:
        self._tombstones[response_id] = reason
        if len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _drop(
        self,
        record: Record,
        reason: FailureReason | None,
        label: str | None,
        *,
        journaled: bool = True,
        shared: int = 0,
    ) -> None:
        """Forget a record; its first `shared` segments stay held (by the record that
        replaces it, which took them over)."""
        del self._records[record.id]
        self._pinned_bytes -= self._pinned.pop(record.id, 0)
        self.items.remove(record)
        if reason is not None:
            self._tombstone(record.id, reason)
        if label is not None:
            self.metrics.store_evictions.labels(reason=label).inc()
        if record.durable and self._committer is not None:
            pending = self._uncommitted.get(record.id)
            if pending is not None and pending[0] is record:
                # Its PUT is queued: the DEL must follow it, or the record comes back.
                journaled = True
            if journaled:
                self._committer.submit(DEL, orjson.dumps(record.id), None)
                self._changed()
        self.table.release((*record.segments[shared:], record.response), durable=record.durable)

    def _enforce_bounds(self) -> None:
        while len(self._records) > self.max_entries:
            victim = next((r for r in self._records.values() if r.id not in self._pinned), None)
            if victim is None:
                break
            self._drop(victim, FailureReason.EVICTED, "max_entries")
        self.table.shed()

    # -- maintenance: disk cap, compaction, checkpoint -------------------------------------

    async def _maintain(self) -> None:
        probed = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(MAINTAIN_EVERY):
                    await self._wanted.wait()
            self._wanted.clear()
            try:
                committer = self._committer
                if committer is None:
                    return
                if not self.available and committer.pending() is None:
                    if time.monotonic() - probed >= 1.0:  # does the disk take writes again?
                        probed = time.monotonic()
                        committer.submit(NOP, b"", None)
                    continue
                over = self._over_disk()
                due = self._since_checkpoint >= self.checkpoint_bytes or (
                    self._dirty_at is not None
                    and time.monotonic() - self._dirty_at >= self.checkpoint_age
                )
                if over or due:
                    await self._checkpoint()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let maintenance die; the next round retries
                log.exception("store maintenance failed")

    def _over_disk(self) -> bool:
        return (
            self.table.keydir.live_bytes + self._checkpoint_size > self.max_disk_bytes * DISK_KEEP
        )

    def _evict_for_disk(self) -> None:
        """The oldest durable records go (journaled, like a delete) until what the store
        keeps on disk (live segments, with the checkpoint) is back under DISK_KEEP of
        --max-disk-bytes; the rest is room for the journal's tail, compaction's garbage
        and the next checkpoint."""
        keep = self.max_disk_bytes * DISK_KEEP
        # The checkpoint shrinks too once it no longer names the evicted records.
        target = max(keep - self._checkpoint_size, keep / 2)
        for record in list(self._records.values()):
            if self.table.keydir.live_bytes <= target:
                return
            pinned = record.id in self._pinned  # a conversation: never dropped by a cap
            if record.durable and record.id not in self._uncommitted and not pinned:
                self._drop(record, FailureReason.EVICTED, "disk_bytes")

    async def _compact(self) -> None:
        """Re-append the live segments of sparse files the checkpoint covers, in batches
        (the loop runs between them), at most COMPACT_BYTES per checkpoint."""
        assert self.journal is not None and self._committer is not None
        first = self._replay_from[0]
        sparse = self.table.keydir.sparse(first, COMPACT_BELOW, COMPACT_BYTES)
        if not sparse:
            return
        moves = self.table.in_files(sparse)
        for start in range(0, len(moves), COMPACT_BATCH):
            batch = moves[start : start + COMPACT_BATCH]
            jobs = [(s.pack, s.offset, s.length) for s in batch]
            blobs = await self._offload(self.journal.read_blobs, jobs)
            for segment, blob, (pack, offset, _) in zip(batch, blobs, jobs, strict=True):
                self.table.move(segment, blob, pack, offset)
            await self._committer.write()

    async def _checkpoint(self) -> bool:
        """Compact, then capture the index at a fresh journal file, encode it in chunks (the
        loop runs between them), write it, and remove the files it makes unneeded."""
        async with self._checkpointing:
            return await self._checkpoint_now()

    async def _checkpoint_now(self) -> bool:
        committer, j = self._committer, self.journal
        if committer is None or j is None:
            return False
        if self._over_disk():
            self._evict_for_disk()
        await self._compact()
        async with committer.io:
            position = await self._offload(j.rotate)
            capture = self.table.captured(position[0])
            records = [
                r for r in self._records.values() if r.durable and r.id not in self._uncommitted
            ]
            segments = list(self.table.by_key.values())
            next_sid = self.table.sid + 1
            dirty_before = self._dirty_at
            since = self._since_checkpoint
            self._dirty_at = None if not committer.pending() else time.monotonic()
            self._since_checkpoint = 0
        chunks, n_recs = await encode_checkpoint(
            position, self.clock(), next_sid, segments, records
        )
        try:
            size = await self._offload(j.write_checkpoint, chunks)
        except OSError as exc:
            self.metrics.snapshot_failures.labels(reason="write_failed").inc()
            log.warning("checkpoint not written: %s", exc)
            self._dirty_at = dirty_before or time.monotonic()
            self._since_checkpoint += since
            return False
        self.metrics.snapshot_writes.inc()
        self._replay_from, self._checkpoint_size = position, size
        doomed = self.table.keydir.removable(position[0], capture)
        if doomed:
            await committer.run_locked(j.remove, doomed)
            self.table.dropped(doomed)
        log.debug("checkpoint %d: %d records, %d bytes", capture, n_recs, size)
        return True

    # -- introspection -------------------------------------------------------------------

    def snapshot_age(self) -> float:
        return 0.0 if self._dirty_at is None else time.monotonic() - self._dirty_at

    def journal_lag(self) -> float:
        committer = self._committer
        if committer is None or committer.oldest is None:
            return 0.0
        return time.monotonic() - committer.oldest

    def disk_bytes(self) -> int:
        j = self.journal
        room = j.allocated - j.size if j is not None and self._committer is not None else 0
        return sum(self.table.keydir.sizes.values()) + self._checkpoint_size + max(room, 0)

    def stats(self) -> StoreStats:
        committer = self._committer
        return StoreStats(
            records=len(self._records),
            segments=len(self.table),
            resident_segments=len(self.resident),
            resident_bytes=self.resident.bytes,
            disk_segments=self.table.keydir.located,
            disk_bytes=self.disk_bytes(),
            live_bytes=self.table.keydir.live_bytes
            + self._since_checkpoint
            + self._checkpoint_size,
            pending_segments=len(self.table.unwritten),
            pending_bytes=committer.queued_bytes if committer else 0,
            snapshot_age=self.snapshot_age() if self._dirty_at is not None else None,
            available=self.available,
        )

    def _gauges(self) -> None:
        """The store's gauges are read when /metrics is scraped, never kept up to date on
        the request path. They reach the store through a weak reference: registering them
        must not keep a store (a closed WebSocket connection's, say) and its bytes alive."""
        ref = weakref.ref(self)

        def gauge(read: Callable[[Store], float]) -> Callable[[], float]:
            return lambda: read(store) if (store := ref()) is not None else 0.0

        m = self.metrics
        m.store_entries.labels(tier="records").set_function(gauge(lambda s: len(s._records)))
        m.store_entries.labels(tier="resident").set_function(gauge(lambda s: len(s.resident)))
        m.store_bytes.labels(tier="resident").set_function(gauge(lambda s: s.resident.bytes))
        m.store_capacity_entries.labels(tier="records").set(self.max_entries)
        m.store_capacity_bytes.labels(tier="resident").set(self.resident.max_bytes)
        if self.state_dir is not None:
            m.store_capacity_bytes.labels(tier="disk").set(self.max_disk_bytes)
            disk_segments = gauge(lambda s: s.table.keydir.located)
            m.store_entries.labels(tier="disk").set_function(disk_segments)
            m.store_bytes.labels(tier="disk").set_function(gauge(lambda s: s.disk_bytes()))
            m.store_bytes.labels(tier="pending").set_function(
                gauge(lambda s: s._committer.queued_bytes if s._committer else 0)
            )
            m.snapshot_age.set_function(gauge(lambda s: s.snapshot_age()))
            m.journal_lag.set_function(gauge(lambda s: s.journal_lag()))
            m.store_available.set_function(gauge(lambda s: 1.0 if s.available else 0.0))

    def check(self) -> list[str]:
        """Index and journal drift, for tests and `state verify`; call it while idle (it
        reads the journal directory, blocking). Empty when refcounts, byte counts, files
        and locations agree."""
        from ocxproxy.store.check import check_store

        return check_store(self)

    # -- read-only views for check.py -----------------------------------------------------

    def records(self) -> list[Record]:
        return list(self._records.values())

    def segments(self) -> dict[str, Segment]:
        return dict(self.table.by_key)

    def packs(self) -> dict[int, tuple[dict[str, Segment], int, int]]:
        """Journal file -> (segments located there, their bytes as counted, its size)."""
        return self.table.keydir.packs(self.table.by_key)

    def pending_keys(self) -> set[str]:
        return set(self.table.unwritten)


def _unavailable(error: OSError) -> StoreFailure:
    name = errno.errorcode.get(error.errno or 0, "error")
    return StoreFailure(FailureReason.WRITE_FAILED, f"{name}: {error.strerror or error}")
