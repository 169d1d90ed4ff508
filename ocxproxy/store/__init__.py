"""The continuation store: records of remembered responses and the segments they share.

Owns memory and disk state; never imports aiohttp, ocxproxy.http or ocxproxy.upstream.
Every way a lookup can fail is a StoreFailure with a FailureReason. Segments live in the
resident tier (memory, byte-capped LRU) and, for durable ones, in the disk tier (spill
files + snapshot, see disk.py); past the memory cap the oldest are demoted to disk, and
content no durable record holds (store:false turns) is dropped instead: it never
reaches disk.
Public surface: Store, StoreStats, default_state_dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from ocxproxy.config import Config
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import ItemIds, Record, Segment, Turn
from ocxproxy.store.disk import DiskTier, Offload, Opened
from ocxproxy.store.items import ItemIndex
from ocxproxy.store.resident import ResidentTier

__all__ = ["Store", "StoreStats", "default_state_dir"]

log = logging.getLogger("ocxproxy.store")

_TOMBSTONES = 10_000  # remembered ids of dropped records, to count why a lookup failed
BACKPRESSURE_TIMEOUT = 5.0  # seconds a turn may wait for the spill writer
_OUTPUT = b'"output":['


def default_state_dir() -> Path:
    return platformdirs.user_state_path("ocxproxy")


@dataclass(frozen=True, slots=True)
class StoreStats:
    records: int
    segments: int
    resident_segments: int
    resident_bytes: int
    disk_segments: int
    disk_bytes: int
    pending_segments: int = 0  # demoted, waiting for their spill file
    pending_bytes: int = 0
    snapshot_age: float | None = None


class Store:
    """Records by id, their shared segments, and the tiers that hold segment bytes.

    `put`, `lookup`, `delete` and `sweep` are synchronous and never touch disk; `history`
    and `response_bytes` only leave the event loop when a segment is not resident. With a
    `state_dir`, `start()` loads the snapshot and starts the writer; `close()` flushes.
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
        snapshot_delay: float = 2.0,
        offload: Offload = asyncio.to_thread,
    ) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.resident = ResidentTier(max_resident_bytes)
        self.backpressure_timeout = BACKPRESSURE_TIMEOUT
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._segments: dict[str, Segment] = {}
        self._tombstones: OrderedDict[str, FailureReason] = OrderedDict()
        self.items = ItemIndex()
        self._started = False
        self._offload = offload
        self.disk: DiskTier | None = None
        if state_dir is not None:
            self.disk = DiskTier(
                state_dir,
                max_bytes=max_disk_bytes,
                snapshot_delay=snapshot_delay,
                metrics=self.metrics,
                clock=clock,
                offload=offload,
                index=self._segments,
                resident=self.resident,
                durable_records=self._durable_records,
            )
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
            snapshot_delay=config.snapshot_delay,
        )

    def __repr__(self) -> str:
        return (
            f"<Store {len(self._records)} records {len(self._segments)} segments "
            f"{self.resident!r} {self.disk!r}>"
        )

    def __len__(self) -> int:
        return len(self._records)

    @property
    def _has_disk(self) -> bool:
        return self.disk is not None and self.disk.enabled

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the snapshot (serving every intact chain) and start the writer. Idempotent."""
        if self._started:
            return
        self._started = True
        disk = self.disk
        if disk is None:
            return
        opened = await self._offload(disk.open)
        if opened is None:
            return
        if opened.error is not None:
            disk.metrics.snapshot_failures.labels(reason=opened.error.reason).inc()
            log.error("snapshot unusable (%s): starting empty; spill files kept", opened.error)
        self._restore(opened)
        removed = await self._offload(disk.sweep, opened, set(self._segments))
        log.info(
            "store loaded: %d records, %d files (%d bytes) from %s; %d stale entries removed",
            len(self._records), len(disk.files), disk.bytes, disk.root, removed,
        )  # fmt: skip
        disk.start()

    async def flush(self) -> bool:
        """Write out every demoted segment and a snapshot now; True when durable."""
        return await self.disk.flush() if self.disk is not None else False

    async def wait_for_room(self) -> None:
        """Backpressure: while more demoted bytes wait for their spill file than the
        resident budget, a new turn waits (at most `backpressure_timeout`) for the writer
        to catch up, so memory stays near its cap when requests outrun fsync."""
        disk, budget = self.disk, self.resident.max_bytes
        if disk is None or disk.pending_bytes <= budget:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.backpressure_timeout):
                while disk.pending_bytes > budget:
                    await disk.wait_progress()

    async def close(self) -> None:
        if self.disk is not None:
            await self.disk.close()

    async def abandon(self) -> None:
        """Stop the writer without flushing, as a crash would (for tests)."""
        if self.disk is not None:
            await self.disk.abandon()

    def _restore(self, opened: Opened) -> None:
        index = opened.index
        if index is None:
            return
        assert self.disk is not None
        now = self.clock()
        on_disk = opened.scan.files
        segs = [
            Segment.restore(
                s.key,
                s.size,
                s.n_items,
                s.call_ids,
                durable=True,
                data=b"" if not s.size else None,
                item_ids=ItemIds(s.item_ids),
            )
            for s in index.segments
        ]
        missing: set[str] = set()
        skipped = 0
        for info in index.records:
            chain = tuple(segs[i] for i in info.chain)
            response = segs[info.response]
            if info.expires_at <= now or info.id in self._records:
                skipped += 1
                continue
            absent = [s for s in (*chain, response) if s.size and s.key not in on_disk]
            if absent:
                skipped += 1
                missing.update(s.key for s in absent)
                self._tombstone(info.id, FailureReason.MISSING)
                continue
            for segment in (*chain, response):
                if segment.refs == 0:
                    self._segments[segment.key] = segment
                    if segment.size:
                        self.disk._add_file(segment, on_disk[segment.key])
                self._hold(segment, durable=True)
            self._records[info.id] = record = Record(
                id=info.id,
                scope=info.scope,
                created_at=info.created_at,
                expires_at=info.expires_at,
                durable=True,
                segments=chain,
                response=response,
                backend=info.backend,
                affinity_key=info.affinity_key,
                n_items=info.n_items,
                output_at=info.output_at,
            )
            self.items.add(record)
        if missing:
            self.metrics.spill_failures.labels(reason=str(FailureReason.MISSING)).inc(len(missing))
            log.warning("snapshot names %d spill files that are gone", len(missing))
        if skipped:  # rewrite the index without them
            self.disk.mark_dirty()
        self._enforce_bounds()
        self.disk._enforce_cap()

    # -- lookups -------------------------------------------------------------------------

    def lookup(self, scope: str, response_id: str) -> Record:
        """The caller's record for `response_id`, or StoreFailure (another scope = unknown)."""
        record = self._records.get(response_id)
        if record is None or record.scope != scope:
            if record is None and response_id in self._tombstones:
                raise StoreFailure(self._tombstones[response_id])
            raise StoreFailure(FailureReason.UNKNOWN)
        if record.expires_at <= self.clock():
            self._drop(record, FailureReason.EXPIRED, "expired")
            raise StoreFailure(FailureReason.EXPIRED)
        return record

    async def history(self, record: Record) -> list[bytes]:
        """The chain's segment bytes, oldest first (empty segments left out)."""
        segments = record.segments
        datas = [s.data for s in segments]
        if None in datas:
            return [d for d in await self._fetch(segments) if d]
        self.resident.touch_all(segments)
        return [d for d in datas if d]

    async def response_bytes(self, record: Record) -> bytes:
        """The stored response object, with its output items put back when they were cut."""
        if record.output_at is None:
            (skeleton,) = await self._fetch((record.response,))
            return skeleton
        skeleton, own = await self._fetch((record.response, record.segments[-1]))
        offset, length = record.output_at
        return b"".join((skeleton[:offset], own[len(own) - length :], skeleton[offset:]))

    async def _fetch(self, segments: Sequence[Segment]) -> list[bytes]:
        """Bytes of each segment, reading the non-resident ones from disk in a thread and
        taking them back into the resident tier."""
        datas = [s.data for s in segments]
        cold = list({id(s): s for s, d in zip(segments, datas, strict=True) if d is None}.values())
        for segment in cold:
            if segment.lost is not None:
                raise StoreFailure(FailureReason(segment.lost), segment.key)
            if not segment.on_disk or self.disk is None:
                raise StoreFailure(FailureReason.EVICTED, segment.key)
        results = await self.disk.read(cold) if cold and self.disk is not None else []
        got: dict[int, bytes] = {}
        failure: StoreFailure | None = None
        for segment, result in zip(cold, results, strict=True):
            live = self._segments.get(segment.key) is segment
            if isinstance(result, bytes):
                self.metrics.spill_reads.inc()
                got[id(segment)] = result
                if live and segment.data is None:
                    segment.data = result
                    self._admit(segment)
                continue
            self.metrics.spill_failures.labels(reason=str(result.reason)).inc()
            log.warning("spill read failed for segment %s: %s", segment.key[:12], result)
            if live and result.reason != FailureReason.READ_FAILED and segment.data is None:
                if self.disk is not None:
                    self.disk.discard(segment, reusable=False)
                segment.lost = segment.lost or str(result.reason)
            failure = failure or StoreFailure(FailureReason(segment.lost or result.reason))
        if failure is not None:
            raise failure
        if got:
            self._enforce_bounds()
        return [d if d is not None else got[id(s)] for s, d in zip(segments, datas, strict=True)]

    def find_item(self, scope: str, item_id: str, *, unstored: bool = False) -> Record:
        """The newest live record of `scope` whose turn added an item with this id (one a
        client did not ask to store only with `unstored`), or StoreFailure."""
        now = self.clock()
        for record in self.items.holders(scope, item_id):
            own = record.segments[-1]
            if record.expires_at <= now:
                self._drop(record, FailureReason.EXPIRED, "expired")
            elif (record.stored or unstored) and (own.data is not None or own.on_disk):
                return record  # (a holder whose bytes were dropped cannot serve it)
        raise StoreFailure(FailureReason.UNKNOWN)

    async def item_bytes(self, found: Sequence[tuple[Record, str]]) -> list[bytes]:
        """Each (record, item id)'s item, as the bytes its record's own segment holds."""
        segments = [record.segments[-1] for record, _ in found]
        datas = await self._fetch(segments)
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
        """Remember a finished turn on top of its parent's chain."""
        now = self.clock()
        old = self._records.get(turn.response_id)
        if old is not None:  # a reused id: drop the old record before its segments are shared
            self._drop(old, None, None)
        durable = turn.durable and (parent is None or parent.durable)
        own = self._intern(
            Segment(turn.items, turn.n_items, turn.call_ids, durable=False, item_ids=turn.item_ids)
        )
        skeleton, output_at = split_output(turn.response, turn.items)
        response = self._intern(Segment(skeleton, 0, frozenset(), durable=False))
        if parent is None:
            chain: tuple[Segment, ...] = (own,)
        elif self._records.get(parent.id) is parent:
            chain = (*parent.segments, own)
        else:  # dropped meanwhile, or another store's record: take its segments in
            chain = (*(self._adopt(s, durable) for s in parent.segments), own)
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
        for segment in (*chain, response):
            self._hold(segment, durable=durable)
        self._records[record.id] = record
        self.items.add(record)
        self._tombstones.pop(record.id, None)
        if record.durable and self.disk is not None:
            self.disk.mark_dirty()
        self._enforce_bounds()
        return record

    def delete(self, scope: str, response_id: str) -> bool:
        """Forget a record: memory now, its files after the next snapshot (which omits it)."""
        record = self._records.get(response_id)
        if record is None or record.scope != scope:
            return False
        self._drop(record, None, None)
        return True

    def sweep(self) -> int:
        """Drop expired records; returns how many."""
        now = self.clock()
        expired = [r for r in self._records.values() if r.expires_at <= now]
        for record in expired:
            self._drop(record, FailureReason.EXPIRED, "expired")
        return len(expired)

    def _admit(self, segment: Segment) -> None:
        if segment.size:
            self.resident.admit(segment)

    def _intern(self, segment: Segment) -> Segment:
        existing = self._segments.get(segment.key)
        if existing is None:
            self._segments[segment.key] = segment
            self._admit(segment)
            return segment
        if existing.data is None:  # on disk only, or lost: take the fresh bytes back
            existing.data = segment.data
            existing.lost = None
        if not existing.item_ids:  # restored from a snapshot written before item ids
            existing.item_ids = segment.item_ids
        self._admit(existing)
        return existing

    def _adopt(self, segment: Segment, durable: bool) -> Segment:
        """This store's segment for a segment object it does not index, for a record that
        is `durable` or not."""
        mine = self._segments.get(segment.key)
        if mine is segment:
            return mine
        if mine is not None:
            if mine.data is None and segment.data is not None:
                mine.data, mine.lost = segment.data, None
                self._admit(mine)
            return mine
        copy = Segment.restore(
            segment.key,
            segment.size,
            segment.n_items,
            segment.call_ids,
            durable=False,
            data=segment.data,
            item_ids=segment.item_ids,
        )
        self._segments[copy.key] = copy
        if copy.data is not None:
            self._admit(copy)
        elif not (durable and self.disk is not None and self.disk.resurrect(copy)):
            copy.lost = str(FailureReason.EVICTED)
        return copy

    def _tombstone(self, response_id: str, reason: FailureReason) -> None:
        self._tombstones[response_id] = reason
        if len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _drop(self, record: Record, reason: FailureReason | None, label: str | None) -> None:
        del self._records[record.id]
        self.items.remove(record)
        if reason is not None:
            self._tombstone(record.id, reason)
        if label is not None:
            self.metrics.store_evictions.labels(reason=label).inc()
        if record.durable and self.disk is not None:
            self.disk.mark_dirty()
        for segment in (*record.segments, record.response):
            self._release(segment, durable=record.durable)

    def _hold(self, segment: Segment, *, durable: bool) -> None:
        """A record takes the segment. A segment may reach disk while, and only while, a
        durable record holds it: store:false content shared by a store:true turn (the
        same bytes, content-addressed) stops being durable when that turn goes."""
        segment.refs += 1
        if durable:
            segment.durable_refs += 1
            segment.durable = True

    def _release(self, segment: Segment, *, durable: bool) -> None:
        segment.refs -= 1
        if durable:
            segment.durable_refs -= 1
            if segment.durable_refs <= 0:
                segment.durable = False
                if segment.refs > 0:
                    self._undurable(segment)
        if segment.refs <= 0:
            self._forget(segment)

    def _undurable(self, segment: Segment) -> None:
        """Only records that may not reach disk still hold the segment: its file goes (after
        the next snapshot, which no longer names it); bytes only on disk go with it."""
        if segment.on_disk and self.disk is not None:
            self.disk.discard(segment)
            if segment.data is None:
                segment.lost = str(FailureReason.EVICTED)

    def _forget(self, segment: Segment) -> None:
        # The object keeps its bytes for anyone still holding it (an in-flight exchange's
        # parent record); put() adopts them back.
        del self._segments[segment.key]
        self.resident.remove(segment)
        if segment.on_disk and self.disk is not None:
            self.disk.discard(segment)

    def _enforce_bounds(self) -> None:
        while len(self._records) > self.max_entries:
            self._drop(next(iter(self._records.values())), FailureReason.EVICTED, "max_entries")
        # Demoted segments stay in memory until their file is durable: they count against
        # the budget, so a burst the disk cannot absorb shrinks the resident tier instead.
        held = self.disk.pending_bytes if self.disk is not None else 0
        for segment in self.resident.over_budget(held=held):
            if segment.on_disk:
                segment.data = None  # its file is durable: just release the bytes
            elif segment.durable and self._has_disk:
                assert self.disk is not None
                self.disk.enqueue(segment)  # stays in memory until its file is durable
            else:  # store:false content, or no disk tier: gone
                segment.data = None
                segment.lost = str(FailureReason.EVICTED)
                self.metrics.store_evictions.labels(reason="resident_bytes").inc()

    def _durable_records(self) -> list[Record]:
        now = self.clock()
        return [r for r in self._records.values() if r.durable and r.expires_at > now]

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> StoreStats:
        disk = self.disk
        return StoreStats(
            records=len(self._records),
            segments=len(self._segments),
            resident_segments=len(self.resident),
            resident_bytes=self.resident.bytes,
            disk_segments=len(disk.files) if disk else 0,
            disk_bytes=disk.bytes if disk else 0,
            pending_segments=len(disk.pending) if disk else 0,
            pending_bytes=disk.pending_bytes if disk else 0,
            snapshot_age=disk._snapshot_age() if disk and disk.last_snapshot else None,
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
        if self.disk is not None:
            m.store_capacity_bytes.labels(tier="disk").set(self.disk.max_bytes)
            m.store_entries.labels(tier="disk").set_function(gauge(_disk_files))
            m.store_bytes.labels(tier="disk").set_function(gauge(_disk_bytes))
            m.store_bytes.labels(tier="pending").set_function(gauge(_pending_bytes))

    def check(self) -> list[str]:
        """Index and file drift, for tests and `state verify`; call it while idle (it lists
        the spill directory, blocking). Empty when refcounts, byte counts and files agree."""
        from ocxproxy.store.check import check_store

        return check_store(self)


def _disk_files(store: Store) -> float:
    return len(store.disk.files) if store.disk else 0


def _disk_bytes(store: Store) -> float:
    return store.disk.bytes if store.disk else 0


def _pending_bytes(store: Store) -> float:
    return store.disk.pending_bytes if store.disk else 0


def split_output(response: bytes, items: bytes) -> tuple[bytes, tuple[int, int] | None]:
    """Cut from `response` the leading bytes of its output array that equal the tail of
    `items` (the same serialized output items), so they are stored once. Any cut is
    verified byte for byte, so putting them back always restores `response` exactly."""
    start = response.find(_OUTPUT)
    if start < 0:
        return response, None
    start += len(_OUTPUT)
    probe = response[start : start + 64]
    if not probe or probe.startswith(b"]"):
        return response, None
    at = items.find(probe)
    for _ in range(4):
        if at < 0:
            break
        length = len(items) - at
        if response.startswith(items[at:], start):
            return response[:start] + response[start + length :], (start, length)
        at = items.find(probe, at + 1)
    return response, None
