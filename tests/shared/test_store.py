"""SharedStore (store/shared/store.py) against a real Valkey / redis-server 7.0: chains across
replicas, forks, deletes, item references, expiry, privacy, start-up checks, failures."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from ocxproxy.errors import FailureReason, StorageUnavailable, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import ItemIds, Record, Turn
from ocxproxy.store import shared_store
from ocxproxy.store.shared import checks
from ocxproxy.store.shared.checks import SharedStoreRefused
from ocxproxy.store.shared.keys import LAYOUT, Keys, budget_keys
from ocxproxy.store.shared.store import SharedStore
from tests.shared.servers import KvServer
from tests.store.helpers import Clock, sample

MakeStore = Callable[..., Awaitable[SharedStore]]


def turn(
    response_id: str,
    user: str,
    *,
    scope: str = "scope-a",
    durable: bool = True,
    item_id: str | None = None,
    call_id: str | None = None,
) -> Turn:
    """A turn adding one user message and one output item (a message, with `item_id`; or
    a function call)."""
    output: dict[str, Any]
    if call_id is not None:
        output = {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}
    else:
        output = {"type": "message", "role": "assistant", "content": f"echo: {user}"}
    if item_id is not None:
        output = {"id": item_id, **output}
    user_item = orjson.dumps({"role": "user", "content": user})
    out = orjson.dumps(output)
    items = user_item + b"," + out
    spans = [(item_id, len(user_item) + 1, len(items))] if item_id else []
    response = {"id": response_id, "object": "response", "status": "completed", "output": [output]}
    return Turn(
        response_id=response_id,
        scope=scope,
        durable=durable,
        items=items,
        n_items=2,
        call_ids=frozenset({call_id} if call_id else ()),
        response=orjson.dumps(response),
        item_ids=ItemIds(spans),
        backend="http://b1",
    )


@pytest.fixture
async def make_store(kv_server: KvServer) -> AsyncIterator[MakeStore]:
    stores: list[SharedStore] = []

    async def make(**options: Any) -> SharedStore:
        settings: dict[str, Any] = {
            "max_resident_bytes": 1024 * 1024,
            "max_entries": 1000,
            "ttl": 3600.0,
            "metrics": Metrics(),
            "start_timeout": 2.0,
        }
        settings.update(options)
        store = shared_store(settings.pop("url", kv_server.url), **settings)
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


async def chain_of(store: SharedStore, parent: Record | None, ids: list[str]) -> Record:
    for rid in ids:
        record = store.put(turn(rid, f"user says {rid}"), parent)
        await store.commit(record)
        parent = record
    assert parent is not None
    return parent


SCOPE_A = Keys("ocx:", "scope-a")  # the key names of the scope most tests use


async def raw_client(server: KvServer) -> aioredis.Redis:
    return aioredis.Redis.from_url(server.url)


async def test_a_chain_alternating_between_replicas_replays_the_same_bytes(
    make_store: MakeStore,
) -> None:
    a, b, c = await make_store(), await make_store(), await make_store()
    replicas = [a, b, c]
    parent: Record | None = None
    bodies: list[bytes] = []
    for n in range(9):
        store = replicas[n % 3]
        if parent is not None:
            parent = await store.lookup("scope-a", parent.id)
            bodies.append(b",".join(await store.history(parent)))
        record = store.put(turn(f"resp_{n}", f"turn {n}"), parent)
        await store.commit(record)
        parent = record
    for before, after in itertools.pairwise(bodies):
        assert after.startswith(before + b",")  # append-only byte prefix
    final = await b.lookup("scope-a", "resp_8")
    assert final.n_items == 18
    assert b",".join(await b.history(final)) == b",".join(
        turn(f"resp_{n}", f"turn {n}").items for n in range(9)
    )
    assert final.backend == "http://b1"


async def test_begin_takes_cached_segments_and_fetches_only_missing_ones(
    make_store: MakeStore,
) -> None:
    a, b = await make_store(), await make_store()
    await chain_of(a, None, ["r1", "r2", "r3"])
    cache = b.metrics.shared_cache

    def fetches() -> int:
        return sum(b.metrics.shared_seconds.labels("fetch").counts)

    await b.lookup("scope-a", "r3")  # cold: BEGIN sent the newest two, one MGET for r1's
    assert (sample(cache, result="miss"), sample(cache, result="hit"), fetches()) == (3, 0, 1)
    await b.lookup("scope-a", "r3")  # all cached now
    assert (sample(cache, result="miss"), sample(cache, result="hit"), fetches()) == (3, 3, 1)
    parent = await a.lookup("scope-a", "r3")
    await chain_of(a, parent, ["r4"])
    await b.lookup("scope-a", "r4")  # one new segment, sent along with BEGIN: no MGET
    assert (sample(cache, result="miss"), sample(cache, result="hit"), fetches()) == (4, 6, 1)
    b.cache = type(b.cache)(b.cache.max_bytes)  # forgotten: one MGET for the two oldest
    await b.lookup("scope-a", "r4")
    assert fetches() == 2


async def test_a_segment_missing_between_cached_ones_is_fetched_into_its_place(
    make_store: MakeStore,
) -> None:
    a, b = await make_store(), await make_store()
    await chain_of(a, None, [f"r{n}" for n in range(1, 7)])
    before = b",".join(await a.history(await a.lookup("scope-a", "r6")))
    full = await b.lookup("scope-a", "r6")  # every segment cached in b
    b.cache.remove(full.segments[2])  # one in the middle forgotten, those after it not
    record = await b.lookup("scope-a", "r6")
    assert sum(b.metrics.shared_seconds.labels("fetch").counts) == 2  # r1's MGET, then r3's
    assert [s.key for s in record.segments] == [s.key for s in full.segments]
    assert b",".join(await b.history(record)) == before
    assert sample(b.metrics.shared_cache, result="miss") == 7  # 6 cold, then the one


async def test_a_response_object_round_trips_with_its_output_cut_out(
    make_store: MakeStore,
) -> None:
    a, b = await make_store(), await make_store()
    t = turn("r1", "hello", item_id="msg_1")
    await a.commit(a.put(t, None))
    record = await b.lookup("scope-a", "r1")
    assert record.output_at is not None  # stored once, in the segment
    assert await b.response_bytes(record) == t.response


async def test_siblings_off_one_parent_fork_the_chain(make_store: MakeStore) -> None:
    a, b = await make_store(), await make_store()
    root = await chain_of(a, None, ["r1", "r2"])
    pa, pb = await a.lookup("scope-a", root.id), await b.lookup("scope-a", root.id)
    left, right = a.put(turn("left", "L"), pa), b.put(turn("right", "R"), pb)
    await a.commit(left)
    await b.commit(right)  # the chain grew meanwhile: a fork
    got_left, got_right = await b.lookup("scope-a", "left"), await a.lookup("scope-a", "right")
    base = turn("r1", "user says r1").items + b"," + turn("r2", "user says r2").items
    assert b",".join(await b.history(got_left)) == base + b"," + turn("left", "L").items
    assert b",".join(await a.history(got_right)) == base + b"," + turn("right", "R").items
    assert got_left.chain != got_right.chain  # type: ignore[attr-defined]
    # Each goes on along its own chain.
    deeper = await chain_of(b, got_right, ["right2"])
    again = await a.lookup("scope-a", deeper.id)
    assert b",".join(await a.history(again)).startswith(base + b"," + turn("right", "R").items)
    assert len(again.segments) == 4


async def test_a_delete_on_one_replica_is_seen_by_every_other(make_store: MakeStore) -> None:
    a, b = await make_store(), await make_store()
    await chain_of(a, None, ["r1", "r2"])
    await b.lookup("scope-a", "r2")
    assert await a.delete("scope-a", "r2")
    with pytest.raises(StoreFailure) as caught:
        await b.lookup("scope-a", "r2")
    assert caught.value.reason == FailureReason.UNKNOWN
    assert not await b.delete("scope-a", "r2")
    assert (await b.lookup("scope-a", "r1")).n_items == 2  # the parent stays


async def test_another_scope_never_sees_a_record_or_an_item(make_store: MakeStore) -> None:
    a, b = await make_store(), await make_store()
    await a.commit(a.put(turn("r1", "secret", item_id="msg_1"), None))
    with pytest.raises(StoreFailure):
        await b.lookup("scope-b", "r1")
    with pytest.raises(StoreFailure):
        await b.find_item("scope-b", "msg_1")
    assert not await b.delete("scope-b", "r1")
    assert (await b.lookup("scope-a", "r1")).id == "r1"


async def test_an_item_reference_resolves_on_another_replica(make_store: MakeStore) -> None:
    a, b = await make_store(), await make_store()
    t = turn("r1", "hello", item_id="msg_1")
    await a.commit(a.put(t, None))
    record = await b.find_item("scope-a", "msg_1")
    (data,) = await b.item_bytes([(record, "msg_1")])
    assert orjson.loads(data)["id"] == "msg_1"
    assert t.items.endswith(data)
    with pytest.raises(StoreFailure):
        await b.find_item("scope-a", "msg_unknown")


async def test_a_store_false_turn_never_reaches_the_server(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    a = await make_store()
    stored = await chain_of(a, None, ["r1"])
    parent = await a.lookup("scope-a", stored.id)
    secret = a.put(turn("r2", "MARKER-unstored", durable=False, item_id="msg_x"), parent)
    await a.commit(secret)
    assert (await a.lookup("scope-a", "r2")).id == "r2"  # kept in this process
    client = await raw_client(kv_server)
    try:
        keys = [k async for k in client.scan_iter(match="*")]
        values = [await client.dump(k) or b"" for k in keys]
    finally:
        await client.aclose()
    assert keys and all(k.startswith(SCOPE_A.base) or k in budget_keys("ocx:") for k in keys)
    assert not any(b"MARKER" in k or b"msg_x" in k for k in keys)
    assert not any(b"MARKER" in v for v in values)  # zstd frames: check decompressed too
    b = await make_store()
    with pytest.raises(StoreFailure):
        await b.lookup("scope-a", "r2")


async def test_an_expired_record_is_gone_everywhere(make_store: MakeStore) -> None:
    clock = Clock(1_700_000_000.0)
    import time

    clock.now = time.time()
    a = await make_store(clock=clock, ttl=60.0)
    b = await make_store(clock=clock, ttl=60.0)
    await chain_of(a, None, ["r1"])
    clock.now += 61
    with pytest.raises(StoreFailure) as caught:
        await b.lookup("scope-a", "r1")
    assert caught.value.reason == FailureReason.EXPIRED
    assert sample(b.metrics.store_evictions, reason="expired") == 1


async def test_keys_carry_ttls_and_a_commit_extends_its_chain(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    a = await make_store(ttl=100.0)
    await chain_of(a, None, ["r1", "r2"])
    client = await raw_client(kv_server)
    try:
        keys = [k async for k in client.scan_iter(match=SCOPE_A.base + b"*")]
        ttls = {k: await client.pttl(k) for k in keys}
    finally:
        await client.aclose()
    assert len(keys) == 2 + 1 + 2  # records (with their response objects), a chain, 2 segments
    assert all(0 < ttl <= 110_000 for ttl in ttls.values())  # a tenth of slack
    assert all(ttl <= 100_000 for key, ttl in ttls.items() if key.startswith(SCOPE_A.base + b"r"))
    # A child living longer keeps its whole chain alive as long (never shortening a TTL).
    longer = await make_store(ttl=1000.0)
    await chain_of(longer, await longer.lookup("scope-a", "r2"), ["r3"])
    first = hashlib.sha256(turn("r1", "user says r1").items).hexdigest()
    client = await raw_client(kv_server)
    try:
        assert await client.pttl(SCOPE_A.segment(first)) > 110_000
        assert 0 < await client.pttl(SCOPE_A.record("r1")) <= 100_000
    finally:
        await client.aclose()


async def test_past_the_byte_budget_the_oldest_chains_go_whole(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    a = await make_store(max_bytes=2000)
    b = await make_store(max_bytes=2000)
    for n in range(12):  # separate chains, a few hundred bytes each
        await chain_of(a if n % 2 else b, None, [f"c{n}-1", f"c{n}-2"])
    evicted = sample(a.metrics.store_evictions, reason="shared_bytes") + sample(
        b.metrics.store_evictions, reason="shared_bytes"
    )
    assert evicted >= 6
    assert max(a.shared_bytes, b.shared_bytes) <= 2000
    with pytest.raises(StoreFailure) as caught:
        await a.lookup("scope-a", "c0-2")
    assert caught.value.reason == FailureReason.EVICTED
    assert (await a.lookup("scope-a", "c11-2")).n_items == 4  # the newest stay
    client = await raw_client(kv_server)
    try:  # the evicted chains' segments are gone from the server, not just unreachable
        segments = [k async for k in client.scan_iter(match=SCOPE_A.base + b"s*")]
    finally:
        await client.aclose()
    assert len(segments) < 12 * 4


async def test_a_corrupt_segment_fails_its_digest(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    a, b = await make_store(), await make_store()
    t = turn("r1", "hello")
    await a.commit(a.put(t, None))
    digest = hashlib.sha256(t.items).hexdigest()
    client = await raw_client(kv_server)
    try:
        key = SCOPE_A.segment(digest)
        value = await client.get(key)
        await client.set(key, value[:-3] + b"xyz", keepttl=True)
    finally:
        await client.aclose()
    with pytest.raises(StoreFailure) as caught:
        await b.lookup("scope-a", "r1")
    assert caught.value.reason == FailureReason.CORRUPT


async def test_kept_records_stay_in_the_process_and_never_reach_the_server(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    """What the store keeps in `local` (a store:false Idempotency-Key's response) is this
    process's alone: another replica and the server never see it (shared conversations
    and keys have their own keys: conversations.py)."""
    a, b = await make_store(), await make_store()
    kept = a.local.kept.keep("idem_1", "scope-a", (), b"{}", created_at=0.0, durable=False)
    assert a.local.record("scope-a", "idem_1") is kept
    with pytest.raises(StoreFailure):
        b.local.record("scope-a", "idem_1")
    with pytest.raises(StoreFailure):
        await b.lookup("scope-a", "idem_1")
    client = await raw_client(kv_server)
    try:
        assert not [k async for k in client.scan_iter(match=b"*idem_1*")]
    finally:
        await client.aclose()


async def test_a_server_down_fails_closed_and_recovers_without_restart(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    a = await make_store()
    parent = await chain_of(a, None, ["r1"])
    kv_server.close()
    with pytest.raises(StorageUnavailable):
        await a.lookup("scope-a", "r1")
    assert not a.available
    assert sample(a.metrics.shared_available) == 0
    pending = a.put(turn("r2", "lost"), parent)
    with pytest.raises(StoreFailure) as caught:
        await a.commit(pending)
    assert caught.value.reason == FailureReason.WRITE_FAILED
    assert sample(a.metrics.shared_commits, outcome="unavailable") == 1
    await kv_server.astart()  # the same data dir: the AOF brings r1 back
    import asyncio

    for _ in range(50):
        if a.available:
            break
        await asyncio.sleep(0.1)
    assert a.available  # the probe saw it
    assert (await a.lookup("scope-a", "r1")).id == "r1"
    with pytest.raises(StoreFailure):
        await a.lookup("scope-a", "r2")  # never acknowledged, never stored


@pytest.mark.parametrize(
    ("settings", "durability", "refused"),
    [
        ({"appendfsync": "everysec"}, "ack", "appendfsync always"),
        ({"appendonly": False}, "ack", "appendonly yes"),
        ({"maxmemory_policy": "allkeys-lru"}, "relaxed", "noeviction"),
        ({"maxmemory_policy": "volatile-ttl"}, "ack", "noeviction"),
        ({"appendfsync": "everysec"}, "relaxed", None),
        ({"appendonly": False}, "relaxed", None),
    ],
)
async def test_start_checks_the_server_against_the_durability_profile(
    make_kv_server: Callable[..., Awaitable[KvServer]],
    settings: dict[str, Any],
    durability: str,
    refused: str | None,
) -> None:
    server = await make_kv_server("valkey", **settings)
    store = shared_store(
        server.url, max_resident_bytes=1024, max_entries=10, ttl=60.0, durability=durability
    )
    try:
        if refused is None:
            await store.start()
            await store.commit(store.put(turn("r1", "x"), None))
        else:
            with pytest.raises(SharedStoreRefused, match=refused):
                await store.start()
    finally:
        await store.close()


@pytest.mark.parametrize(("lazy_expire", "warned"), [("no", True), ("yes", False)])
async def test_start_warns_when_the_server_frees_expired_keys_in_its_main_thread(
    make_kv_server: Callable[..., Awaitable[KvServer]],
    caplog: pytest.LogCaptureFixture,
    lazy_expire: str,
    warned: bool,
) -> None:
    server = await make_kv_server("valkey", extra={"lazyfree-lazy-expire": lazy_expire})
    store = shared_store(server.url, max_resident_bytes=1024, max_entries=10, ttl=60.0)
    try:
        with caplog.at_level(logging.WARNING, logger="ocxproxy.store.shared"):
            await store.start()
    finally:
        await store.close()
    assert any("lazyfree-lazy-expire" in r.getMessage() for r in caplog.records) is warned


async def test_an_unreachable_server_at_start_is_refused(make_store: MakeStore) -> None:
    with pytest.raises(SharedStoreRefused, match="unreachable"):
        await make_store(url="redis://127.0.0.1:1/0", start_timeout=0.3)


async def test_connections_from_before_a_server_restart_are_not_a_failure(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    a = await make_store()
    await chain_of(a, None, ["r1"])
    await asyncio.gather(*(a.lookup("scope-a", "r1") for _ in range(8)))  # 8 pooled connections
    kv_server.kill9()
    await kv_server.astart()
    found = await asyncio.gather(*(a.lookup("scope-a", "r1") for _ in range(8)))
    assert {record.id for record in found} == {"r1"}
    assert a.available


async def test_a_commit_run_twice_writes_once(make_store: MakeStore, kv_server: KvServer) -> None:
    a = await make_store()
    parent = await chain_of(a, None, ["r1"])
    child = a.put(turn("r2", "once"), await a.lookup("scope-a", parent.id))
    await a.commit(child)
    again = await a._commit(child, parent)  # as after a reply lost on the way back
    assert again == child.chain  # type: ignore[attr-defined]
    client = await raw_client(kv_server)
    try:
        assert await client.llen(again) == 2
    finally:
        await client.aclose()
    assert len((await a.lookup("scope-a", "r2")).segments) == 2


async def test_wait_replicas_acknowledges_only_what_a_replica_holds(
    make_kv_server: Callable[..., Awaitable[KvServer]],
    kv_server: KvServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a loaded 2-core box a replica's fsync can outlast the 1 s default, so the timeout
    # here must mean "no replica" (provoked by stopping it); 3 s stays under the wire's 5 s
    # stall cut-off, which would count the commit as unavailable instead.
    monkeypatch.setattr(checks, "WAIT_TIMEOUT_MS", 3000)
    client = await raw_client(kv_server)
    await client.config_set("repl-diskless-sync-delay", 0)  # sync the replica at once
    replica = await make_kv_server(
        kv_server.kind, extra={"replicaof": f"127.0.0.1 {kv_server.port}"}
    )
    try:
        for _ in range(100):  # until the replica, synced, acknowledges a write
            await client.set("probe", "1")
            try:
                acked = (await client.execute_command("WAITAOF", 0, 1, 100))[-1]
            except ResponseError:  # Redis 7.0
                acked = await client.execute_command("WAIT", 1, 100)
            if acked >= 1:
                break
            await asyncio.sleep(0.1)
        store = shared_store(
            kv_server.url, max_resident_bytes=1 << 20, max_entries=10, ttl=60.0, wait_replicas=1
        )
        await store.start()
        try:
            await store.commit(store.put(turn("r1", "held twice"), None))
            assert await store.delete("scope-a", "r1")
            replica.stop()
            with pytest.raises(StoreFailure) as caught:  # WAIT(AOF) times out at 0 replicas
                await store.commit(store.put(turn("r2", "held once"), None))
            assert caught.value.reason == FailureReason.WRITE_FAILED
            assert sample(store.metrics.shared_commits, outcome="write_failed") == 1
        finally:
            await store.close()
    finally:
        await client.aclose()


async def test_a_unix_socket_url_serves_like_tcp(
    make_kv_server: Callable[..., Awaitable[KvServer]],
) -> None:
    server = await make_kv_server("valkey", unix_socket=True)
    assert server.url.startswith("unix://")
    a = shared_store(server.url, max_resident_bytes=1 << 20, max_entries=10, ttl=60.0)
    b = shared_store(server.tcp_url, max_resident_bytes=1 << 20, max_entries=10, ttl=60.0)
    await a.start()
    await b.start()
    try:
        await chain_of(a, None, ["r1", "r2"])
        assert len((await b.lookup("scope-a", "r2")).segments) == 2
    finally:
        await a.close()
        await b.close()


def response_turn(response: dict[str, Any], output: dict[str, Any], rid: str) -> Turn:
    """A turn whose response object is `response` with `output` as its one item."""
    items = orjson.dumps({"role": "user", "content": "hi"}) + b"," + orjson.dumps(output)
    return Turn(
        response_id=rid,
        scope="scope-a",
        durable=True,
        items=items,
        n_items=2,
        call_ids=frozenset(),
        response=orjson.dumps({**response, "output": [output]}),
        item_ids=ItemIds([]),
        backend="http://b1",
    )


async def test_a_response_replays_byte_identically_from_another_replica(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    """The response object is stored compressed with the dictionary and without its id
    (the key has it): another replica gives back the very bytes, wherever the id was."""
    a, b = await make_store(), await make_store()
    output = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "ok", "annotations": []}]}  # fmt: skip
    full = {"previous_response_id": "resp_0", "id": "resp_1", "object": "response",
            "created_at": 1700000000, "status": "completed", "model": "gpt-5", "error": None,
            "instructions": "Say resp_1.", "tools": [], "metadata": {"id": "resp_1"},
            "usage": {"input_tokens": 12, "output_tokens": 1, "total_tokens": 13}}  # fmt: skip
    no_id = {"object": "response", "id": "resp_2x", "status": "completed"}
    # the second's id is not in its object: stored as it is
    turns = [response_turn(full, output, "resp_1"), response_turn(no_id, output, "resp_2")]
    for t in turns:
        await a.commit(a.put(t, None))
    for t in turns:
        record = await b.lookup("scope-a", t.response_id)
        assert await b.response_bytes(record) == t.response
    client = await raw_client(kv_server)
    try:
        value = await client.get(SCOPE_A.record("resp_1"))
    finally:
        await client.aclose()
    assert len(value) < len(turns[0].response) * 0.8  # compressed, output and id cut out


async def test_data_under_another_layout_is_not_read(
    make_store: MakeStore, kv_server: KvServer
) -> None:
    """Keys of another layout are other names: a replica never reads them (no misread
    value, no crash), whether the old layout's (`ocx:{scope}:r:{id}`, a hash) or this
    layout's values under another tag."""
    a = await make_store()
    await chain_of(a, None, ["r1"])
    client = await raw_client(kv_server)
    try:
        await client.hset(
            "ocx:scope-a:r:r2",
            mapping={"chain": "ocx:scope-a:c:00", "len": "1", "meta": "{}", "resp": "r{}"},
        )
        await client.rpush("ocx:scope-a:c:00", "ab" * 32)
        for key in [k async for k in client.scan_iter(match=SCOPE_A.base + b"*")]:
            other = key.replace(b"ocx:" + LAYOUT, b"ocx:\x01", 1)
            await client.rename(key, other)
    finally:
        await client.aclose()
    b = await make_store()
    for rid in ("r1", "r2"):
        with pytest.raises(StoreFailure) as caught:
            await b.lookup("scope-a", rid)
        assert caught.value.reason == FailureReason.UNKNOWN
