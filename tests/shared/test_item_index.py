"""The shared tier's item index (store/shared/layout.py): item id -> the record whose own
segment holds it, for `item_reference` from any replica. One hash per scope and span of
expiry times, not one key per item; it expires on the server with its records, counts in
the byte budget, and a DELETE makes the response's items unresolvable everywhere."""

from __future__ import annotations

import asyncio

import pytest

from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store.shared import keys as shared_keys
from tests.shared.servers import KvServer
from tests.shared.test_store import SCOPE_A, MakeStore, make_store, raw_client, turn

__all__ = ["make_store"]  # the fixture, shared with test_store.py


async def index_keys(server: KvServer) -> dict[bytes, int]:
    """The scope's index keys (its buckets and their directory) and their TTLs (ms)."""
    client = await raw_client(server)
    try:
        keys = [k async for k in client.scan_iter(match=SCOPE_A.base + b"[id]*")]
        return {k: await client.pttl(k) for k in keys}
    finally:
        await client.aclose()


async def test_items_of_many_turns_share_one_hash_with_the_records_ttl(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    a, b = await make_store(ttl=100.0), await make_store(ttl=100.0)
    parent = None
    for n in range(6):
        parent = a.put(turn(f"r{n}", f"says {n}", item_id=f"msg_{n:032x}"), parent)
        await a.commit(parent)
    found = await index_keys(kv_server)
    (bucket,) = (k for k in found if k != SCOPE_A.buckets())
    assert set(found) == {bucket, SCOPE_A.buckets()}
    client = await raw_client(kv_server)
    try:
        fields = await client.hgetall(bucket)
    finally:
        await client.aclose()
    assert fields == {shared_keys.item_field(f"msg_{n:032x}"): f"r{n}".encode() for n in range(6)}
    # It lives as long as its records, and at most an eighth of the TTL longer.
    assert all(100_000 - 5_000 < ttl <= 100_000 + 12_500 for ttl in found.values())
    for n in range(6):
        record = await b.find_item("scope-a", f"msg_{n:032x}")
        assert record.id == f"r{n}"
        (data,) = await b.item_bytes([(record, f"msg_{n:032x}")])
        assert f"msg_{n:032x}".encode() in data


async def test_a_deleted_response_leaves_its_items_unresolvable_everywhere(
    make_store: MakeStore,
) -> None:
    a, b = await make_store(), await make_store()
    first = a.put(turn("r1", "one", item_id="msg_1"), None)
    await a.commit(first)
    await a.commit(a.put(turn("r2", "two", item_id="msg_2"), first))
    assert (await b.find_item("scope-a", "msg_2")).id == "r2"
    assert await a.delete("scope-a", "r2")
    with pytest.raises(StoreFailure) as caught:
        await b.find_item("scope-a", "msg_2")
    assert caught.value.reason == FailureReason.UNKNOWN
    assert (await b.find_item("scope-a", "msg_1")).id == "r1"


async def test_the_newest_holder_wins_across_replicas_with_other_ttls(
    make_store: MakeStore,
) -> None:
    short, long = await make_store(ttl=100.0), await make_store(ttl=1000.0)
    await short.commit(short.put(turn("r1", "one", item_id="msg_1"), None))
    assert (await long.find_item("scope-a", "msg_1")).id == "r1"
    await long.commit(long.put(turn("r2", "again", item_id="msg_1"), None))
    assert (await short.find_item("scope-a", "msg_1")).id == "r2"


async def test_index_entries_expire_on_the_server_with_their_records(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    brief, lasting = await make_store(ttl=1.0), await make_store(ttl=60.0)
    await brief.commit(brief.put(turn("r1", "one", item_id="msg_1"), None))
    await lasting.commit(lasting.put(turn("r2", "two", item_id="msg_2"), None))
    assert (await lasting.find_item("scope-a", "msg_1")).id == "r1"
    assert len(await index_keys(kv_server)) == 3  # two buckets and their directory
    await asyncio.sleep(2.2)  # past r1's expiry and its bucket's end (1/8 s later at most)
    with pytest.raises(StoreFailure) as caught:
        await lasting.find_item("scope-a", "msg_1")
    assert caught.value.reason == FailureReason.UNKNOWN
    assert len(await index_keys(kv_server)) == 2  # r1's bucket expired on the server
    await brief.commit(brief.put(turn("r3", "three", item_id="msg_3"), None))
    client = await raw_client(kv_server)
    try:  # a new bucket drops the past ones from the directory
        ends = await client.zrange(SCOPE_A.buckets(), 0, -1)
    finally:
        await client.aclose()
    live = await index_keys(kv_server)
    assert len(ends) == 2 and all(SCOPE_A.bucket(int(e)) in live for e in ends)
    assert (await lasting.find_item("scope-a", "msg_3")).id == "r3"
    assert (await brief.find_item("scope-a", "msg_2")).id == "r2"


async def test_the_index_counts_in_the_byte_budget(make_store: MakeStore) -> None:
    a = await make_store()
    await a.commit(a.put(turn("r1", "same words"), None))
    plain = a.shared_bytes
    await a.commit(a.put(turn("r2", "same words", item_id="msg_2"), None))
    with_id = a.shared_bytes - plain
    await a.commit(a.put(turn("r3", "same words", item_id="msg_3"), None))
    # The first entry brings its bucket and directory; the next only its field and value.
    assert with_id - plain >= len(SCOPE_A.buckets()) + 8 + len("r2")
    assert a.shared_bytes - plain - with_id >= 8 + len("r3")
