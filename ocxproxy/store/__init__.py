"""The continuation store: records of remembered responses and the segments they share.

Owns memory and disk state; never imports aiohttp or the upstream package. Every way a
lookup can fail is a StoreFailure with a FailureReason. Public surface: Store, StoreStats.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store.resident import ResidentTier

_TOMBSTONES = 10_000  # remembered ids of dropped records, to count why a lookup failed


@dataclass(frozen=True, slots=True)
class StoreStats:
    records: int
    segments: int
    resident_segments: int
    resident_bytes: int
    disk_segments: int
    disk_bytes: int


class Store:
    def __init__(
        self,
        *,
        max_resident_bytes: int,
        max_entries: int,
        ttl: float,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.resident = ResidentTier(max_resident_bytes)
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._segments: dict[str, Segment] = {}
        self._tombstones: OrderedDict[str, FailureReason] = OrderedDict()

    def __repr__(self) -> str:
        return (
            f"<Store {len(self._records)} records {len(self._segments)} segments {self.resident!r}>"
        )

    def __len__(self) -> int:
        return len(self._records)

    # -- lookups -------------------------------------------------------------------------

    def lookup(self, scope: str, response_id: str) -> Record:
        """The caller's record for `response_id`, or StoreFailure (another scope = unknown)."""
        record = self._records.get(response_id)
        if record is None or record.scope != scope:
            if record is None and response_id in self._tombstones:
                raise StoreFailure(self._tombstones[response_id])
            raise StoreFailure(FailureReason.UNKNOWN)
        if record.expires_at <= self.clock():
            self._drop(record, FailureReason.EXPIRED)
            raise StoreFailure(FailureReason.EXPIRED)
        return record

    async def history(self, record: Record) -> list[bytes]:
        """The chain's segment bytes, oldest first (empty segments left out)."""
        parts: list[bytes] = []
        for segment in record.segments:
            data = await self._read(segment)
            if data:
                parts.append(data)
        return parts

    async def response_bytes(self, record: Record) -> bytes:
        return await self._read(record.response)

    async def _read(self, segment: Segment) -> bytes:
        data = segment.data
        if data is not None:
            self.resident.touch(segment)
            return data
        raise StoreFailure(FailureReason.EVICTED, segment.key)

    # -- changes -------------------------------------------------------------------------

    def put(self, turn: Turn, parent: Record | None) -> Record:
        """Remember a finished turn on top of its parent's chain."""
        now = self.clock()
        own = self._intern(Segment(turn.items, turn.n_items, turn.call_ids, durable=turn.durable))
        response = self._intern(Segment(turn.response, 0, frozenset(), durable=turn.durable))
        chain = (*parent.segments, own) if parent is not None else (own,)
        old = self._records.get(turn.response_id)
        if old is not None:
            self._drop(old, None)
        record = Record(
            id=turn.response_id,
            scope=turn.scope,
            created_at=now,
            expires_at=now + self.ttl,
            durable=turn.durable and (parent is None or parent.durable),
            segments=chain,
            response=response,
            backend=turn.backend,
            affinity_key=turn.affinity_key,
            n_items=(parent.n_items if parent else 0) + turn.n_items,
        )
        for segment in (*chain, response):
            segment.refs += 1
        self._records[record.id] = record
        self._enforce_bounds(keep=frozenset((own.key, response.key)))
        self._publish()
        return record

    def delete(self, scope: str, response_id: str) -> bool:
        record = self._records.get(response_id)
        if record is None or record.scope != scope:
            return False
        self._drop(record, None)
        self._publish()
        return True

    def sweep(self) -> int:
        """Drop expired records; returns how many."""
        now = self.clock()
        expired = [r for r in self._records.values() if r.expires_at <= now]
        for record in expired:
            self._drop(record, FailureReason.EXPIRED)
        if expired:
            self._publish()
        return len(expired)

    def _intern(self, segment: Segment) -> Segment:
        existing = self._segments.get(segment.key)
        if existing is not None:
            if existing.data is None:  # lost or on disk only: take the fresh bytes back
                existing.data = segment.data
                self.resident.admit(existing)
            self.resident.touch(existing)
            existing.durable = existing.durable and segment.durable
            return existing
        self._segments[segment.key] = segment
        self.resident.admit(segment)
        return segment

    def _drop(self, record: Record, reason: FailureReason | None) -> None:
        del self._records[record.id]
        if reason is not None:
            self._tombstones[record.id] = reason
            if len(self._tombstones) > _TOMBSTONES:
                self._tombstones.popitem(last=False)
            self.metrics.store_evictions.labels(reason=str(reason)).inc()
        for segment in (*record.segments, record.response):
            segment.refs -= 1
            if segment.refs <= 0:
                self._forget(segment)

    def _forget(self, segment: Segment) -> None:
        self._segments.pop(segment.key, None)
        self.resident.remove(segment)
        segment.data = None

    def _enforce_bounds(self, keep: frozenset[str]) -> None:
        while len(self._records) > self.max_entries:
            oldest = next(iter(self._records.values()))
            self._drop(oldest, FailureReason.EVICTED)
        for segment in self.resident.over_budget(keep):
            # No disk tier here: the bytes are gone, chains that need them fail as evicted.
            segment.data = None
            self.metrics.store_evictions.labels(reason="resident_bytes").inc()

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> StoreStats:
        on_disk = [s for s in self._segments.values() if s.on_disk]
        return StoreStats(
            records=len(self._records),
            segments=len(self._segments),
            resident_segments=len(self.resident),
            resident_bytes=self.resident.bytes,
            disk_segments=len(on_disk),
            disk_bytes=sum(s.size for s in on_disk),
        )

    def _publish(self) -> None:
        m = self.metrics
        m.store_entries.labels(tier="records").set(len(self._records))
        m.store_entries.labels(tier="resident").set(len(self.resident))
        m.store_bytes.labels(tier="resident").set(self.resident.bytes)

    def check(self) -> list[str]:
        """Index drift, for tests: refcounts and the resident byte count must add up."""
        problems: list[str] = []
        refs: dict[str, int] = {}
        for record in self._records.values():
            for segment in (*record.segments, record.response):
                refs[segment.key] = refs.get(segment.key, 0) + 1
                if self._segments.get(segment.key) is not segment:
                    problems.append(f"{record.id} references unindexed {segment.key}")
        for key, segment in self._segments.items():
            if segment.refs != refs.get(key, 0):
                problems.append(f"{key} refs {segment.refs} != {refs.get(key, 0)}")
        if sum(s.size for s in self.resident) != self.resident.bytes:
            problems.append("resident byte count drifted")
        return problems

    async def close(self) -> None:
        await asyncio.sleep(0)
