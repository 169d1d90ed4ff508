"""Start-up: the records and segments a `Loaded` checkpoint and journal describe.

`rebuild` builds them, sharing each segment among the records whose chains hold it, and
returns them for Store to index; it records where each segment's bytes are in the keydir.
It runs once per start over 100,000s of rows, so it keeps per-row work to a few dict and
list operations (start-up time to `/readyz` is a figure `bench_durable.py` holds to ≤ 2 s)."""

from __future__ import annotations

from typing import Any

from ocxproxy.model import Chain, Record, Segment, place
from ocxproxy.store.local.codec import (
    FILL,
    IDS,
    UNWRITTEN,
    Loaded,
    conversation_ids,
    lost_segment,
)
from ocxproxy.store.local.keydir import Keydir
from ocxproxy.store.local.segment_files import FILES


def rebuild(
    loaded: Loaded, now: float, segments: dict[bytes, Segment], keydir: Keydir
) -> tuple[list[Record], list[str]]:
    """The live records of `loaded` (expired ones left out), oldest first, and the ids of
    those whose chain needs a segment that is gone (missing). A chain that names a
    segment UNWRITTEN (lost before it was written: evicted while its turn ran) holds
    `codec.lost_segment()` there, one for all of them: the record is kept, and its chain
    answers EVICTED, as it did live. `loaded.records` is emptied. Their segments are
    added to `segments` (by digest; their refcounts set) and located in `keydir`;
    segments no live record needs are left out of both."""
    lost = lost_segment()
    by_sid: dict[int, Segment] = {UNWRITTEN: lost}
    sizes, known = loaded.sizes, segments.get
    for sid, seg in loaded.segments.items():
        if seg.pack not in sizes and seg.pack != FILES:
            continue  # its journal file is gone
        same_bytes = known(seg.digest)
        if same_bytes is None:
            segments[seg.digest] = same_bytes = seg
        by_sid[sid] = same_bytes
    find = by_sid.__getitem__

    # A row's chain is a list of sids, or (its parent's row, its own last sid): each
    # row's chain is one link on its parent's (shared, as in the live store), and
    # references are counted per row times the live records under it, not per element.
    # Built rows, by position: parents before children (an older row, or its stack).
    at: dict[int, int] = {}  # id(row) -> position
    chains: list[Chain | None] = []
    parents: list[int] = []  # the parent's position; -1: a row listing its whole chain
    under: list[int] = []  # live records at the row (summed up the tree below)

    def extend(parent: int, sid: int) -> int:
        """The position of a new chain: the one at `parent` and segment `sid`."""
        chains.append(Chain(chains[parent], find(sid)))
        parents.append(parent)
        under.append(0)
        return len(chains) - 1

    def build(row: list[Any]) -> int:
        """The position of `row`'s built chain; KeyError or TypeError when a segment
        (or, None, a parent) is gone."""
        stack: list[list[Any]] = []
        while (pos := at.get(id(row))) is None:
            link = row[4]
            if isinstance(link, tuple):
                stack.append(row)
                row = link[0]
                continue
            chain = None
            for sid in link:
                chain = Chain(chain, find(sid))
            pos = at[id(row)] = len(chains)
            chains.append(chain)
            parents.append(-1)
            under.append(0)
        for row in reversed(stack):
            pos = at[id(row)] = extend(pos, row[4][1])
        return pos

    missing: list[str] = []
    records: list[Record] = []
    placed: list[tuple[str, int]] = []  # (record id, its response's place)
    # Each row is let go of once its record is built (freed with the last of its
    # children), so the records and links built after it reuse its memory: built while
    # every row still lived, they would take fresh pymalloc arenas, left mostly empty
    # once the rows went, which CPython never hands back.
    rows: list[list[Any] | None] = list(loaded.records.values())
    loaded.records.clear()
    for n, row in enumerate(rows):
        assert row is not None
        rows[n] = None
        if len(row) < IDS:
            continue
        rid, scope, created, expires, link, held, output_at, backend, affinity = row[:9]
        if expires <= now:
            continue
        try:
            pos = at.get(id(row))
            if pos is None:
                parent = at.get(id(link[0])) if isinstance(link, tuple) else None
                if parent is None:
                    pos = build(row)
                else:  # the usual row: its parent's chain is built
                    pos = at[id(row)] = extend(parent, link[1])
            if type(held) is list:  # [file, offset, length, size]: in its record's entry
                if held[0] not in sizes:
                    raise ValueError(f"{rid}: its response's file is gone")
                response: Segment | int = place(*held)
            else:  # a segment of its own, by sid
                response = find(held)
            ids = conversation_ids(row) if len(row) > IDS else None
            fill: Segment | None = None
            if len(row) > FILL:  # the members filled in from the request: a segment
                fill_sid, fill_at = row[FILL]
                fill = find(fill_sid)
                if type(fill_at) is not int or fill_at < 0:
                    raise ValueError(f"{rid}: bad fill")
        except (KeyError, TypeError, ValueError):  # gone: a segment, a parent (None),
            missing.append(rid)  # or a response's file
            continue
        under[pos] += 1
        if isinstance(response, Segment):
            response.refs += 1
        else:
            placed.append((rid, response))
        record = Record(  # positional (100,000s of them): Record's field order
            rid, scope, created, expires, True, chains[pos], response,
            backend, affinity, row[9], output_at, row[10],  # (one copy each: Loaded.put)
        )  # fmt: skip
        if ids is not None:  # a conversation's
            record.ids = ids
        if fill is not None:
            fill.refs += 1
            record.fill, record.fill_at = fill, fill_at
        records.append(record)
    for pos in range(len(chains) - 1, -1, -1):  # children after parents: sum up the tree
        n, parent = under[pos], parents[pos]
        if n and parent >= 0:
            under[parent] += n
    for pos, n in enumerate(under):
        link = chains[pos]
        if not n or link is None:
            continue
        if parents[pos] >= 0:
            link.segment.refs += n  # the rest is counted at its parent's row
        else:
            while link is not None:
                link.segment.refs += n
                link = link.prev
    gone: list[bytes] = []
    for key, seg in segments.items():
        if seg.refs:
            seg.durable_refs = seg.refs  # every restored record is durable
        else:
            gone.append(key)  # in the journal, but no live record needs it
    for key in gone:
        del segments[key]
    keydir.restored(segments.values())
    keydir.restored_responses(placed)
    if lost.refs:  # (nowhere on disk: indexed, never located)
        lost.durable_refs = lost.refs
        segments[lost.digest] = lost
    return records, missing
