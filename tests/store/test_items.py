"""The item-id index: item_reference targets by scope, kept with the records that hold
them (put, delete, eviction, expiry, restart)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from ocxproxy.continuation.record import build_turn
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import NO_CALLS, NO_ITEMS, ItemIds, Record, Segment, Turn
from ocxproxy.store import Store
from tests.store.helpers import Clock, inline, make_store


def message(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


def turn(
    rid: str,
    out_id: str,
    *,
    scope: str = "scope-a",
    inputs: list[Any] | None = None,
    stored: bool = True,
    durable: bool = True,
) -> Turn:
    """A turn as the proxy builds it: its input items as sent, then one output message."""
    items = inputs if inputs is not None else [{"role": "user", "content": f"q {rid}"}]
    return build_turn(
        response={"id": rid, "object": "response", "output": [message(out_id, f"a {rid}")]},
        scope=scope,
        durable=durable,
        tail=[orjson.dumps(item) for item in items],
        tail_items=items,
        stored=stored,
    )


async def resolve(store: Store, item_id: str, scope: str = "scope-a", **kw: Any) -> Any:
    record = store.find_item_nowait(scope, item_id, **kw)
    (data,) = await store.item_bytes([(record, item_id)])
    return orjson.loads(data)


async def test_an_output_item_resolves_to_its_bytes_in_its_scope_only() -> None:
    store = make_store(None)
    store.put(turn("r1", "msg_1"), None)
    record = store.find_item_nowait("scope-a", "msg_1")
    (data,) = await store.item_bytes([(record, "msg_1")])
    assert data == orjson.dumps(message("msg_1", "a r1"))  # exactly the stored bytes
    for scope in ("scope-b", "anonymous"):
        with pytest.raises(StoreFailure) as info:
            store.find_item_nowait(scope, "msg_1")
        assert info.value.reason == FailureReason.UNKNOWN
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-a", "msg_nope")
    assert store.check() == []


async def test_input_items_with_an_id_resolve_too() -> None:
    reasoning = {"type": "reasoning", "id": "rs_9", "summary": [], "encrypted_content": "e"}
    store = make_store(None)
    store.put(turn("r1", "msg_1", inputs=[{"role": "user", "content": "q"}, reasoning]), None)
    assert await resolve(store, "rs_9") == reasoning


async def test_store_false_items_resolve_only_where_unstored_ones_may() -> None:
    store = make_store(None)
    store.put(turn("r1", "msg_1", stored=False, durable=False), None)
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-a", "msg_1")
    assert await resolve(store, "msg_1", unstored=True) == message("msg_1", "a r1")


async def test_the_newest_live_holder_wins_and_deleting_it_falls_back() -> None:
    store = make_store(None)
    old = store.put(turn("r1", "msg_1"), None)
    # A later turn resent msg_1 in full (as an input item with its id): it holds it too.
    resent = message("msg_1", "a r1")
    new = store.put(turn("r2", "msg_2", inputs=[resent]), None)
    assert store.find_item_nowait("scope-a", "msg_1") is new
    assert store.delete_nowait("scope-a", "r2")
    assert store.find_item_nowait("scope-a", "msg_1") is old
    assert store.check() == []
    assert store.delete_nowait("scope-a", "r1")
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-a", "msg_1")
    assert len(store.items) == 0 and store.check() == []


async def test_a_holder_whose_bytes_were_dropped_is_passed_over() -> None:
    """A newer store:false turn holding the same item loses its bytes under memory
    pressure (it may not reach disk); the older turn still serves the item."""
    store = make_store(None, max_resident_bytes=10**6)
    older = store.put(turn("r1", "msg_1"), None)
    resent = message("msg_1", "a r1")
    newer = store.put(turn("r2", "msg_2", inputs=[resent], stored=False, durable=False), None)
    assert store.find_item_nowait("scope-a", "msg_1", unstored=True) is newer
    await store.history(older)  # recently used: the newer turn's bytes go first
    store.resident.max_bytes = store.resident.bytes - store.resident.held(older.response) - 1
    store.expiry.enforce()
    assert newer.segments[-1].data is None and older.segments[-1].data is not None
    assert store.find_item_nowait("scope-a", "msg_1", unstored=True) is older
    assert await resolve(store, "msg_1", unstored=True) == resent


async def test_items_of_a_chain_resolve_while_the_record_that_added_them_lives() -> None:
    store = make_store(None)
    r1 = store.put(turn("r1", "msg_1"), None)
    store.put(turn("r2", "msg_2"), r1)  # continues r1: holds msg_1's segment too
    assert store.find_item_nowait("scope-a", "msg_1") is r1
    assert store.find_item_nowait("scope-a", "msg_2").id == "r2"


async def test_expired_and_evicted_records_take_their_items_with_them() -> None:
    clock = Clock()
    store = make_store(None, clock=clock, max_entries=2, ttl=100.0)
    store.put(turn("r1", "msg_1"), None)
    store.put(turn("r2", "msg_2"), None)
    store.put(turn("r3", "msg_3"), None)  # evicts r1 (max_entries)
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-a", "msg_1")
    assert store.find_item_nowait("scope-a", "msg_2").id == "r2"
    clock.now += 101
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-a", "msg_2")
    assert await store.sweep() == 1  # r3; r2 went when its item was looked up
    assert len(store) == 0 and len(store.items) == 0 and store.check() == []


async def test_a_reused_response_id_reindexes() -> None:
    store = make_store(None)
    store.put(turn("r1", "msg_1"), None)
    store.put(turn("r1", "msg_other"), None)
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-a", "msg_1")
    assert store.find_item_nowait("scope-a", "msg_other").id == "r1"
    assert store.check() == []


async def test_items_of_records_taken_from_another_store_resolve() -> None:
    local = make_store(None)
    shared = make_store(None)
    parent = local.put(turn("r1", "msg_1"), None)
    shared.put(turn("r2", "msg_2"), parent)  # the parent's segments are adopted
    child = shared.lookup_nowait("scope-a", "r2")
    assert child.segments[0].item_ids.ids == ("msg_1",)
    assert await resolve(shared, "msg_2") == message("msg_2", "a r2")


@pytest.mark.parametrize("checkpoint", [False, True], ids=["journal", "checkpoint"])
async def test_item_ids_survive_a_restart_and_resolve_from_disk(
    tmp_path: Path, checkpoint: bool
) -> None:
    store = make_store(tmp_path, offload=inline)
    await store.start()
    parent: Record | None = None
    for i in range(5):
        parent = store.put(turn(f"r{i}", f"msg_{i}"), parent)
    store.put(turn("gone", "msg_gone", stored=False, durable=False), None)
    if checkpoint:  # item ids from the checkpoint's rows, not the journal's entries
        assert await store.flush()
    await store.close()
    store = make_store(tmp_path, offload=inline)
    await store.start()
    assert store.stats().resident_bytes == 0  # every byte is on disk only
    for i in range(5):
        assert await resolve(store, f"msg_{i}") == message(f"msg_{i}", f"a r{i}")
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-a", "msg_gone", unstored=True)  # store:false: never on disk
    with pytest.raises(StoreFailure):
        store.find_item_nowait("scope-b", "msg_1")
    assert store.check() == []
    await store.close()


@pytest.mark.parametrize(
    "entries",
    [
        [("msg_1", 0, 0)],
        [("msg_1", 17, 4_000)],
        [("msg_1", (1 << 30) - 1, (1 << 30) - 1)],
        [("msg_1", 5, 1 << 30)],  # past what one int packs: kept as bytes
        [("msg_1", 1 << 33, 1 << 34)],
        [("a", 0, 3), ("b", 4, 9), ("c", 10, 12)],
    ],
)
def test_item_ids_give_back_each_span(entries: list[tuple[str, int, int]]) -> None:
    segment = Segment(b"x" * 16, len(entries), NO_CALLS, durable=True, item_ids=ItemIds(entries))
    segment.sid, segment.pack = 1 << 40, 3  # (a sid past what the packed int's other fields use)
    segment.place((1 << 40) - 1, (1 << 32) - 1)
    for ids in (ItemIds(entries), segment.item_ids):  # as given, and as a segment keeps them
        assert list(ids) == entries and len(ids) == len(entries)
        assert ids.ids == tuple(i for i, _, _ in entries) == segment.item_id_list
        assert all(ids.span(i) == (start, end) for i, start, end in entries)
        assert ids.span("msg_2") is None
    assert (segment.sid, segment.offset, segment.length) == (1 << 40, (1 << 40) - 1, (1 << 32) - 1)
    segment.item_ids = NO_ITEMS  # replaced: no span left behind, the rest kept
    assert not segment.item_ids and segment.item_id_list == ()
    assert (segment.sid, segment.offset, segment.length) == (1 << 40, (1 << 40) - 1, (1 << 32) - 1)


def test_a_lone_item_id_keeps_its_span_in_one_int() -> None:
    assert type(ItemIds([("msg_1", 17, 4_000)])._spans) is int  # 32 bytes, not 64
    # A segment keeps the id itself and the span inside its one int of places: no ItemIds,
    # no int of its own (100,000s of segments, one per turn, each ~80 bytes less).
    segment = Segment(
        b"x" * 4_000, 1, NO_CALLS, durable=True, item_ids=ItemIds([("msg_1", 17, 4_000)])
    )
    segment.sid = 123_456
    segment.place(9_000_000, 1_234)
    held = gc.get_referents(segment)
    assert "msg_1" in held and not [o for o in held if isinstance(o, ItemIds)]
    ints = {o for o in held if type(o) is int}
    assert segment.at in ints and not {17 << 30 | 4_000, 123_456, 9_000_000, 1_234} & ints
    assert sys.getsizeof(segment) <= 128
