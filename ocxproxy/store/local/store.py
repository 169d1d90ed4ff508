"""Store: the continuation store, and the one owner of its records (records.py's index).

It changes segments only through the SegmentTable (segments.py); a durable record's
entries go to the journal through the Ledger (ledger.py), whose committer's outcomes come
back through narrow calls (disk_side.py's DiskSide answers them); the disk side
(durable.py) owns the files and the checkpoint. Collaborators it owns: KeptRecords
(kept.py: records kept for others), Expiry (expiry.py: what goes and when), DiskSide,
and its conversations and Idempotency-Keys.

Durability (`ack`, the default): `await commit(record)` returns once the record's entries
are fsynced, raising StoreFailure when they could not be written; the HTTP layer awaits
it before acknowledging the turn. `relaxed`: commits happen every `window` seconds and
nobody waits. No state dir (--zdr): memory only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import platformdirs

from ocxproxy.config import Config
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import NO_CALLS, Chain, Record, Segment, Turn, chain_of, shared
from ocxproxy.speedups import SPEEDUPS
from ocxproxy.store.idempotency import ProcessKeys
from ocxproxy.store.interface import Conversations, IdempotencyKeys
from ocxproxy.store.local.background import LocalBackgrounds
from ocxproxy.store.local.committer import Committer, Offload
from ocxproxy.store.local.conversations import LocalConversations
from ocxproxy.store.local.disk_side import DiskSide
from ocxproxy.store.local.durable import Durable
from ocxproxy.store.local.expiry import Expiry
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.kept import KeptRecords
from ocxproxy.store.local.ledger import Ledger
from ocxproxy.store.local.segment_files import LARGE
from ocxproxy.store.local.segments import SegmentTable
from ocxproxy.store.local.stats import StoreStats, register_gauges, stats_of
from ocxproxy.store.local.upkeep import CHECKPOINT_AGE, CHECKPOINT_BYTES
from ocxproxy.store.output import split_output
from ocxproxy.store.process import KEPT_PREFIXES
from ocxproxy.store.records import NEVER, Records, own_segment, turn_record
from ocxproxy.store.resident import ResidentTier

__all__ = ["KEPT_PREFIXES", "NEVER", "Store", "StoreStats", "default_state_dir"]

log = logging.getLogger("ocxproxy.store")

BACKPRESSURE_TIMEOUT = 5.0  # seconds a turn may wait while the journal is behind
# A durable response this many times the large-segment size, raw, is a segment of its own
# (compressed, it is likely a large segment: JSON shrinks ~4x at zstd level 1); a smaller
# one goes into its record's entry, sparing its SHA-256 and segment bookkeeping.
INLINE_RESPONSE_RATIO = 4


def default_state_dir() -> Path:
    return platformdirs.user_state_path("ocxproxy")


class Store:
    """Records by id, their shared segments, and where segment bytes are.

    `put` and the `_nowait` forms of `lookup`, `find_item`, `delete` are synchronous and
    never touch disk (the interface's awaited forms answer with them at once); `sweep`
    works in short steps of the event loop; `history` and `response_bytes` only leave the
    event loop when a segment is not resident. With a `state_dir`, `start()` loads the
    checkpoint and journal and starts the committer.
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
        fsync_child: bool = False,
        make_parents: bool = True,
        large_segment_bytes: int = LARGE,
    ) -> None:
        if durability not in ("ack", "relaxed"):
            raise ValueError(f"unknown durability {durability!r} (ack or relaxed)")
        self.max_entries = max_entries
        self.ttl = ttl
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.resident = ResidentTier(max_resident_bytes, by_digest=True)
        self.backpressure_timeout = BACKPRESSURE_TIMEOUT
        self.state_dir = state_dir
        self.max_disk_bytes = max_disk_bytes
        self.large_response_bytes = INLINE_RESPONSE_RATIO * large_segment_bytes
        self.durability = durability
        self.index = Records()
        self._records = self.index.by_id  # read here; changed only through the index
        self.items = self.index.items
        self.table = SegmentTable(self.resident, self.metrics, offload)
        self.kept = KeptRecords(self)  # conversations' and Idempotency-Keys' records
        self.expiry = Expiry(self)  # expiry and the caps
        self.conversations: Conversations = LocalConversations(self)
        self.idempotency: IdempotencyKeys = ProcessKeys(self)
        self._started = False
        # The members the envelope filled in last (Turn.fill) and their segment.
        self._last_fill: tuple[bytes, Segment | None] = (b"", None)
        self._responses = 0  # the number the last private response segment is named by
        # The disk side, with a state dir; its committer once the journal is open.
        self.ledger: Ledger | None = None
        self.disk: Durable | None = None
        if state_dir is not None:
            self.disk_side = DiskSide(self)  # what the ledger and the disk side ask of it
            self.ledger = Ledger(self.disk_side, self.table)
            self.disk = Durable(
                state_dir,
                self.disk_side,
                self.table,
                self.ledger.applied,
                metrics=self.metrics,
                clock=clock,
                offload=offload,
                window=snapshot_delay if durability == "relaxed" else 0.0,
                max_disk_bytes=max_disk_bytes,
                checkpoint_bytes=max(4096, min(checkpoint_bytes, max_disk_bytes // 8)),
                checkpoint_age=checkpoint_age,
                fsync_child=fsync_child,
                make_parents=make_parents,
                large_segment_bytes=large_segment_bytes,
            )
        self._committer: Committer | None = None
        register_gauges(self)

    @classmethod
    def from_config(cls, config: Config, metrics: Metrics | None = None) -> Store:
        """The proxy's shared store: memory-only under --zdr, else backed by the state dir
        (the default one is created with its parents; a --state-dir needs its parent)."""
        state_dir = None if config.zdr else (config.state_dir or default_state_dir())
        # --retain-unstored's store:false turns are in memory only: the journal holds not
        # all the tier holds, so it keeps the budget of a memory-only store.
        journaled = state_dir is not None and not config.retain_unstored
        return cls(
            max_resident_bytes=config.resident_bytes(journaled=journaled),
            max_entries=config.max_entries,
            ttl=config.ttl,
            metrics=metrics,
            state_dir=state_dir,
            max_disk_bytes=config.max_disk_bytes,
            durability=config.durability,
            snapshot_delay=config.snapshot_delay,
            fsync_child=True,
            make_parents=config.state_dir is None,
            large_segment_bytes=config.large_segment_bytes,
        )

    def __repr__(self) -> str:
        return (
            f"<Store {len(self.index)} records {len(self.table)} segments "
            f"{self.resident!r} {self.journal!r}>"
        )

    def __len__(self) -> int:
        return len(self.index)

    @property
    def durable(self) -> bool:
        """Writes reach the journal (a state dir, opened)."""
        return self._committer is not None

    @property
    def journal(self) -> Journal | None:
        return self.disk.journal if self.disk is not None else None

    @property
    def available(self) -> bool:
        """The disk takes writes, and the disk cap new turns (always, without one)."""
        return self.disk is None or (self.disk.available and not self.disk.full)

    @property
    def full(self) -> bool:
        """The disk takes writes but --max-disk-bytes cannot be met (nothing left to
        evict): only what adds to the store is refused (StoreFailure(FULL))."""
        return self.disk is not None and self.disk.available and self.disk.full

    def count_on_disk(self, bytes_used: Callable[[], int]) -> None:
        """Files of the state dir kept by others (background responses'): counted in
        --max-disk-bytes with the store's own, so records make room for them."""
        if self.disk is not None:
            self.disk.others.append(bytes_used)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the checkpoint and replay the journal (serving every intact chain), then
        start the committer. Idempotent."""
        if self._started:
            return
        self._started = True
        disk, ledger = self.disk, self.ledger
        if disk is not None and ledger is not None:
            await disk.load()  # StateDirUnusable: the proxy refuses to start
            self._committer = self.table.committer = ledger.committer = disk.committer
            self.table.journal, ledger.changed = disk.journal, disk.changed
            # Only now (a lower --max-entries than the state dir was written with):
            # what the caps evict is a journaled delete, and its files outlive the
            # checkpoint that start-up loaded until one without it is durable.
            self.expiry.enforce()

    async def close(self) -> None:
        """Write what is queued (one commit: quick at any backlog) and stop."""
        await self._shutdown(drain=True)

    async def abandon(self) -> None:
        """Stop without writing anything more, as a crash would (for tests)."""
        await self._shutdown(drain=False)

    def backgrounds(self, config: Config) -> LocalBackgrounds:
        """Background responses' bookkeeping, journaled in this store's state dir (its
        files counted in --max-disk-bytes)."""
        book = LocalBackgrounds(
            self.metrics, state_dir=self.state_dir, log_bytes=config.background_log_bytes,
            ttl=self.ttl,
        )  # fmt: skip
        self.count_on_disk(book.disk_bytes)
        return book

    async def _shutdown(self, *, drain: bool) -> None:
        if self.disk is not None:
            await self.disk.shutdown(drain=drain)  # a drain's outcomes are still applied
        self._committer = self.table.committer = None
        if self.ledger is not None:
            self.ledger.committer = None

    async def flush(self) -> bool:
        """Commit what is queued, compact, and write a checkpoint now; True when durable."""
        if self._committer is None or self.disk is None:
            return False
        await self._committer.write()
        return await self.disk.checkpoint()

    async def commit(self, record: Record | None = None) -> None:
        """Until `record`'s entries (or, without one, everything queued so far) are durable.

        In `ack` mode raises StoreFailure(WRITE_FAILED) when they could not be written:
        the turn must not be acknowledged. `relaxed` and memory-only stores return at once.
        Without a record, call it in the step of the event loop that queued the change (as
        the DELETE routes do): a commit that ended before the call is not waited for, so
        its failure is not seen here.
        """
        if record is not None:
            failure = self.index.failed.get(record.id)
            if failure is not None and record.id not in self._records:
                raise failure
        if self.ledger is not None and self.durability == "ack":
            await self.ledger.commit(record)

    async def wait_for_room(self) -> None:
        """Backpressure: while more bytes wait for the journal than half the resident
        budget, a new turn waits (at most `backpressure_timeout`) for a commit."""
        committer, budget = self._committer, self.resident.max_bytes // 2
        if committer is not None and committer.queued_bytes > budget and self.ledger:
            await self.ledger.wait_for_room(budget, self.backpressure_timeout)

    # -- lookups -------------------------------------------------------------------------

    def lookup_nowait(self, scope: str, response_id: str) -> Record:
        """The caller's record for `response_id`, or StoreFailure (another scope = unknown)."""
        if response_id.startswith(KEPT_PREFIXES):
            raise StoreFailure(FailureReason.UNKNOWN)
        return self.record(scope, response_id)

    def record(self, scope: str, record_id: str) -> Record:
        """The caller's record of any kind (a response, or one `keep` wrote)."""
        record = self._records.get(record_id)
        if record is None or record.scope != scope:
            raise self.index.unknown(record_id, found=record is not None)
        if record.expires_at <= self.clock():
            self._drop(record, FailureReason.EXPIRED, "expired", journaled=False)
            raise StoreFailure(FailureReason.EXPIRED)
        return record

    # The handlers' way in (awaited: a shared store's answers take a round trip; here
    # they return at once).
    async def lookup(self, scope: str, response_id: str) -> Record:
        return self.lookup_nowait(scope, response_id)

    async def retrieve(self, scope: str, response_id: str) -> Record:
        # (a record whose chain was lost while its turn ran is kept whole but its chain)
        return self.lookup_nowait(scope, response_id)

    async def find_item(self, scope: str, item_id: str, *, unstored: bool = False) -> Record:
        return self.find_item_nowait(scope, item_id, unstored=unstored)

    async def delete(self, scope: str, response_id: str) -> bool:
        return self.delete_nowait(scope, response_id)

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
        return await self.table.response_bytes(record)

    def find_item_nowait(self, scope: str, item_id: str, *, unstored: bool = False) -> Record:
        """The newest live record of `scope` whose turn added an item with this id (one a
        client did not ask to store only with `unstored`), or StoreFailure."""
        found, expired = self.index.holder(scope, item_id, self.clock(), unstored=unstored)
        for record in expired:
            self._drop(record, FailureReason.EXPIRED, "expired", journaled=False)
        if found is None:
            raise StoreFailure(FailureReason.UNKNOWN)
        return found

    async def item_bytes(self, found: Sequence[tuple[Record, str]]) -> list[bytes]:
        """Each (record, item id)'s item, as the bytes its record's own segment holds."""
        return await self.table.item_bytes(found)

    # -- changes -------------------------------------------------------------------------

    def put(self, turn: Turn, parent: Record | None) -> Record:
        """Remember a finished turn on top of its parent's chain. A durable one is queued
        for the journal: `await commit(record)` before acknowledging it."""
        now = self.clock()
        old = self._records.get(turn.response_id)
        if old is not None:  # a reused id: drop the old record before its segments are shared
            self._drop(old, None, None, journaled=False)  # the new PUT supersedes it
        durable = turn.durable and (parent is None or parent.durable)
        own = self.table.intern(own_segment(turn, durable=False))
        # Cut out in one copy: the members the envelope filled in, when there (Record.fill),
        # and the output where the turn found it (else looked for after).
        fill, spot = turn.fill, turn.output_at
        if fill and spot is not None and turn.fill_at < spot[0] + spot[1]:
            spot = None  # (the fill before the output: the output's place moves)
        cut = _cut(turn.response, turn.fill_at, fill, spot)
        if cut is None:  # (not there: kept in the response)
            fill = b""
            cut = _cut(turn.response, -1, fill, spot)
            assert cut is not None  # (no fill to find)
        size = len(turn.response) - len(fill)  # (the response without the fill)
        if spot is None:
            skeleton, output_at = split_output(cut, turn.items)
        else:
            skeleton, output_at = cut, shared(spot)
        journaled = durable and self._committer is not None
        # A journaled record's response goes into its record's entry (no segment of its
        # own), unless it is large: then it is a segment, which gets a file of its own that
        # compaction never copies.
        inline = journaled and len(skeleton) < self.large_response_bytes
        held: Segment | None
        if inline:
            held = None
        elif durable and self.disk is not None:  # it may reach disk: named by its content
            held = self.table.intern(Segment(skeleton, 0, NO_CALLS, durable=False))
        else:  # its record's alone, never on disk: named by a number (no SHA-256 of it)
            self._responses = number = self._responses + 1
            held = self.table.intern(Segment.private(number.to_bytes(8), skeleton))
        if parent is None:
            segments: tuple[Segment, ...] = (own,)
            chain = Chain(None, own)
        elif self._records.get(parent.id) is parent:
            chain, segments = Chain(parent.links, own), (*parent.segments, own)
            parent.built = None  # the newest record of the chain keeps it built
        else:  # dropped meanwhile, or another store's record: take its segments in
            # (not those the disk cap evicted: a turn in flight would bring its chain back)
            evicted = parent.id in self.expiry.for_disk_ids
            adopt = self.table.adopt
            segments = (*(adopt(s, durable, evicted=evicted) for s in parent.segments), own)
            chain = Chain(chain_of(segments[:-1]), own)
        record = turn_record(
            Record, turn, parent, now=now, ttl=self.ttl, durable=durable, links=chain,
            segments=segments, response=skeleton if held is None else held, output_at=output_at,
        )  # fmt: skip
        if not fill:
            taken = segments if held is None else (*segments, held)
        else:  # held by every record of a turn with the same ones (`_fill_segment`)
            last, kept = self._last_fill
            if last is not fill or kept is None or kept.refs <= 0 or kept.data is None:
                kept = self._fill_segment(fill)
            record.fill, record.fill_at = kept, size - turn.fill_at
            taken = (*segments, kept) if held is None else (*segments, held, kept)
        self.table.hold(taken, durable=durable)
        self.index.add(record)
        if journaled:
            assert self.disk is not None
            if self.disk.full:  # over --max-disk-bytes, nothing to evict: `commit` raises
                failure = StoreFailure(FailureReason.FULL, "over --max-disk-bytes")
                self.disk_side.unwritten(record, failure)
            else:
                self._journal_put(record, parent)
        self.expiry.enforce()
        return record

    def _fill_segment(self, fill: bytes) -> Segment:
        """The segment of the members the envelope filled in (Turn.fill), kept as the last
        one for the turns after: a coding agent's ~28 KB of instructions and tools are
        hashed once for every turn that shares their bytes object (or equal bytes), not
        kept in each turn's response."""
        last, segment = self._last_fill
        if segment is None or segment.refs <= 0 or (last is not fill and last != fill):
            segment = self.table.intern(Segment(fill, 0, NO_CALLS, durable=False))
        elif segment.data is None:  # its bytes back, from this turn's (the same)
            again = Segment.restore(segment.key, len(fill), 0, NO_CALLS, durable=False, data=fill)
            segment = self.table.intern(again)
        self._last_fill = fill, segment
        self.resident.hot = segment  # recently used for as long as turns use it
        return segment

    def delete_nowait(self, scope: str, response_id: str, *, kept: bool = False) -> bool:
        """Forget a record (one `keep` wrote when `kept`; journaled: `await commit()`
        before acknowledging)."""
        record = self._records.get(response_id)
        if record is None or record.scope != scope:
            return False
        if response_id.startswith(KEPT_PREFIXES) != kept:
            return False
        self._drop(record, None, None)
        return True

    async def sweep(self) -> int:
        """Drop expired records; how many (`Expiry.sweep`)."""
        return await self.expiry.sweep()

    def _journal_put(self, record: Record, parent: Record | None) -> None:
        assert self.ledger is not None
        # A live durable parent's PUT precedes this one in the journal: name it.
        named = parent is not None and self._records.get(parent.id) is parent and parent.durable
        self.ledger.put(record, parent.id if named and parent else None)

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
        self.index.remove(record, reason)
        if label is not None:
            self.metrics.store_evictions.labels(reason=label).inc()
        if record.durable and self._committer is not None and self.ledger is not None:
            self.ledger.delete(record, journaled=journaled)
        response = record.response
        released = record.segments[shared:]
        if record.fill is not None:
            released = (*released, record.fill)
        if type(response) is Segment:
            self.table.release((*released, response), durable=record.durable)
            return
        self.table.release(released, durable=record.durable)
        if type(response) is int:
            self.table.keydir.unlocate_response(response)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> StoreStats:
        return stats_of(self)

    def check(self) -> list[str]:
        """Index and journal drift, for tests and `state verify`; call it while idle (it
        reads the journal directory, blocking). Empty when refcounts, byte counts, files
        and locations agree."""
        from ocxproxy.store.local.check import check_store

        return check_store(self)

    # -- read-only views for check.py -----------------------------------------------------

    def records(self) -> list[Record]:
        """Every record, oldest first."""
        return self.index.oldest()

    def segments(self) -> dict[str, Segment]:
        """Every segment, by key (hex)."""
        return {s.key: s for s in self.table.by_key.values()}

    def packs(self) -> dict[int, tuple[dict[str, Segment], int, int]]:
        """Journal file -> (segments located there, their bytes as counted, its size)."""
        return self.table.keydir.packs(self.table.by_key.values())


def _cut_bytes(data: bytes, at: int, part: bytes, span: tuple[int, int] | None) -> bytes | None:
    """`data` without `part`, which it holds at `at` (an empty `part`: nothing there to
    cut), and without `span` (start, length), which must not overlap it; None when `part`
    is not at `at`. (Compiled: _speedups.cut, one allocation.)"""
    if part and (at < 0 or not data.startswith(part, at)):
        return None
    runs = sorted(run for run in ((at, len(part)) if part else None, span) if run)
    if len(runs) == 2 and runs[0][0] + runs[0][1] > runs[1][0]:
        raise ValueError("cut(): the span overlaps the part")
    pieces, was = [], 0
    for start, length in runs:
        pieces.append(data[was:start])
        was = start + length
    return b"".join((*pieces, data[was:])) if runs else data


_cut: Callable[[bytes, int, bytes, tuple[int, int] | None], bytes | None] = (
    _cut_bytes if SPEEDUPS is None else SPEEDUPS.cut
)
