"""The item-id index: which live records hold an item with a given id, per scope, so an
`item_reference` resolves in the caller's scope (C1.1, C5).

A record is indexed by the ids of its own segment (the last of its chain: the items its
turn added, input and output), and only while it lives: the Store adds it on put and
restore and removes it when the record goes (delete, eviction, expiry). Memory is one dict
slot per (record, id) pair; the id strings are the segment's own, the bytes stay in the
segment.
"""

from __future__ import annotations

from ocxproxy.model import Record


class ItemIndex:
    __slots__ = ("_scopes",)

    def __init__(self) -> None:
        # scope → item id → the records holding it, oldest first (one record, unlisted,
        # in the usual case of an id held once)
        self._scopes: dict[str, dict[str, Record | list[Record]]] = {}

    def __len__(self) -> int:
        """How many (scope, id) keys."""
        return sum(len(table) for table in self._scopes.values())

    def entries(self) -> int:
        """How many (record, id) pairs."""
        return sum(
            len(held) if isinstance(held, list) else 1
            for table in self._scopes.values()
            for held in table.values()
        )

    def add(self, record: Record) -> None:
        ids = record.segments[-1].item_ids.ids if record.segments else ()
        if not ids:
            return
        table = self._scopes.setdefault(record.scope, {})
        for item_id in ids:
            held = table.get(item_id)
            if held is None:
                table[item_id] = record
            elif isinstance(held, list):
                held.append(record)
            else:
                table[item_id] = [held, record]

    def remove(self, record: Record) -> None:
        ids = record.segments[-1].item_ids.ids if record.segments else ()
        table = self._scopes.get(record.scope) if ids else None
        if table is None:
            return
        for item_id in ids:
            held = table.get(item_id)
            if held is record:
                del table[item_id]
            elif isinstance(held, list):
                rest = [r for r in held if r is not record]
                if len(rest) > 1:
                    table[item_id] = rest
                elif rest:
                    table[item_id] = rest[0]
                else:
                    del table[item_id]
        if not table:
            del self._scopes[record.scope]

    def holders(self, scope: str, item_id: str) -> list[Record]:
        """The records of `scope` holding an item with this id, newest first."""
        held = self._scopes.get(scope, {}).get(item_id)
        if held is None:
            return []
        return held[::-1] if isinstance(held, list) else [held]
