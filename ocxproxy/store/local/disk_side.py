"""What the disk side asks of the store: the calls through which the ledger (ledger.py's
`Owner`) and the durable state (durable.py's `Owner`) hand work and outcomes back.

`DiskSide` answers them for the Store that owns it (`Store.disk_side`), changing records
only as `Store` does (through its index, segment table and `_drop`): start-up's records
built from what was read, a PUT that failed dropped unacknowledged, the caps enforced
after a commit, records evicted for the disk cap, the checkpoint's view of the records.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Record
from ocxproxy.store.local.codec import Loaded

if TYPE_CHECKING:
    from ocxproxy.store.local.store import Store

log = logging.getLogger("ocxproxy.store")


class DiskSide:
    """The Store's side of its ledger and durable state."""

    def __init__(self, store: Store) -> None:
        # A weak reference: the store owns this (and its ledger and disk side hold this).
        self.store: Store = weakref.proxy(store)

    def __len__(self) -> int:
        return len(self.store.index)

    def restore(self, loaded: Loaded) -> None:
        """Build records and segments from what start-up read (the caps are enforced
        once the journal takes entries: `Store.start`)."""
        store = self.store
        records, missing = store.table.restore(loaded, store.clock())
        store.index.restore(records, missing)
        if missing:
            store.metrics.spill_failures.labels(reason=str(FailureReason.MISSING)).inc(len(missing))
            log.warning("journal: %d records need segments that are gone", len(missing))

    def unwritten(self, record: Record, failure: StoreFailure) -> None:
        """`record`'s PUT failed; it goes, unacknowledged (`commit` answers `failure`)."""
        store = self.store
        if store.index.by_id.get(record.id) is record:
            store._drop(record, None, None, journaled=False)
            store.index.fail(record.id, failure)

    def holds(self, record: Record) -> bool:
        return self.store.index.by_id.get(record.id) is record

    def moved(self, record: Record) -> None:
        store = self.store
        store.index.changed(record, store.table.keydir.captures)

    def unchanged(self, number: int, count: int, since: int) -> bool:
        store = self.store
        return store.table.keydir.lost_at < since and store.index.unchanged(number, count, since)

    def record(self, record_id: str) -> Record | None:
        return self.store.index.by_id.get(record_id)

    def settle(self) -> None:
        """Back within the caps after a commit's outcome."""
        self.store.expiry.enforce()

    async def evict_for_disk(self, target: float, limit: float, per_record: float) -> bool:
        return await self.store.expiry.for_disk(target, limit, per_record)

    def checkpoint_view(self) -> tuple[list[Record], list[tuple[int, int]], set[str]]:
        store = self.store
        assert store.ledger is not None
        return store.index.oldest(), store.index.layout(), store.ledger.uncommitted()
