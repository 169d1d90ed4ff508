"""Shared conversations' lifetime, bytes and storage on a real Valkey / redis-server
(docs/BEHAVIOR.md, "With a shared store"): a conversation never expires (as on one node),
a completed Idempotency-Key's expiry is counted; both count in --shared-max-bytes; past
the budget, response chains are evicted and a conversation write that only dropping
conversation bytes could make room for is refused with 507; a turn's record chains on the
conversation's previous turn, so a conversation's bytes grow linearly with its length
while the backend sees the same append-only bytes."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
import redis.asyncio as aioredis

from ocxproxy.aio import spawn
from ocxproxy.store.shared import conversations, idempotency
from ocxproxy.store.shared.keys import LAYOUT, kept_keys
from ocxproxy.store.shared.store import SharedStore
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only
from tests.shared.servers import KvServer
from tests.shared.test_conversations import replicas, texts, user


@pytest.fixture
async def kv(kv_server: KvServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(kv_server.url)
    yield client
    await client.aclose()


def shared(proxy: ProxyHandle) -> SharedStore:
    store = proxy.proxy.store
    assert isinstance(store, SharedStore)
    return store


async def kept_total(kv: aioredis.Redis) -> int:
    return int(await kv.get(kept_keys("ocx:")[2]) or 0)


async def keys_of(kv: aioredis.Redis, kind: bytes) -> list[bytes]:
    """The server's keys of a kind: b"conv" (text names) or a layout kind byte (s, c, r)."""
    if kind == b"conv":
        return [key async for key in kv.scan_iter(match="*:conv:*", count=1000)]
    layout = b"ocx:" + LAYOUT + b"\x10"  # the prefix, the layout tag, a scope hash's length
    return [key async for key in kv.scan_iter(count=1000) if key[:6] + key[22:23] == layout + kind]


async def test_a_conversation_outlives_ttl_while_its_turns_responses_expire(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, kv: aioredis.Redis
) -> None:
    a, b = await replicas(make_proxy, backend, kv_server.url, n=2, ttl=2.0)
    conv = await a.client().conversations.create(items=[user("first")])
    turn = await a.client().responses.create(model="m", input="a turn", conversation=conv.id)
    assert await keys_of(kv, b"conv")
    for key in await keys_of(kv, b"conv"):
        assert await kv.pttl(key) == -1  # no TTL: a conversation lives until DELETE
    await asyncio.sleep(2.3)
    with pytest.raises(openai.BadRequestError) as gone:  # the turn's response is past --ttl
        await b.client().responses.create(model="m", input="x", previous_response_id=turn.id)
    assert gone.value.code == "previous_response_not_found"
    # the conversation is not: a turn after its last turn's chain expired still works
    await b.client().responses.create(model="m", input="later", conversation=conv.id)
    got = await texts(a.client(), conv.id)
    assert got[:2] == ["first", "a turn"] and got[3] == "later" and len(got) == 5
    sent = backend.seen[-1].body  # the whole history was forwarded
    assert b"first" in sent and b"a turn" in sent and b"later" in sent
    for key in await keys_of(kv, b"conv"):
        assert await kv.pttl(key) == -1


async def test_a_completed_keys_expiry_leaves_the_count_and_is_counted(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    kv_server: KvServer,
    kv: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(idempotency, "TTL", 1.5)
    a, b = await replicas(make_proxy, backend, kv_server.url, n=2)
    conv = await a.client().conversations.create(items=[user("kept")])
    await a.client().responses.create(
        model="m", input="keyed", extra_headers={"Idempotency-Key": "expiring-key"}
    )
    with_key = await kept_total(kv)
    await asyncio.sleep(1.8)
    await b.client().conversations.update(conv.id, metadata={"k": "v"})
    assert await kept_total(kv) < with_key
    assert b.metric("ocxproxy_store_evictions_total", reason="shared_expired") == 1
    assert await texts(b.client(), conv.id) == ["kept"]  # the conversation stays


async def test_a_conversations_bytes_are_counted_and_leave_the_count_with_it(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, kv: aioredis.Redis
) -> None:
    a, b = await replicas(make_proxy, backend, kv_server.url, n=2)
    conv = await a.client().conversations.create(items=[user(secrets.token_hex(1500))])
    first = await kept_total(kv)
    assert first > 1500  # compressed, but counted
    await b.client().conversations.items.create(conv.id, items=[user(secrets.token_hex(500))])
    second = await kept_total(kv)
    assert second > first
    # the proxies' gauge is the server's count (conversations and response chains)
    total = int(await kv.get(kept_keys("ocx:")[3]))
    assert shared(b).shared_bytes == total
    item = (await a.client().conversations.items.list(conv.id, order="asc")).data[1]
    await a.client().conversations.items.delete(item.id, conversation_id=conv.id)
    assert await kept_total(kv) == first  # the item's entry left the count
    await b.client().conversations.delete(conv.id)
    assert await kept_total(kv) == 0
    assert int(await kv.get(kept_keys("ocx:")[3])) == 0


async def test_past_the_budget_chains_are_evicted_and_conversation_writes_are_refused(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, kv: aioredis.Redis
) -> None:
    a, b = await replicas(make_proxy, backend, kv_server.url, n=2, shared_max_bytes=6000)
    plain = await a.client().responses.create(model="m", input=secrets.token_hex(200))
    made, refused = [], None
    for _ in range(40):
        try:
            made.append(await b.client().conversations.create(items=[user(secrets.token_hex(300))]))
        except openai.APIStatusError as error:
            refused = error
            break
    assert refused is not None and refused.status_code == 507 and refused.code == "store_full"
    assert len(made) >= 3 and await kept_total(kv) <= 6000
    # the next commit evicts the plain response's chain to make room; no conversation goes
    await b.client().responses.create(model="m", input="another")
    with pytest.raises(openai.BadRequestError):
        await a.client().responses.create(model="m", input="next", previous_response_id=plain.id)
    assert (
        a.metric("ocxproxy_store_evictions_total", reason="shared_bytes")
        + b.metric("ocxproxy_store_evictions_total", reason="shared_bytes")
        >= 1
    )
    for conv in made:
        assert len(await texts(a.client(), conv.id)) == 1
    # a turn whose own items do not fit is refused before the backend sees it
    calls = len(backend.responses_seen)
    with pytest.raises(openai.APIStatusError) as error:
        await a.client().responses.create(model="m", input="z" * 8000, conversation=made[0].id)
    assert error.value.status_code == 507 and len(backend.responses_seen) == calls
    # deleting a conversation makes room again
    await a.client().conversations.delete(made[1].id)
    await b.client().conversations.create(items=[user("fits again")])


async def test_a_long_conversations_turns_chain_so_its_bytes_grow_linearly(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, kv: aioredis.Redis
) -> None:
    proxies = await replicas(make_proxy, backend, kv_server.url)
    clients = [p.client() for p in proxies]
    conv = await clients[0].conversations.create(items=[user("first")])
    totals: list[int] = []
    response: Any = None
    for n in range(30):
        response = await clients[n % 3].responses.create(
            model="m", input=f"turn {n} " + "w" * 200, conversation=conv.id
        )
        totals.append(shared(proxies[n % 3]).shared_bytes)
    assert_append_only([seen.body for seen in backend.responses_seen])
    # one chain; a segment per append, each stored once
    assert len(await keys_of(kv, b"c")) == 1
    assert len(await keys_of(kv, b"s")) == 31
    assert len(await keys_of(kv, b"r")) == 30
    early, late = totals[10] - totals[0], totals[29] - totals[19]
    assert late < early * 1.3, totals  # a turn costs the same at turn 29 as at turn 1
    # the last turn continues, from another replica, on the very bytes it was sent
    last = backend.responses_seen[-1].body
    await clients[1].responses.create(model="m", input="on", previous_response_id=response.id)
    assert_append_only([last, backend.responses_seen[-1].body])


async def test_a_turn_after_items_were_added_or_deleted_chains_anew_on_the_same_bytes(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, kv: aioredis.Redis
) -> None:
    a, b, c = await replicas(make_proxy, backend, kv_server.url)
    conv = await a.client().conversations.create(items=[user("one"), user("two")])
    await b.client().responses.create(model="m", input="t1", conversation=conv.id)
    await c.client().conversations.items.create(conv.id, items=[user("added")])
    await a.client().responses.create(model="m", input="t2", conversation=conv.id)
    bodies = [seen.body for seen in backend.responses_seen]
    assert_append_only(bodies)
    assert len(await keys_of(kv, b"c")) == 2  # the turn after the added item: a new chain
    items = (await b.client().conversations.items.list(conv.id, order="asc")).data
    await b.client().conversations.items.delete(items[1].id, conversation_id=conv.id)
    after = await c.client().responses.create(model="m", input="t3", conversation=conv.id)
    assert len(await keys_of(kv, b"c")) == 3
    sent = backend.responses_seen[-1].json["input"]
    assert [i.get("content") for i in sent][:2] == ["one", "t1"]  # "two" is gone
    # its record holds exactly what was sent, from any replica
    await a.client().responses.create(model="m", input="on", previous_response_id=after.id)
    assert_append_only([backend.responses_seen[-2].body, backend.responses_seen[-1].body])


async def test_a_turn_whose_previous_turns_chain_is_evicted_meanwhile_is_still_stored(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, kv: aioredis.Redis
) -> None:
    a, b, c = await replicas(make_proxy, backend, kv_server.url)
    conv = await a.client().conversations.create(items=[user("one")])
    await a.client().responses.create(model="m", input="t1", conversation=conv.id)
    backend.stall_next(1.0)
    turn = spawn(
        b.client().responses.create(model="m", input="t2", conversation=conv.id), name="turn"
    )
    await backend.wait_for(lambda: len(backend.responses_seen) == 2)
    # as the byte budget evicts a chain, while the turn runs: its list and its segments
    await kv.delete(*await keys_of(kv, b"c"), *await keys_of(kv, b"s"))
    response = await turn
    sent = backend.responses_seen[-1].body
    # from a replica that holds no segment: every one is on the server again
    await c.client().responses.create(model="m", input="on", previous_response_id=response.id)
    assert_append_only([sent, backend.responses_seen[-1].body])
    assert len(await keys_of(kv, b"c")) == 1  # the turn's own chain, continued


def test_an_entry_written_before_entries_were_framed_is_still_read() -> None:
    data = b'{"role":"user","content":"hello"},{"id":"msg_1","type":"message"}'
    meta = orjson.dumps([["item_a", "msg_1"], 2, ["call_1"], [["msg_1", 34, 66]]])
    packed = conversations._pack(data)
    old = conversations._HEAD.pack(1, len(meta)) + meta + packed
    segment, ids = conversations.decode_entry(old)
    assert (segment.data, segment.n_items, ids) == (data, 2, ["item_a", "msg_1"])
    assert segment.call_ids == {"call_1"} and segment.item_ids.span("msg_1") == (34, 66)
    new = conversations.encode_entry(segment, ids)
    assert new[:1] != old[:1] and len(new) < len(old)
    again, same = conversations.decode_entry(new)
    assert (again.data, again.key, again.call_ids, same) == (data, segment.key, {"call_1"}, ids)
