"""Start-up: the records and segments a `Loaded` checkpoint and journal describe.

`rebuild` builds them, sharing each segment among the records whose chains hold it, and
returns them for Store to index; it records where each segment's bytes are in the keydir."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ocxproxy.model import Chain, Record, Segment
from ocxproxy.store.codec import IDS, Loaded, conversation_ids
from ocxproxy.store.keydir import Keydir


def rebuild(
    loaded: Loaded, now: float, segments: dict[str, Segment], keydir: Keydir
) -> tuple[list[Record], list[str]]:
    """The live records of `loaded` (expired ones left out), oldest first, and the ids of
    those whose chain needs a segment that is gone. Their segments are added to
    `segments` (by key; their refcounts set) and located in `keydir`; segments no live
    record needs are taken out of both."""
    strings: dict[str | None, str | None] = {}
    by_sid: dict[int, Segment] = {}
    for sid, seg in loaded.segments.items():
        if seg.pack not in loaded.sizes:
            continue  # its journal file is gone
        known = segments.get(seg.key)
        if known is None:
            segments[seg.key] = seg
            keydir.locate(seg, seg.pack, seg.offset, seg.length)
        by_sid[sid] = known or seg
    find = by_sid.__getitem__

    # A row's chain is a list of sids, or (its parent's row, its own last sid): each
    # row's chain is one link on its parent's (shared, as in the live store), and
    # references are counted per row times the live records under it, not per element.
    memo: dict[int, Chain | None] = {}
    order: list[list[Any]] = []  # rows whose chain was built, parents first

    def chain_of(row: list[Any]) -> Chain | None:
        stack: list[list[Any]] = []
        while id(row) not in memo:
            link = row[4]
            if isinstance(link, tuple):
                stack.append(row)
                row = link[0]
                continue
            built = None
            for sid in link:  # None (a gone parent) or a gone sid: raises
                built = Chain(built, find(sid))
            memo[id(row)] = built
            order.append(row)
        base = memo[id(row)]
        for row in reversed(stack):
            base = memo[id(row)] = Chain(base, find(row[4][1]))
            order.append(row)
        return base

    missing: list[str] = []
    records: list[Record] = []
    live: Counter[int] = Counter()  # id(row) -> live records at or under it
    held: Counter[Segment] = Counter()
    same = strings.setdefault  # one copy of each scope, backend and key (None too)
    for row in loaded.records.values():
        try:
            rid, scope, created, expires, _, resp_sid, output_at, backend, affinity = row[:9]
            n_items, stored = row[9:11]
        except ValueError:
            continue
        if expires <= now:
            continue
        try:
            chain = chain_of(row)
            response = find(resp_sid)
            ids = conversation_ids(row) if len(row) > IDS else None
        except (KeyError, TypeError, ValueError):  # a segment (or, None, a parent) is gone
            missing.append(rid)
            continue
        live[id(row)] += 1
        held[response] += 1
        record = Record(  # positional (100,000s of them): Record's field order
            rid, same(scope, scope), created, expires, True, chain, response,  # type: ignore[arg-type]
            same(backend, backend), same(affinity, affinity), n_items,
            (output_at[0], output_at[1]) if output_at else None, stored,
        )  # fmt: skip
        if ids is not None:  # a conversation's
            record.ids = ids
        records.append(record)
    for row in reversed(order):  # children after parents: sum them up the tree
        link = row[4]
        if isinstance(link, tuple) and live[id(row)]:
            live[id(link[0])] += live[id(row)]
    for row in order:
        n = live[id(row)]
        link = memo[id(row)]
        if n and link is not None:
            if isinstance(row[4], tuple):
                held[link.segment] += n  # the rest is counted at its parent's row
            else:
                for seg in link.segments():
                    held[seg] += n
    for seg, n in held.items():  # every restored record is durable
        seg.refs = seg.durable_refs = n
    for seg in list(segments.values()):
        if seg.refs == 0:  # in the journal, but no live record needs it
            keydir.unlocate(seg)
            del segments[seg.key]
    return records, missing
