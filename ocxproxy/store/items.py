"""The item-id index: which live records hold an item with a given id, per scope, so an
`item_reference` resolves in the caller's scope (CONTRACT.md C1.1, C5).

A record is indexed by the ids of its own segment (the last of its chain: the items its
turn added, input and output), and only while it lives: the Store adds it on put and
restore and removes it when the record goes (delete, eviction, expiry). Memory is one dict
slot per (record, id) pair; the id strings are the segment's own, the bytes stay in the
segment.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ocxproxy.model import Record
from ocxproxy.store.shards import SHARDS

PAGE = 1024  # records per dict of those holding one id

Held = Record | list[dict[int, Record]]


class ItemIndex:
    __slots__ = ("_shards",)

    def __init__(self) -> None:
        # By the id's hash, then scope → item id → the record holding it, or, when several
        # do, pages of them by id(record) in the order they were added, each of at most
        # PAGE: adding and removing one is O(1) however many records share an id (a
        # backend that reuses output ids, a client resending the same items), so evicting
        # the oldest records stays cheap at 100,000. Sharded and paged so that no dict
        # that grows or is rebuilt copies more than a slice of 100,000 in one step of the
        # event loop (shards.py); a lookup is still two dict lookups.
        self._shards: list[dict[str, dict[str, Held]]] = [{} for _ in range(SHARDS)]

    def _tables(self) -> Iterator[dict[str, Held]]:
        return (table for shard in self._shards for table in shard.values())

    def __len__(self) -> int:
        """How many (scope, id) keys."""
        return sum(map(len, self._tables()))

    def entries(self) -> int:
        """How many (record, id) pairs."""
        return sum(
            sum(map(len, held)) if isinstance(held, list) else 1
            for table in self._tables()
            for held in table.values()
        )

    def add(self, record: Record) -> None:
        self.add_all((record,))

    def add_all(self, records: Iterable[Record]) -> None:
        """add() each of `records`, in one loop (start-up's 100,000s)."""
        shards = self._shards
        for record in records:
            link = record.links
            ids = link.segment.item_id_list if link is not None else ()
            scope = record.scope
            for item_id in ids:
                shard = shards[hash(item_id) % SHARDS]
                table = shard.get(scope)
                if table is None:
                    table = shard[scope] = {}
                held = table.get(item_id)
                if held is None:
                    table[item_id] = record
                elif isinstance(held, list):
                    page = held[-1]
                    if page.get(id(record)) is record:
                        continue  # (an id twice in one segment)
                    if len(page) < PAGE:
                        page[id(record)] = record
                    else:
                        held.append({id(record): record})
                elif held is not record:
                    table[item_id] = [{id(held): held, id(record): record}]

    def remove(self, record: Record) -> None:
        ids = own.item_id_list if (own := record.own) is not None else ()
        shards, scope, rid = self._shards, record.scope, id(record)
        for item_id in ids:
            shard = shards[hash(item_id) % SHARDS]
            table = shard.get(scope)
            held = table.get(item_id) if table is not None else None
            if held is None or table is None:
                continue
            if held is record:
                del table[item_id]
                if not table:
                    del shard[scope]
            elif isinstance(held, list):
                for i, page in enumerate(held):  # the oldest first: evictions find it soon
                    if page.get(rid) is record:
                        del page[rid]
                        if not page:
                            del held[i]
                        break
                if len(held) == 1 and len(held[0]) == 1:
                    table[item_id] = next(iter(held[0].values()))

    def _held(self, scope: str, item_id: str) -> Held | None:
        table = self._shards[hash(item_id) % SHARDS].get(scope)
        return table.get(item_id) if table is not None else None

    def holders(self, scope: str, item_id: str) -> list[Record]:
        """The records of `scope` holding an item with this id, newest first."""
        return list(self.newest(scope, item_id))

    def newest(self, scope: str, item_id: str) -> Iterator[Record]:
        """The same, lazily (do not add or remove records while iterating)."""
        held = self._held(scope, item_id)
        if held is None:
            return iter(())
        if isinstance(held, list):
            return (r for page in reversed(held) for r in reversed(page.values()))
        return iter((held,))

    def holds(self, scope: str, item_id: str, record: Record) -> bool:
        held = self._held(scope, item_id)
        if isinstance(held, list):
            return any(page.get(id(record)) is record for page in held)
        return held is record
