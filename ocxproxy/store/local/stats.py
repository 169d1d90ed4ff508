"""The store seen from outside: `StoreStats`, and the gauges /metrics reads at scrape
time (never kept up to date on the request path). Reads only; writes nothing."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ocxproxy.store.local.durable import Durable
    from ocxproxy.store.local.store import Store


@dataclass(frozen=True, slots=True)
class StoreStats:
    records: int
    segments: int
    resident_segments: int
    resident_bytes: int
    disk_segments: int  # segments whose bytes the journal holds
    disk_bytes: int  # what the state dir occupies: journal files, segment files, checkpoint
    live_bytes: int = 0  # of that, what the store needs: live segments, tail, checkpoint
    pending_segments: int = 0  # queued for the next commit
    pending_bytes: int = 0
    snapshot_age: float | None = None  # oldest change not in the checkpoint (None: none)
    available: bool = True


def stats_of(store: Store) -> StoreStats:
    table, disk = store.table, store.disk
    kept = disk.since_checkpoint + disk.checkpoint_size if disk is not None else 0
    dirty = disk is not None and disk.dirty_at is not None
    return StoreStats(
        records=len(store),
        segments=len(table),
        resident_segments=len(store.resident),
        resident_bytes=store.resident.bytes,
        disk_segments=table.keydir.located,
        disk_bytes=disk.disk_bytes() if disk is not None else 0,
        live_bytes=table.keydir.live_bytes + kept,
        pending_segments=len(table.unwritten),
        pending_bytes=disk.queued_bytes() if disk is not None else 0,
        snapshot_age=disk.snapshot_age() if disk is not None and dirty else None,
        available=store.available,
    )


def register_gauges(store: Store) -> None:
    """The store's gauges reach it through a weak reference: registering them must not
    keep a store (a closed WebSocket connection's, say) and its bytes alive."""
    ref = weakref.ref(store)

    def gauge(read: Callable[[Store], float]) -> Callable[[], float]:
        return lambda: read(s) if (s := ref()) is not None else 0.0

    m = store.metrics
    m.store_entries.labels(tier="records").set_function(gauge(len))
    m.store_entries.labels(tier="resident").set_function(gauge(lambda s: len(s.resident)))
    m.store_bytes.labels(tier="resident").set_function(gauge(lambda s: s.resident.bytes))
    m.store_capacity_entries.labels(tier="records").set(store.max_entries)
    m.store_capacity_bytes.labels(tier="resident").set(store.resident.max_bytes)
    if store.disk is None:
        return
    m.store_capacity_bytes.labels(tier="disk").set(store.max_disk_bytes)
    m.store_entries.labels(tier="disk").set_function(gauge(lambda s: s.table.keydir.located))
    m.store_bytes.labels(tier="disk").set_function(gauge(lambda s: _of(s).disk_bytes()))
    m.store_bytes.labels(tier="pending").set_function(gauge(lambda s: _of(s).queued_bytes()))
    m.snapshot_age.set_function(gauge(lambda s: _of(s).snapshot_age()))
    m.journal_lag.set_function(gauge(lambda s: _of(s).journal_lag()))
    m.store_available.set_function(gauge(lambda s: 1.0 if s.available else 0.0))


def _of(store: Store) -> Durable:
    assert store.disk is not None  # (a store has its disk side from the start, or never)
    return store.disk
