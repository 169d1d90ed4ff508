"""Records the store keeps for others: conversations and completed Idempotency-Keys.

Their ids (`conv_…`, `idem_…`) are never a response's, so no response lookup answers them.
`KeptRecords` writes them for the Store that owns it (`Store.kept`); it changes records
and segments only as
`Store.put` does (through the Store's index, SegmentTable and ledger), never a second
owner of that state.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import NO_CALLS, Record, Segment, chain_of
from ocxproxy.store.local.upkeep import DISK_KEEP
from ocxproxy.store.records import NEVER

if TYPE_CHECKING:
    from ocxproxy.store.local.store import Store


class KeptRecords:
    """`keep` and the room checks for pinned records, on the Store that owns it."""

    def __init__(self, store: Store) -> None:
        # A weak reference: the store owns this, and a cycle would keep a connection's
        # memory-only store alive until the garbage collector's next pass.
        self.store: Store = weakref.proxy(store)

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
        ids: list[list[str]] | None = None,
    ) -> Record:
        """Write (or rewrite) a record that is not a response: `chain` reuses the segments
        of records already held (the same objects) and interns new ones; `meta` is kept as
        its response segment, `ids` (a conversation's item ids per segment) as
        `Record.ids`. Journaled like `put` (`await commit(record)` before acknowledging):
        an append (the old record's chain and ids plus one segment and its ids) as a row
        naming the old one, whatever the record's length. With `expires_at=NEVER` it is
        pinned: no count or byte cap drops it, and StoreFailure(FULL) refuses a write that
        would need that, unless `force` (a turn already answered: taken even past the
        caps), and any while the store is full (`Durable.full`)."""
        store = self.store
        durable = durable and store._committer is not None
        pinned = expires_at >= NEVER
        # A chain is never empty (a row needs a chain): one empty segment.
        chain = chain or (Segment(b"", 0, NO_CALLS, durable=False),)
        old = store._records.get(record_id)
        shared = store.index.shared(record_id, chain, durable)
        fresh = chain[shared:]
        entry = 0 if durable else store.resident.entry_bytes  # in memory: entries count too
        size = store.index.pinned_size(record_id, chain, shared, len(meta), entry)
        if pinned and not force and not self._fits(record_id, size, durable=durable):
            raise StoreFailure(FailureReason.FULL, record_id)
        if pinned and durable and store.disk is not None and store.disk.full:
            # Over --max-disk-bytes with nothing left to evict: refused even when forced
            # (a turn's append: its response is refused too, Store.put).
            raise StoreFailure(FailureReason.FULL, record_id)
        take = store.table.take
        taken = [take(s, durable) for s in fresh]
        links = chain_of(taken, old.links if shared and old else None)
        segments = (*(old.segments if shared and old else ()), *taken)
        response = store.table.intern(Segment(meta, 0, NO_CALLS, durable=False))
        record = Record(
            id=record_id,
            scope=scope,
            created_at=created_at,
            expires_at=expires_at,
            durable=durable,
            links=links,
            response=response,
            backend=backend,
            affinity_key=affinity_key,
            n_items=(old.n_items if shared and old else 0) + sum(s.n_items for s in fresh),
            stored=False,
            built=segments,
            ids=ids,
        )
        store.table.hold((*segments[shared:], response), durable=durable)  # before old goes
        journaled = durable and store._committer is not None
        if old is not None and store.ledger is not None and store.ledger.pending(old):
            # Its PUT is still queued: a DEL after it, then this record's whole row.
            store._drop(old, None, None, shared=shared)
            if journaled:
                store._journal_put(record, None)
        elif old is not None:
            if journaled:  # a PUT of the same id supersedes the old row; name it if it is
                appended = bool(shared) and shared == len(segments) - 1
                if ids is not None or old.ids is not None:  # and its ids are old's + one
                    appended = appended and ids is not None and ids[:-1] == old.ids
                store._journal_put(record, old if appended else None)
            store._drop(old, None, None, journaled=False, shared=shared)
        elif journaled:
            store._journal_put(record, None)
        store.index.add(record, size if pinned else None)
        store.expiry.enforce()
        return record

    def room_for(self, record_id: str, extra: int) -> bool:
        """Can the pinned record `record_id` (or a new one) grow by `extra` bytes with no
        cap having to drop pinned records?"""
        return self._fits(
            record_id, self.store.index.pinned.get(record_id, 0) + extra, durable=True
        )

    def _fits(self, record_id: str, size: int, *, durable: bool) -> bool:
        """Pinned bytes count against the share of the disk cap the store keeps when
        durable, else against the memory cap; their number against the entry cap."""
        store = self.store
        on_disk = durable and store._committer is not None
        cap = store.max_disk_bytes * DISK_KEEP if on_disk else store.resident.max_bytes
        return store.index.fits(record_id, size, cap, store.max_entries)
