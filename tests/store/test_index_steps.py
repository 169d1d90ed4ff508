"""The store's big maps grow in small steps at 100,000 records.

Counted, not timed: a dict grows, or is rebuilt once deletes have filled it with dummies,
by copying every entry it holds in one step of the event loop (28 ms for the item index's
under `serve` at 100,000 records, 14-22 ms for the records' OrderedDict). So the most
entries any one dict of the records' index, the item index or the segment table holds is
the most one such step copies.
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
import pytest

from ocxproxy.continuation.record import build_turn
from ocxproxy.model import NO_CALLS, Record, Segment, Turn
from ocxproxy.store import Store
from ocxproxy.store.records import REMEMBERED
from tests.store.helpers import make_store

N = 100_000
MOST = 5_000  # entries one dict may hold at N records (one dict held them all: 100,000+)


def turn(rid: str, out_id: str) -> Turn:
    item = {"id": out_id, "type": "message", "role": "assistant", "content": []}
    return build_turn(
        response={"id": rid, "object": "response", "output": [item]},
        scope="scope-a",
        durable=False,
        tail=[orjson.dumps({"role": "user", "content": rid})],
        tail_items=[{"role": "user", "content": rid}],
        stored=True,
    )


def largest_dict(root: object) -> int:
    """The most entries a dict reachable from `root` holds, through dicts, lists and the
    store's own containers (not through records or segments, which the maps hold)."""
    most, stack, seen = 0, [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, Record | Segment | str | int | tuple):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            most = max(most, len(obj))
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)
        elif type(obj).__module__.startswith("ocxproxy.store"):
            slots: Any = getattr(type(obj), "__slots__", ())
            stack.extend(getattr(obj, name) for name in slots if hasattr(obj, name))
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
    return most


def filled(out_id: Any) -> Store:
    store = make_store(None, max_entries=2 * N, max_resident_bytes=1024**3)
    parent = None
    for i in range(N):
        parent = store.put(turn(f"r{i}", out_id(i)), parent if i % 50 else None)
    return store


@pytest.fixture(scope="module")
def unique() -> Store:
    return filled(lambda i: f"msg_{i}")  # as real servers send: an id per item


def test_no_dict_of_the_item_index_holds_more_than_a_slice_of_its_ids(unique: Store) -> None:
    store = unique
    assert len(store.index.items) == N
    assert largest_dict(store.index.items) <= MOST


def test_nor_of_the_records_that_share_one_id() -> None:
    store = filled(lambda i: "msg_x")  # a backend that reuses one output id
    assert len(store.index.items.holders("scope-a", "msg_x")) == N
    assert largest_dict(store.index.items) <= MOST
    # and the newest still comes first, after the oldest went and the newest was added
    for record in store.records()[: N // 2]:
        store.delete_nowait("scope-a", record.id)
    newest = store.put(turn("last", "msg_x"), None)
    holders = store.index.items.holders("scope-a", "msg_x")
    assert holders[0] is newest and len(holders) == N // 2 + 1
    assert holders[-1].id == f"r{N // 2}"
    assert largest_dict(store.index.items) <= MOST
    assert store.check() == []


def test_no_dict_of_the_segment_table_holds_more_than_a_slice_of_its_segments(
    unique: Store,
) -> None:
    store = unique
    assert len(store.table) >= 2 * N  # each turn's items and its response
    assert largest_dict(store.table.by_key) <= MOST


def test_no_dict_of_the_records_index_holds_more_than_a_slice_of_its_records(
    unique: Store,
) -> None:
    store = unique
    assert len(store) == N
    assert largest_dict(store.index) <= MOST
    assert [r.id for r in store.records()] == [f"r{i}" for i in range(N)]  # oldest first


def test_evictions_keep_the_order_and_the_pins_and_leave_small_dicts() -> None:
    """At the entry cap, each new record evicts the oldest response; the conversations
    (pinned) among them stay, in the order they came, and the emptied chunks of the
    order let go of their room."""
    store = make_store(None, max_entries=N, max_resident_bytes=1024**3)
    conversations = []
    for i in range(N):
        if i % 10 == 0:
            segment = Segment(
                orjson.dumps({"role": "user", "content": i}), 1, NO_CALLS, durable=False
            )
            conversations.append(
                store.kept.keep(f"conv_{i}", "scope-a", (segment,), b"{}", created_at=0)
            )
        else:
            store.put(turn(f"r{i}", f"msg_{i}"), None)
    for i in range(N, N + N // 2):
        store.put(turn(f"r{i}", f"msg_{i}"), None)
    assert len(store) == N
    came = [f"conv_{i}" if i < N and i % 10 == 0 else f"r{i}" for i in range(N + N // 2)]
    responses = [rid for rid in came if rid.startswith("r")]
    gone = set(responses[: len(responses) - (N - len(conversations))])  # the oldest
    assert [r.id for r in store.records()] == [rid for rid in came if rid not in gone]
    assert all(conv.id in store.index.pinned for conv in conversations)
    oldest = next(rid for rid in responses if rid not in gone)
    assert store.index.oldest_unpinned() is store.record("scope-a", oldest)
    # (The ids of the records that went are remembered up to REMEMBERED, at any size.)
    assert len(store.index.tombstones) == REMEMBERED
    store.index.tombstones.clear()
    assert largest_dict(store.index) <= MOST
    assert store.check() == []
    for chunk in store.index.chunks.values():  # no chunk holds the room it once did
        assert sys.getsizeof(chunk) <= sys.getsizeof(dict.fromkeys(range(4 * len(chunk) + 8)))
