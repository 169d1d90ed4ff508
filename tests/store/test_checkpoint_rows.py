"""The checkpoint's rows, built in one loop per chunk (codec.checkpoint_segment_rows,
codec.checkpoint_record_rows), are the rows `segment_row` and `record_row` give, byte for
byte once dumped, for every kind of segment and record, and name the same records; and
they are built with no Python call per row (each call and property read costs the event
loop ~0.1-0.3 us, at 100,000s of rows a checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from ocxproxy.model import NO_CALLS, Chain, ItemIds, Record, Segment, chain_of, place
from ocxproxy.store.local import codec
from tests.store.helpers import checkpoint_ids, make_store, make_turn


def segment(n: int, *, pack: int = 1, sid: int | None = None, **kwargs: Any) -> Segment:
    s = Segment(f"item {n}".encode(), 1, kwargs.pop("call_ids", NO_CALLS), durable=True, **kwargs)
    s.sid = n if sid is None else sid
    s.pack = pack
    s.place(100 * n, 10 + n)
    return s


def reference_segments(found: list[Segment | None], pack: int) -> list[list[Any]]:
    """What a checkpoint named of a journal file's segments: segment_row and the place."""
    return [
        [*codec.segment_row(s), pack, s.offset, s.length]
        for s in found
        if s is not None and s.pack == pack and s.sid
    ]


def reference_records(
    records: list[Record], uncommitted: set[str], named: dict[int, str]
) -> list[list[Any]]:
    """What a checkpoint named of `records`, row by row with record_row."""
    rows = []
    for r in records:
        if not r.durable or r.id in uncommitted:
            continue
        link = r.links
        prev = link.prev if link is not None else None
        parent = named.get(id(prev)) if prev is not None else None
        response = r.response
        if type(response) is bytes or (type(response) is Segment and response.pack < 0):
            continue
        if r.fill is not None and r.fill.pack < 0:
            continue
        if link is not None and parent is not None and r.ids is None:
            if link.segment.pack < 0:
                continue
            rows.append(codec.record_row(r, parent))
        else:
            if not all(s.pack >= 0 or (s.lost and not s.sid) for s in r.segments):
                continue
            rows.append(codec.record_row(r))
        named[id(link)] = r.id
    return rows


def test_segment_rows_are_segment_row_and_place() -> None:
    found: list[Segment | None] = [
        segment(1, item_ids=ItemIds([("msg_1", 0, 7)])),  # a lone id: its span in `at`
        segment(2, item_ids=ItemIds([("a", 0, 2), ("b", 3, 7)])),  # several
        segment(3, item_ids=ItemIds([("big", 0, 1 << 31)])),  # a span too big to pack
        segment(4, call_ids=frozenset({"call_b", "call_a"})),  # sorted in the row
        segment(5),  # no ids at all
        None,  # gone since the capture
        segment(6, pack=2),  # elsewhere now (moved by compaction)
        segment(7, sid=0),  # not named yet
        segment(8, pack=-1),  # not on disk
    ]
    rows = codec.checkpoint_segment_rows(found, 1)
    assert len(rows) == 5
    assert orjson.dumps(rows) == orjson.dumps(reference_segments(found, 1))


def record(
    rid: str, links: Chain | None, response: Any, *, durable: bool = True, **kwargs: Any
) -> Record:
    fields: dict[str, Any] = {"backend": "http://b:1", "affinity_key": "k", "n_items": 2}
    fields.update(kwargs)
    return Record(rid, "scope", 1.5, 2.5, durable, links, response, **fields)


def test_record_rows_are_record_row_and_name_the_same_records() -> None:
    a, b, c, d = (segment(n) for n in (1, 2, 3, 4))
    off = segment(9, pack=-1)
    kept = Segment(b"{}", 0, NO_CALLS, durable=True)
    kept.sid, kept.pack = 10, 1
    evicted = Segment(b"{}", 0, NO_CALLS, durable=True)
    unwritten = segment(12, pack=-1, sid=0)  # lost before it was written
    unwritten.data, unwritten.lost = None, "evicted"
    root = chain_of([a])
    at = place(3, 1 << 39, 1234, 5678)  # big numbers in each field
    records = [
        first := record("r1", root, at, output_at=(5, 9)),
        record("r2", Chain(first.links, b), place(1, 2, 3, 4)),  # named by its parent
        record("r3", Chain(Chain(first.links, b), c), place(1, 9, 3, 4)),  # parent not named
        record("r4", Chain(first.links, d), kept, stored=False),  # its response a segment
        record("r5", Chain(first.links, c), b"{}"),  # not committed: left out
        record("r6", Chain(first.links, c), evicted),  # its response evicted: left out
        record("r7", Chain(first.links, off), place(1, 2, 3, 4)),  # own segment off disk
        record("r8", chain_of([off, a]), place(1, 2, 3, 4)),  # a segment off disk
        record("r11", chain_of([unwritten, a]), place(1, 2, 3, 4)),  # named UNWRITTEN
        record("r9", Chain(first.links, c), place(1, 2, 3, 4), durable=False),
        record("r10", Chain(first.links, c), place(1, 2, 3, 4)),  # uncommitted
        # the members filled in from the request, a segment: on disk, and not yet
        record("f1", Chain(first.links, d), place(1, 2, 3, 4), fill=segment(11), fill_at=28),
        record("f2", Chain(first.links, d), place(1, 2, 3, 4), fill=off, fill_at=28),
        conv := record("c1", chain_of([a, b]), place(1, 5, 6, 7), ids=[["x"], ["y", "z"]]),
        record("c2", Chain(conv.links, c), place(1, 8, 6, 7), ids=[["x"], ["y", "z"], []]),
        record("n1", None, place(2, 0, 1, 1), backend=None, affinity_key=None),
    ]
    rows = codec.checkpoint_record_rows(records, {"r10"}, {}, lambda key: None)
    expected = reference_records(records, {"r10"}, {})
    assert [row[0] for row in rows] == ["r1", "r2", "r3", "r4", "r11", "f1", "c1", "c2", "n1"]
    assert rows[4][4] == [codec.UNWRITTEN, 1]
    assert rows[5][11:] == (None, (11, 28))
    assert rows[1][4] == ("^", "r1", 2) and rows[2][4] == [1, 2, 3]
    assert orjson.dumps(rows) == orjson.dumps(expected)


async def test_a_checkpoint_calls_no_python_function_per_row(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_entries=4000)
    await store.start()
    parent = None
    n = 2000
    for i in range(n):  # chains of 20: a chain's first row names its whole chain
        parent = store.put(make_turn(f"r{i}", f"turn {i}"), parent if i % 20 else None)
    await store.commit()
    calls = [0]
    row_code = {"codec.py", "model.py", "upkeep.py"}

    def counted(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and Path(frame.f_code.co_filename).name in row_code:
            calls[0] += 1

    sys.setprofile(counted)
    try:
        assert await store.flush()
    finally:
        sys.setprofile(None)
    assert len(checkpoint_ids(tmp_path)) == n
    # (a chain's first record walks its links: two calls; a row by record_row and
    # segment_row with the properties they read made ~10 a record)
    assert calls[0] < n / 4, calls[0]
    await store.close()
