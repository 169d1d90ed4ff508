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


class ItemIndex:
    __slots__ = ("_scopes",)

    def __init__(self) -> None:
        # scope → item id → the record holding it, or, when several do, a dict of them by
        # id(record) in the order they were added: adding and removing one is O(1) however
        # many records share an id (a backend that reuses output ids, a client resending
        # the same items), so evicting the oldest records stays cheap at 100,000.
        self._scopes: dict[str, dict[str, Record | dict[int, Record]]] = {}

    def __len__(self) -> int:
        """How many (scope, id) keys."""
        return sum(len(table) for table in self._scopes.values())

    def entries(self) -> int:
        """How many (record, id) pairs."""
        return sum(
            len(held) if isinstance(held, dict) else 1
            for table in self._scopes.values()
            for held in table.values()
        )

    def add(self, record: Record) -> None:
        self.add_all((record,))

    def add_all(self, records: Iterable[Record]) -> None:
        """add() each of `records`, in one loop (start-up's 100,000s)."""
        scopes = self._scopes
        for record in records:
            link = record.links
            ids = link.segment.item_ids.ids if link is not None else ()
            if not ids:
                continue
            table = scopes.get(record.scope)
            if table is None:
                table = scopes[record.scope] = {}
            for item_id in ids:
                held = table.get(item_id)
                if held is None:
                    table[item_id] = record
                elif isinstance(held, dict):
                    held[id(record)] = record
                elif held is not record:
                    table[item_id] = {id(held): held, id(record): record}

    def remove(self, record: Record) -> None:
        ids = own.item_ids.ids if (own := record.own) is not None else ()
        table = self._scopes.get(record.scope) if ids else None
        if table is None:
            return
        for item_id in ids:
            held = table.get(item_id)
            if held is record:
                del table[item_id]
            elif isinstance(held, dict) and held.get(id(record)) is record:
                del held[id(record)]
                if len(held) == 1:
                    table[item_id] = next(iter(held.values()))
        if not table:
            del self._scopes[record.scope]

    def holders(self, scope: str, item_id: str) -> list[Record]:
        """The records of `scope` holding an item with this id, newest first."""
        held = self._scopes.get(scope, {}).get(item_id)
        if held is None:
            return []
        return list(reversed(held.values())) if isinstance(held, dict) else [held]

    def newest(self, scope: str, item_id: str) -> Iterator[Record]:
        """The same, lazily (do not add or remove records while iterating)."""
        held = self._scopes.get(scope, {}).get(item_id)
        if held is None:
            return iter(())
        return reversed(held.values()) if isinstance(held, dict) else iter((held,))

    def holds(self, scope: str, item_id: str, record: Record) -> bool:
        held = self._scopes.get(scope, {}).get(item_id)
        return held is record or (isinstance(held, dict) and held.get(id(record)) is record)
