"""Which records go, and when, on one node: expiry and the caps.

`Expiry` drops records for the Store that owns it (`Store.expiry`), only through
`Store._drop`: expired ones, in short steps of the event loop (`sweep`); the oldest
unpinned ones over --max-entries and segment bytes over the memory cap, after every
change (`enforce`); the oldest durable ones over --max-disk-bytes, when the disk side
asks (`for_disk`). Pinned records (conversations) never go for a cap.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import TYPE_CHECKING

from ocxproxy.errors import FailureReason
from ocxproxy.store.local.upkeep import STEP
from ocxproxy.store.records import NEVER

if TYPE_CHECKING:
    from ocxproxy.store.local.store import Store

SWEEP_DROPS = 64  # most expired records one step of the sweep drops


class Expiry:
    """Expiry and the count, memory and disk caps of the Store that owns it."""

    def __init__(self, store: Store) -> None:
        # A weak reference: the store owns this, and a cycle would keep a connection's
        # memory-only store alive until the garbage collector's next pass.
        self.store: Store = weakref.proxy(store)
        # What `enforce` reads after every change, held here: the store's own objects
        # (a read through the weak proxy costs more than the check).
        self.index, self.resident, self.table = store.index, store.resident, store.table
        self.max_entries = store.max_entries

    async def sweep(self) -> int:
        """Drop expired records; returns how many (not journaled: replay drops them too).

        In steps, the event loop running between them: each looks at one chunk of the
        index's order (at most records.CHUNK records) and drops at most SWEEP_DROPS of
        them, fewer once it has worked upkeep.STEP (a long chain's record takes ~0.1 ms).
        A lookup meanwhile already fails on an expired record (and drops it)."""
        store = self.store
        index, records = store.index, store.index.by_id
        dropped = 0
        for number in index.numbers():
            expired = index.expired(number, store.clock())
            expired.reverse()  # (taken from the end)
            while True:
                until = time.perf_counter() + STEP
                for _ in range(min(SWEEP_DROPS, len(expired))):
                    record = expired.pop()
                    if records.get(record.id) is record:  # (not gone meanwhile)
                        store._drop(record, FailureReason.EXPIRED, "expired", journaled=False)
                        dropped += 1
                    if time.perf_counter() >= until:
                        break
                await asyncio.sleep(0)
                if not expired:
                    break
        return dropped

    def enforce(self) -> None:
        """The oldest unpinned records go over --max-entries; segments leave memory over
        the memory cap."""
        index, resident = self.index, self.resident
        while len(index) > self.max_entries:
            victim = index.oldest_unpinned()
            if victim is None:
                break
            self.store._drop(victim, FailureReason.EVICTED, "max_entries")
        if resident.bytes > resident.max_bytes:  # (no call in the common case)
            self.table.shed()

    def for_disk(self, target: float) -> None:
        """The oldest durable records go (journaled, like a delete) until the live segments
        take `target` bytes of disk; pinned ones never go for a cap."""
        store = self.store
        assert store.ledger is not None
        queued = store.ledger.queued
        for record in store.index.oldest():
            if store.table.keydir.live_bytes <= target:
                return
            if record.durable and not queued(record.id) and record.expires_at < NEVER:
                store._drop(record, FailureReason.EVICTED, "disk_bytes")
