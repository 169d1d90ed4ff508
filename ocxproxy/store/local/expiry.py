"""Which records go, and when, on one node: expiry and the caps.

`Expiry` drops records for the Store that owns it (`Store.expiry`), only through
`Store._drop`: expired ones, in short steps of the event loop (`sweep`); the oldest
unpinned ones over --max-entries and segment bytes over the memory cap, after every
change (`enforce`); whole chains, the least recently extended first, over
--max-disk-bytes, when the disk side asks (`for_disk`). Pinned records (conversations)
never go for a cap.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

from ocxproxy.errors import FailureReason
from ocxproxy.model import Chain, Record
from ocxproxy.store.local.upkeep import STEP, Pacer
from ocxproxy.store.records import NEVER, REMEMBERED
from ocxproxy.store.shards import Shards

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
        # The ids of the latest records evicted for the disk cap: a turn in flight on one
        # does not take its chain's bytes back (Store.put).
        self.for_disk_ids: OrderedDict[str, None] = OrderedDict()

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

    async def for_disk(self, target: float, limit: float, per_record: float = 0.0) -> bool:
        """Whole chains go (journaled, like a delete), the least recently extended first,
        until the live segments and the next checkpoint take `target` bytes of disk, the
        newest chain only while they take more than `limit`; True when they still take
        more than `limit` and nothing more can go. The next checkpoint is counted as
        `per_record` bytes a record (the last one's share: it names only those left).

        A chain is a tree of records, a turn's record on its parent's chain links: its
        turns share their segments, so dropping its oldest turns frees almost nothing
        while a later turn of it stays; dropping the whole tree frees what it alone holds.
        Trees go in the order of their newest record (the order records came), so a long
        session in use, whose first turn is among the oldest records, goes last, and only
        when it alone is over `limit`. Pinned records (conversations) and records not on
        disk never go for a cap, and a tree with a turn being written (its PUT queued) is
        left alone (that turn holds the whole chain): then False, a later pass may free
        it. In steps of the event loop (the records looked at in one pass, each chain
        link once)."""
        store = self.store
        assert store.ledger is not None
        keydir, index = store.table.keydir, store.index

        def over(bytes_: float) -> bool:
            return keydir.live_bytes + per_record * len(index) > bytes_

        if not over(target):
            return False
        queued, records = store.ledger.queued, index.by_id
        # id(link) -> id(the root link of its tree); sharded, as the store's large maps
        # are (shards.py): a 100,000-entry dict's growth is a step of its own
        roots: Shards[int, int] = Shards()
        held: list[Chain] = []  # those links, so that no id is reused meanwhile
        path: list[Chain] = []
        trees: dict[int, list[Record]] = {}  # root -> its records; the newest tree last
        busy: set[int] = set()  # roots of trees with a turn being written
        newest = index.newest  # the chunk of the records' order new records go to
        # The records of that chunk now, by id(): any other one there later is new.
        seen = {id(r): r for r in index.chunks[newest].values()}

        def take(record: Record) -> int:
            """`record` into its tree (moved last: extended last); the tree's root."""
            link = record.links
            root = id(record)  # (a record without a chain is a tree of its own)
            while link is not None:
                known = roots.get(id(link))
                if known is not None:
                    root = known
                    break
                path.append(link)
                if link.prev is None:
                    root = id(link)
                    break
                link = link.prev
            for node in path:
                roots[id(node)] = root
            held.extend(path)
            path.clear()
            members = trees.pop(root, None)
            if members is None:
                members = []
            members.append(record)
            trees[root] = members
            if queued(record.id):
                busy.add(root)
            return root

        def newcomers() -> None:
            """A record put while the loop ran (the newest chunks, where records go) is a
            turn on its tree: that tree is being extended, and stays."""
            for number in range(newest, index.newest + 1):
                for record in list(index.chunks.get(number, {}).values()):
                    if id(record) not in seen:
                        seen[id(record)] = record
                        busy.add(take(record))

        pacer = Pacer()
        for record in index.oldest():
            take(record)
            if time.perf_counter() - pacer.since >= STEP:
                await pacer.pause()
        newcomers()
        last = max(limit, target)
        order = list(trees.items())
        for root, members in order:
            if root in busy:
                continue
            if not over(last if root == order[-1][0] else target):
                break
            for record in members:  # (the whole tree: its last record frees the most)
                if (
                    record.durable
                    and record.expires_at < NEVER
                    and records.get(record.id) is record  # (not gone meanwhile)
                    and not queued(record.id)
                ):
                    store._drop(record, FailureReason.EVICTED, "disk_bytes")
                    self.for_disk_ids[record.id] = None
                    if len(self.for_disk_ids) > REMEMBERED:
                        self.for_disk_ids.popitem(last=False)
            if time.perf_counter() - pacer.since >= STEP:
                await pacer.pause()
                newcomers()
        for shard in roots.shards:  # (let go of in steps too)
            shard.clear()
            if time.perf_counter() - pacer.since >= STEP:
                await pacer.pause()
        return over(limit) and not busy
