"""A conversation turn's commit on the shared store: its response's record and its
conversation's append are one script (TURN, store/shared/conversation_scripts.py), so
they are kept together or not at all, in one round trip and one AOF write (one fsync with
appendfsync always); the lease taken with the read lives in the server's memory only, so
nothing is fsynced before the backend is called (docs/BEHAVIOR.md, "Conversations,
locking, idempotency"). Real Valkey, real proxies: in this process where round trips are
counted, `ocxproxy serve` replicas otherwise."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from ocxproxy.aio import spawn
from ocxproxy.store.shared.keys import Keys
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.shared.conftest import MakeReplicas
from tests.shared.servers import KvServer
from tests.shared.test_conversations import post, replicas, texts, user
from tests.shared.test_replicas import KEY_A, auth

Json = dict[str, Any]


def aof_increments(server: KvServer) -> bytes:
    """What the server appended to its AOF since start (the increment files)."""
    return b"".join(p.read_bytes() for p in server.aof_files() if p.name.endswith(".incr.aof"))


async def test_a_conversation_turn_is_two_round_trips_and_one_aof_write(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The lease and the items in one round trip, which writes nothing to the AOF (the
    backend is called without waiting for an fsync); the record, the append and the
    lease's release in one, one MULTI/EXEC in the AOF. A store:false turn: the read with
    the lease and the release, neither in the AOF."""
    (a,) = await replicas(make_proxy, backend, valkey_server.url, n=1)
    client = a.client()
    conv = await client.conversations.create(items=[user("hello")])
    server = a.proxy.store.server  # type: ignore[attr-defined]
    real, ops = server.round_trip, []

    async def counted(op: str, packed: bytes, answers: int = 1) -> Any:
        if not op.startswith("background_"):  # (every second, each replica's lease round)
            ops.append(op)
        return await real(op, packed, answers)

    monkeypatch.setattr(server, "round_trip", counted)
    for n in range(3):
        ops.clear()
        before = len(aof_increments(valkey_server))
        backend.stall_next(0.3)
        turn = spawn(
            client.responses.create(model="m", input=f"t{n}", conversation=conv.id), name="t"
        )
        await backend.wait_for(lambda n=n: len(backend.responses_seen) == n + 1)  # type: ignore[misc]
        assert ops == ["conversation_load"]
        assert len(aof_increments(valkey_server)) == before  # the lease: memory only
        response = await turn
        assert ops == ["conversation_load", "conversation_turn"]
        written = aof_increments(valkey_server)[before:]
        assert written.startswith(b"*1\r\n$5\r\nMULTI\r\n") and written.count(b"MULTI") == 1
        assert written.endswith(b"*1\r\n$4\r\nEXEC\r\n")
        assert response.id.encode() in written  # the record, with the append
    ops.clear()
    before = len(aof_increments(valkey_server))
    await client.responses.create(model="m", input="y", conversation=conv.id, store=False)
    assert ops == ["conversation_load", "lease_drop"]
    assert len(aof_increments(valkey_server)) == before
    assert len(await texts(client, conv.id)) == 7


async def sse_turn(
    http: aiohttp.ClientSession, url: str, body: Json, on_created: Any
) -> list[Json]:
    """A streamed turn's event payloads; `on_created(response id)` is awaited as soon as
    response.created arrives (the backend still streaming)."""
    payloads: list[Json] = []
    async with http.post(url + "/responses", json={**body, "stream": True}, headers=auth()) as r:
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payloads.append(orjson.loads(line[6:]))
            if payloads[-1]["type"] == "response.created":
                await on_created(payloads[-1]["response"]["id"])
    return payloads


async def test_a_turn_whose_record_cannot_be_written_leaves_its_conversation_as_it_was(
    valkey_server: KvServer, make_replicas: MakeReplicas, backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """After the backend answered, the turn's record cannot be written (its key is made a
    list meanwhile: COMMIT's read of it is WRONGTYPE): the client gets an error event
    saying nothing was saved, and nothing was: the conversation's keys are byte for byte
    as before, the response is unknown on every replica; the next turn runs as usual."""
    replicas = await make_replicas(valkey_server.url, 2)
    a, b = replicas[0], replicas[1]
    client = b.client(api_key=KEY_A)
    kv = aioredis.Redis.from_url(valkey_server.url)
    try:
        conv = await client.conversations.create(items=[user("hello")])
        first = await client.responses.create(model="m", input="one", conversation=conv.id)
        (head,) = [k async for k in kv.scan_iter(match=f"ocx:*:conv:{conv.id}")]
        scope = head.decode()[len("ocx:") : head.decode().index(":conv:")]
        items = head + b":items"

        async def state() -> tuple[Any, ...]:
            return await kv.hgetall(head), await kv.lrange(items, 0, -1)

        before = await state()
        blocked: list[bytes] = []

        async def block(response_id: str) -> None:
            key = Keys("ocx:", scope).record(response_id)
            await kv.rpush(key, b"not a record")
            blocked.append(key)

        backend.delay = 0.2  # between events: the record's key is blocked before the end
        body = {"model": "m", "input": "lost", "conversation": conv.id}
        payloads = await sse_turn(http, a.url + "/v1", body, block)
        assert len(blocked) == 1
        assert not any(p["type"] == "response.completed" for p in payloads)
        error = payloads[-1]
        assert error["type"] == "error" and error["code"] == "storage_unavailable"
        assert "Nothing was saved" in error["message"]
        assert "neither the response nor the conversation's new items" in error["message"]
        await kv.delete(blocked[0])
        assert await state() == before  # not appended: not one byte changed
        response_id = blocked[0].rsplit(b"r", 1)[1].decode()
        for replica in (a, b):
            async with http.get(f"{replica.url}/v1/responses/{response_id}", headers=auth()) as r:
                assert r.status == 404
        assert await texts(client, conv.id) == ["hello", "one", first.output_text]
        backend.delay = 0
        await asyncio.sleep(1.1)  # the probe finds the server answering again
        again = await b.client(api_key=KEY_A).responses.create(
            model="m", input="again", conversation=conv.id
        )
        assert await texts(a.client(api_key=KEY_A), conv.id) == [
            "hello", "one", first.output_text, "again", again.output_text
        ]  # fmt: skip
    finally:
        await kv.aclose()


async def test_a_valkey_restart_keeps_every_acknowledged_turn_and_the_version_fence(
    valkey_server: KvServer, make_replicas: MakeReplicas, backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """Turns across three replicas, then Valkey (appendfsync always) is killed with -9
    mid-turn and restarted on its data dir: every acknowledged turn is there, items and
    responses, from every replica. The turn in flight lost its lease with the server's
    memory, so another replica's turn runs meanwhile; the first, fenced by the version it
    read, is refused (409 conversation_changed) and keeps nothing: never both."""
    replicas = await make_replicas(valkey_server.url, 3)
    clients = [replicas[i].client(api_key=KEY_A) for i in range(3)]
    conv = await clients[0].conversations.create(items=[user("hello")])
    expected, ids = ["hello"], []
    for n in range(6):
        response = await clients[n % 3].responses.create(
            model="m", input=f"t{n}", conversation=conv.id
        )
        expected += [f"t{n}", response.output_text]
        ids.append(response.id)
    backend.stall_next(6.0)
    body = {"model": "m", "input": "slow", "conversation": conv.id}
    slow = spawn(post(http, replicas[0].url + "/v1", body, auth()), name="slow")
    await backend.wait_for(lambda: len(backend.responses_seen) == 7)
    valkey_server.kill9()
    await valkey_server.astart()
    fast = await clients[1].responses.create(model="m", input="fast", conversation=conv.id)
    expected += ["fast", fast.output_text]
    ids.append(fast.id)
    status, error, _ = await slow
    assert status == 409 and error["error"]["code"] == "conversation_changed", (status, error)
    for client in clients:
        assert await texts(client, conv.id) == expected
        for response_id in ids:
            assert (await client.responses.retrieve(response_id)).id == response_id
    for client in clients:
        await client.close()


async def test_a_turn_commit_run_twice_is_kept_once(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Server.round_trip may run a write again on a fresh connection (its answer lost):
    TURN recognizes its own earlier run, so the turn is acknowledged, its items appended
    once and its response stored once (no 409 against itself)."""
    a, b = await replicas(make_proxy, backend, valkey_server.url, n=2)
    server = a.proxy.store.server  # type: ignore[attr-defined]
    real = server.round_trip

    async def twice(op: str, packed: bytes, answers: int = 1) -> Any:
        if op == "conversation_turn":
            await real(op, packed, answers)
        return await real(op, packed, answers)

    monkeypatch.setattr(server, "round_trip", twice)
    client = a.client()
    conv = await client.conversations.create(items=[user("hello")])
    first = await client.responses.create(model="m", input="one", conversation=conv.id)
    second = await client.responses.create(model="m", input="two", conversation=conv.id)
    other = b.client()
    assert await texts(other, conv.id) == [
        "hello", "one", first.output_text, "two", second.output_text
    ]  # fmt: skip
    assert (await other.responses.retrieve(second.id)).output_text == second.output_text
    follow = await other.responses.create(model="m", input="x", previous_response_id=second.id)
    assert follow.output_text == "echo#6: x"  # the chain holds the five items once
