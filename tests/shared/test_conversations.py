"""Conversations, their lock and Idempotency-Keys across replicas on one shared store: the
openai SDK (and plain HTTP) against proxies in this process and real `serve` replicas
(tests/shared/replicas.py), on a real Valkey / redis-server. A conversation's items are in
the order of appends whichever replica wrote them; two turns on one conversation never
run at once; a lease held by a replica killed mid-turn lapses; a turn whose lease lapsed
while the conversation changed is a 409 that keeps nothing; a completed Idempotency-Key is
replayed by every replica (docs/BEHAVIOR.md, "Conversations, locking, idempotency")."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from ocxproxy.aio import spawn
from ocxproxy.model import Segment
from ocxproxy.store import shared_store
from ocxproxy.store.shared import conversations
from ocxproxy.store.shared.conversations import encode_entry
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only, sse_payloads
from tests.shared.conftest import MakeReplicas
from tests.shared.servers import KvServer
from tests.shared.test_replicas import KEY_A, KEY_B, auth

Json = dict[str, Any]


def user(text: str) -> Any:  # (the SDK types each list of items its own way)
    return {"type": "message", "role": "user", "content": text}


async def replicas(
    make_proxy: MakeProxy, backend: FakeBackend, url: str, n: int = 3, **kw: Any
) -> list[ProxyHandle]:
    return [await make_proxy(backend.url, shared_store=url, state_dir=None, **kw) for _ in range(n)]


async def texts(client: openai.AsyncOpenAI, conversation_id: str) -> list[str]:
    """The conversation's items as their text, oldest first (user input or output text)."""
    page = await client.conversations.items.list(conversation_id, order="asc", limit=100)
    out = []
    for item in page.data:
        content = item.model_dump()["content"]
        out.append(content if isinstance(content, str) else content[0]["text"])
    return out


async def post(
    http: aiohttp.ClientSession, url: str, body: Json, headers: dict[str, str]
) -> tuple[int, Json, dict[str, str]]:
    async with http.post(url + "/responses", json=body, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read()), dict(resp.headers)


async def test_a_conversation_across_three_replicas_keeps_its_items_in_append_order(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer
) -> None:
    proxies = await replicas(make_proxy, backend, kv_server.url)
    clients = [p.client() for p in proxies]
    conv = await clients[0].conversations.create(items=[user("hello")], metadata={"k": "v"})
    expected = ["hello"]
    for n in range(6):
        client = clients[n % 3]
        word = f"turn {n}"
        if n % 2:
            stream = await client.responses.create(
                model="m", input=word, conversation=conv.id, stream=True
            )
            events = [event async for event in stream]
            assert events[-1].type == "response.completed"
            response = events[-1].response
        else:
            response = await client.responses.create(model="m", input=word, conversation=conv.id)
        assert response.conversation is not None and response.conversation.id == conv.id
        expected += [word, response.output_text]
        # at once, from the next replica: the turn is there, in order
        assert await texts(clients[(n + 1) % 3], conv.id) == expected
    seen = backend.responses_seen
    assert_append_only([s.body for s in seen])
    assert len(seen[-1].json["input"]) == len(expected) - 1
    # a turn's response is stored too: retrievable and continuable from another replica
    follow = await clients[1].responses.create(
        model="m", input="after", previous_response_id=response.id
    )
    before, after = seen[-1].body, backend.responses_seen[-1].body
    tail = after[after.index(b'"input":[') :]
    assert tail.startswith(before[before.index(b'"input":[') : -2])  # byte-stable history
    assert len(backend.responses_seen[-1].json["input"]) == len(expected) + 1
    assert (await clients[2].responses.retrieve(follow.id)).output_text == follow.output_text
    assert (await clients[0].responses.retrieve(response.id)).output_text == expected[-1]

    # the routes, each from another replica
    got = await clients[1].conversations.retrieve(conv.id)
    assert got.metadata == {"k": "v"}
    await clients[2].conversations.update(conv.id, metadata={"k": "w"})
    assert (await clients[0].conversations.retrieve(conv.id)).metadata == {"k": "w"}
    added = await clients[0].conversations.items.create(conv.id, items=[user("x"), user("y")])
    expected += ["x", "y"]
    assert await texts(clients[1], conv.id) == expected
    first = (await clients[2].conversations.items.list(conv.id, order="asc")).data[0]
    await clients[1].conversations.items.delete(first.id, conversation_id=conv.id)
    await clients[0].conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    expected = [t for t in expected if t not in ("hello", "x")]
    assert await texts(clients[2], conv.id) == expected
    turn = await clients[2].responses.create(model="m", input="last", conversation=conv.id)
    assert len(backend.responses_seen[-1].json["input"]) == len(expected) + 1
    assert await texts(clients[0], conv.id) == [*expected, "last", turn.output_text]
    # another credential's replica does not know it
    other = proxies[1].client(api_key="sk-other")
    with pytest.raises(openai.NotFoundError):
        await other.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.create(model="m", input="x", conversation=conv.id)
    await clients[1].conversations.delete(conv.id)
    for client in clients:
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(conv.id)


async def test_two_turns_on_one_conversation_on_two_replicas_never_run_at_once(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer
) -> None:
    """Turns from three replicas at once, each retried while the conversation is locked
    (400 conversation_locked, as on one replica): the backend saw one at a time, each with
    every earlier turn's items before its own."""
    backend.delay = 0.05
    proxies = await replicas(make_proxy, backend, valkey_server.url)
    clients = [p.client() for p in proxies]
    conv = await clients[0].conversations.create()
    locked = 0

    async def run(n: int) -> str:
        nonlocal locked
        while True:
            try:
                await clients[n % 3].responses.create(
                    model="m", input=f"w{n}", conversation=conv.id
                )
                return f"w{n}"
            except openai.BadRequestError as exc:
                assert exc.code == "conversation_locked"
                locked += 1
                await asyncio.sleep(0.01)

    words = await asyncio.gather(*(run(n) for n in range(6)))
    assert locked > 0  # they did collide
    seen = [s.json["input"] for s in backend.responses_seen]
    assert [len(items) for items in seen] == [1, 3, 5, 7, 9, 11]  # one at a time
    assert_append_only([s.body for s in backend.responses_seen])
    items = await texts(clients[1], conv.id)
    assert sorted(items[::2]) == sorted(words)
    order = [i["content"] for i in seen[-1] if i.get("role") == "user"]
    assert items[::2] == order  # the conversation's order is the order the turns ran


async def test_a_streaming_turn_keeps_its_lease_past_its_ttl_while_the_backend_progresses(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer
) -> None:
    """The lease's TTL on the server is --read-timeout here (2 s); a stream that takes
    longer but is never silent that long keeps it: the other replica is still locked out."""
    a, b = await replicas(make_proxy, backend, valkey_server.url, n=2, read_timeout=2.0)
    conv = await a.client().conversations.create()
    backend.delay = 0.5  # between events: the stream takes ~5 s
    stream = await a.client().responses.create(
        model="m", input="long", conversation=conv.id, stream=True
    )
    events = spawn(_drain(stream), name="stream")
    await asyncio.sleep(3.0)
    assert not events.done()
    with pytest.raises(openai.BadRequestError) as caught:
        await b.client().responses.create(model="m", input="cut in", conversation=conv.id)
    assert caught.value.code == "conversation_locked"
    assert (await events)[-1] == "response.completed"
    backend.delay = 0
    late = await b.client().responses.create(model="m", input="after", conversation=conv.id)
    assert (await texts(a.client(), conv.id))[2:] == ["after", late.output_text]
    assert len(backend.responses_seen) == 2


async def _drain(stream: Any) -> list[str]:
    return [event.type async for event in stream]


async def test_a_turn_whose_lease_lapsed_while_the_conversation_changed_is_a_409(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer
) -> None:
    a, b = await replicas(make_proxy, backend, valkey_server.url, n=2, read_timeout=1.0)
    ca, cb = a.client(), b.client()
    conv = await ca.conversations.create()
    backend.drip_next(0.75, parts=3)  # 1.5 s in all, never silent for a read timeout
    turn = spawn(ca.responses.create(model="m", input="slow", conversation=conv.id), name="t")
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    with pytest.raises(openai.BadRequestError) as caught:  # while the lease holds
        await cb.conversations.items.create(conv.id, items=[user("too soon")])
    assert caught.value.code == "conversation_locked"
    await asyncio.sleep(1.1)  # the turn's lease has run out
    await cb.conversations.items.create(conv.id, items=[user("meanwhile")])
    with pytest.raises(openai.ConflictError) as changed:
        await turn
    assert changed.value.code == "conversation_changed"
    assert await texts(ca, conv.id) == ["meanwhile"]
    assert a.metric("ocxproxy_turns_not_recorded_total", reason="conversation_changed") == 1
    again = await cb.responses.create(model="m", input="again", conversation=conv.id)
    assert await texts(ca, conv.id) == ["meanwhile", "again", again.output_text]


async def test_a_store_failure_on_a_conversation_is_a_503_never_a_200(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """The server dies while a turn runs: its append fails, and the client is told so
    (SSE: an error event in place of response.completed; JSON: 503); nothing is kept."""
    (a,) = await replicas(make_proxy, backend, valkey_server.url, n=1, read_timeout=1.0)
    client = a.client(api_key=KEY_A)
    conv = await client.conversations.create(items=[user("hello")])
    for n, stream in enumerate((True, False)):
        backend.stall_next(0.5)
        body = {"model": "m", "input": "lost", "conversation": conv.id, "stream": stream}

        async def send(body: Json = body) -> tuple[int, bytes]:
            async with http.post(f"{a.base_url}/responses", json=body, headers=auth()) as resp:
                return resp.status, await resp.read()

        answer = spawn(send(), name="turn")
        await backend.wait_for(lambda n=n: len(backend.responses_seen) == n + 1)  # type: ignore[misc]
        valkey_server.kill9()
        status, data = await answer
        if stream:
            payloads = sse_payloads(data)
            assert payloads[-1]["type"] == "error"
            assert payloads[-1]["code"] == "storage_unavailable"
            assert not any(p["type"] == "response.completed" for p in payloads)
        else:
            assert status == 503
            assert orjson.loads(data)["error"]["code"] == "storage_unavailable"
        await valkey_server.astart()
        await asyncio.sleep(1.1)  # its lease's release failed too: it lapses
    assert a.metric("ocxproxy_turns_not_recorded_total", reason="conversation_failed") == 2
    assert await texts(client, conv.id) == ["hello"]
    then = await client.responses.create(model="m", input="then", conversation=conv.id)
    assert await texts(client, conv.id) == ["hello", "then", then.output_text]


async def test_an_append_the_server_refuses_is_a_503_and_keeps_nothing(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """Only the append fails (its list is made a string meanwhile, so RPUSH is WRONGTYPE):
    the turn is not acknowledged, and neither its response nor its key is kept."""
    (a,) = await replicas(make_proxy, backend, valkey_server.url, n=1)
    client = a.client(api_key=KEY_A)
    conv = await client.conversations.create(items=[user("hello")])
    kv = aioredis.Redis.from_url(valkey_server.url)
    try:
        (items,) = [k async for k in kv.scan_iter(match=f"ocx:*:conv:{conv.id}:items")]
        saved = await kv.lrange(items, 0, -1)
        for n, stream in enumerate((False, True)):
            backend.stall_next(1.0)  # (a loaded box: the list is changed long before)
            keyed = {**auth(), "Idempotency-Key": f"refused-{n}"}
            body = {"model": "m", "input": "lost", "conversation": conv.id, "stream": stream}
            seen = len(backend.responses_seen)
            turn = spawn(post_raw(http, a.base_url, body, keyed), name="turn")
            await backend.wait_for(lambda seen=seen: len(backend.responses_seen) > seen)  # type: ignore[misc]
            await kv.set(items, b"not a list")  # (SET replaces the list at once)
            status, data = await turn
            if stream:
                assert sse_payloads(data)[-1]["code"] == "storage_unavailable"
            else:
                assert status == 503
            await kv.delete(items)
            await kv.rpush(items, *saved)
            await asyncio.sleep(1.1)  # the probe finds the server answering again
            status, _, _ = await post(http, a.base_url, {**body, "stream": False}, keyed)
            assert status == 200  # the key was not kept: the retry runs
            await client.conversations.items.delete(
                (await client.conversations.items.list(conv.id)).data[0].id,
                conversation_id=conv.id,
            )
            await client.conversations.items.delete(
                (await client.conversations.items.list(conv.id)).data[0].id,
                conversation_id=conv.id,
            )
    finally:
        await kv.aclose()
    assert await texts(client, conv.id) == ["hello"]
    assert a.metric("ocxproxy_turns_not_recorded_total", reason="conversation_failed") == 2


async def post_raw(
    http: aiohttp.ClientSession, url: str, body: Json, headers: dict[str, str]
) -> tuple[int, bytes]:
    async with http.post(url + "/responses", json=body, headers=headers) as resp:
        return resp.status, await resp.read()


async def test_an_idempotency_key_is_answered_alike_by_every_replica(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    a, b, c = await replicas(make_proxy, backend, kv_server.url)
    keyed = {**auth(), "Idempotency-Key": "key-1"}
    body = {"model": "m", "input": "once"}
    backend.stall_next(1.0)
    first = spawn(post(http, a.base_url, body, keyed), name="first")
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    status, error, _ = await post(http, b.base_url, body, keyed)  # in flight on a
    assert status == 409 and error["error"]["param"] == "Idempotency-Key"
    status, error, _ = await post(http, c.base_url, {**body, "input": "other"}, keyed)
    assert status == 422
    status, answer, _ = await first
    assert status == 200
    for replica in (b, c):
        status, again, headers = await post(http, replica.base_url, body, keyed)
        assert status == 200 and again == answer
        assert headers.get("Idempotent-Replayed") == "true"
    streamed = {**body, "stream": True}
    sse_keyed = {**keyed, "Idempotency-Key": "key-2"}
    replies = []
    for replica in (a, c):
        async with http.post(
            f"{replica.base_url}/responses", json=streamed, headers=sse_keyed
        ) as resp:
            replies.append(sse_payloads(await resp.read())[-1])
    assert [r["type"] for r in replies] == ["response.completed"] * 2
    assert replies[0]["response"] == replies[1]["response"]
    status, _, _ = await post(http, b.base_url, {**body, "input": "other"}, keyed)
    assert status == 422
    # per credential: another's same key runs
    status, theirs, _ = await post(
        http, b.base_url, body, {**auth(KEY_B), "Idempotency-Key": "key-1"}
    )
    assert status == 200 and theirs["id"] != answer["id"]
    assert len(backend.responses_seen) == 3


async def test_a_key_stays_in_flight_while_its_request_runs_past_the_ttl(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """The in-flight key's TTL is --read-timeout, renewed while the request runs: a retry
    on another replica after that TTL, while the first still runs, is still a 409."""
    a, b = await replicas(make_proxy, backend, valkey_server.url, n=2, read_timeout=1.0)
    keyed = {**auth(), "Idempotency-Key": "slow"}
    body = {"model": "m", "input": "slow"}
    # 2.4-3 s in all, never silent for a read timeout: the retry below, 1.3 s in, must
    # reach b while the first still runs even when a loaded box slows it by a second
    backend.drip_next(0.6, parts=5)
    first = spawn(post(http, a.base_url, body, keyed), name="first")
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    await asyncio.sleep(1.3)
    status, _, _ = await post(http, b.base_url, body, keyed)
    assert status == 409
    status, answer, _ = await first
    assert status == 200
    status, again, _ = await post(http, b.base_url, body, keyed)
    assert status == 200 and again == answer
    assert len(backend.responses_seen) == 1


async def test_a_killed_replica_leaves_no_lock_and_no_key_in_flight_for_ever(
    valkey_server: KvServer, make_replicas: MakeReplicas, backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """A replica kill -9'd mid-turn (--read-timeout 600): its conversation's lease and its
    in-flight key lapse within the heartbeat (10 s), and the retry runs on another replica."""
    replicas = await make_replicas(valkey_server.url, 2)
    a, b = replicas[0], replicas[1]
    client = b.client(api_key=KEY_A)
    conv = await client.conversations.create(items=[user("hello")])
    backend.stall_next(60)
    keyed = {**auth(), "Idempotency-Key": "killed"}
    body = {"model": "m", "input": "lost", "conversation": conv.id}
    doomed = spawn(post(http, a.url + "/v1", body, keyed), name="doomed")
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    await asyncio.sleep(4)  # a's heartbeat has renewed the lease and the key by now
    await replicas.kill9(0)
    killed = time.monotonic()
    with pytest.raises(aiohttp.ClientError):
        await doomed
    with pytest.raises(openai.BadRequestError) as caught:  # still a's lease
        await client.responses.create(model="m", input="next", conversation=conv.id)
    assert caught.value.code == "conversation_locked"
    statuses = []
    while True:
        status, answer, _ = await post(http, b.url + "/v1", body, keyed)
        statuses.append(status)
        if status == 200 or time.monotonic() - killed > 15:
            break
        await asyncio.sleep(0.25)
    assert statuses[0] == 409 and statuses[-1] == 200, statuses  # a's key, then it lapsed
    assert time.monotonic() - killed < 12
    texts_now = await texts(client, conv.id)
    assert texts_now == ["hello", "lost", answer["output"][0]["content"][0]["text"]]
    await client.close()


async def test_a_conversation_round_robin_over_three_serve_replicas(
    kv_server: KvServer, make_replicas: MakeReplicas, backend: FakeBackend
) -> None:
    """The black box: three `ocxproxy serve` processes, the openai SDK round robin."""
    replicas = await make_replicas(kv_server.url)
    clients: list[openai.AsyncOpenAI] = []

    def next_client() -> openai.AsyncOpenAI:
        clients.append(replicas.next().client(api_key=KEY_A))
        return clients[-1]

    try:
        conv = await next_client().conversations.create(items=[user("hi")])
        expected = ["hi"]
        for n in range(6):
            response = await next_client().responses.create(
                model="m", input=f"t{n}", conversation=conv.id
            )
            expected += [f"t{n}", response.output_text]
            assert response.output_text == f"echo#{len(expected) - 1}: t{n}"
            assert await texts(next_client(), conv.id) == expected
        assert_append_only([s.body for s in backend.responses_seen])
    finally:
        for client in clients:
            await client.close()


async def test_a_replica_reads_only_the_entries_appended_since_its_last_read(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A turn's load sends the entries this replica has not read (the previous turn's
    append), not the whole conversation; a deleted item (a rewrite) sends it all again."""
    a, b = await replicas(make_proxy, backend, valkey_server.url, n=2)
    decoded = 0
    decode = conversations.decode_entry

    def counting(value: bytes) -> Any:
        nonlocal decoded
        decoded += 1
        return decode(value)

    monkeypatch.setattr(conversations, "decode_entry", counting)
    client = a.client()
    conv = await client.conversations.create(items=[user("hello")])
    for n in range(8):
        await client.responses.create(model="m", input=f"t{n}", conversation=conv.id)
    assert decoded == 8  # the first load reads "hello", each later one the turn before
    first = (await b.client().conversations.items.list(conv.id, order="asc")).data[0]
    await b.client().conversations.items.delete(first.id, conversation_id=conv.id)
    decoded = 0
    assert len(await texts(client, conv.id)) == 16
    assert decoded == 8  # rewritten since: every entry again


async def test_websocket_turns_on_a_shared_conversation(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    """Over WebSocket on one replica: a store:true turn is appended (listed by the other
    at once), a store:false one reads the conversation but is not appended, and the
    lock is let go after each (the other replica's turn runs)."""
    a, b = await replicas(make_proxy, backend, valkey_server.url, n=2)
    client_b = b.client(api_key=KEY_A)
    conv = await client_b.conversations.create(items=[user("hello")])
    async with http.ws_connect(a.base_url + "/responses", headers=auth()) as ws:

        async def turn(**fields: Any) -> Json:
            await ws.send_str(orjson.dumps({"type": "response.create", **fields}).decode())
            while True:
                event: Json = orjson.loads((await ws.receive()).data)
                if event["type"] in ("response.completed", "error"):
                    return event

        kept = await turn(model="m", input="kept", conversation=conv.id)
        assert kept["type"] == "response.completed"
        assert kept["response"]["conversation"] == {"id": conv.id}
        assert await texts(client_b, conv.id) == ["hello", "kept", output_of(kept)]
        unstored = await turn(model="m", input="unstored", conversation=conv.id, store=False)
        assert output_of(unstored) == "echo#4: unstored"  # it did read the conversation
        after = await client_b.responses.create(model="m", input="b", conversation=conv.id)
    assert await texts(client_b, conv.id) == [
        "hello", "kept", output_of(kept), "b", after.output_text
    ]  # fmt: skip


def output_of(event: Json) -> str:
    return str(event["response"]["output"][0]["content"][0]["text"])


async def test_every_script_recognizes_its_own_earlier_run(
    valkey_server: KvServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Server.round_trip runs an operation again on a fresh connection after a connection
    error, when the first run may have happened: here every one runs twice, and each
    answers as if it ran once (no 409 for the writer's own append, no lock or key held
    against itself, the item appended once)."""
    store = shared_store(valkey_server.url, max_resident_bytes=1 << 20, max_entries=100, ttl=60)
    await store.start()
    try:
        real = store.server.round_trip

        async def twice(op: str, packed: bytes, answers: int = 1) -> Any:
            await real(op, packed, answers)
            return await real(op, packed, answers)

        monkeypatch.setattr(store.server, "round_trip", twice)
        shared = store.on_server
        head = b'{"created_at": 1, "metadata": {}, "backend": null}'
        record = await shared.create("scope", "conv_1", head, None)
        token, lease = "token-1", shared.lease_key("scope", "conv_1")
        assert await shared.hold(lease, token, 5.0)
        entry = encode_entry(
            Segment(b'{"role":"user","content":"x"}', 1, frozenset(), durable=True), ["msg_1"]
        )
        version = await shared.write(record, "append", entry, head=head, lease=token)
        assert version == 2
        loaded = await shared.load("scope", "conv_1")
        assert loaded is not None and loaded.ids == [["msg_1"]]
        assert await shared.hold(lease, "token-2", 5.0)  # released with it
        assert await shared.write(loaded, "delete") == -1
        assert await shared.load("scope", "conv_1") is None
        state, _ = await shared.idempotency_begin("scope", "idem_1", "fp:marker", 5.0)
        assert state == 0
    finally:
        await store.close()


async def test_the_lock_is_free_when_the_answer_arrives(
    make_proxy: MakeProxy, backend: FakeBackend, valkey_server: KvServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """With a slow release (0.3 s), the next write or turn on another replica, sent the
    moment the previous answer arrived, still finds the conversation free: a route's
    write and a turn that appends nothing (store:false) release before they answer."""
    drop = conversations.SharedConversations.drop

    async def slow(self: Any, *args: Any) -> None:
        await asyncio.sleep(0.3)
        await drop(self, *args)

    monkeypatch.setattr(conversations.SharedConversations, "drop", slow)
    a, b = await replicas(make_proxy, backend, valkey_server.url, n=2)
    ca, cb = a.client(), b.client()
    conv = await ca.conversations.create()
    await ca.conversations.items.create(conv.id, items=[user("one")])
    await cb.conversations.items.create(conv.id, items=[user("two")])
    await ca.conversations.update(conv.id, metadata={"k": "v"})
    await cb.responses.create(model="m", input="unstored", conversation=conv.id, store=False)
    await ca.responses.create(model="m", input="kept", conversation=conv.id)
    assert (await texts(cb, conv.id))[:3] == ["one", "two", "kept"]
