"""Proxies on one shared store (in this process, each its own app and port) in front of
the fake backend, driven by the openai SDK and plain HTTP: chains across replicas (JSON,
SSE, the stream helper), stored responses, fail-closed answers, commit failures,
conversations failing closed, metrics and readiness."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from ocxproxy.aio import spawn
from ocxproxy.cli import main
from ocxproxy.config import Config
from ocxproxy.errors import StorageUnavailable
from ocxproxy.http.context import scope_of
from ocxproxy.store.shared.conversations import SharedConversations
from ocxproxy.store.shared.keys import Keys, budget_keys
from ocxproxy.store.shared.server import UNAVAILABLE
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only, sse_payloads
from tests.serve import respond
from tests.shared.conftest import require
from tests.shared.servers import KvServer


async def replicas(
    make_proxy: MakeProxy, backend: FakeBackend, url: str, n: int = 3, **settings: Any
) -> list[ProxyHandle]:
    return [
        await make_proxy(backend.url, shared_store=url, state_dir=None, **settings)
        for _ in range(n)
    ]


async def test_a_chain_alternating_across_replicas_json_sse_and_stream_helper(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer
) -> None:
    proxies = await replicas(make_proxy, backend, kv_server.url)
    previous: str | None = None
    for n in range(9):
        client = proxies[n % 3].client()
        kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
        word = f"turn {n}"
        kwargs["input"] = [{"role": "user", "content": word}]
        if n % 3 == 0:
            response = await client.responses.create(model="m", **kwargs)
        elif n % 3 == 1:
            stream = await client.responses.create(model="m", stream=True, **kwargs)
            events = [event async for event in stream]
            assert events[-1].type == "response.completed"
            response = events[-1].response
        else:
            async with client.responses.stream(model="m", **kwargs) as helper:
                async for _ in helper:
                    pass
                response = await helper.get_final_response()
        assert response.output_text.endswith(word)
        if previous is not None:
            assert response.previous_response_id == previous
        previous = response.id
    seen = backend.responses_seen
    assert len(seen) == 9
    assert_append_only([s.body for s in seen])
    assert len(seen[-1].json["input"]) == 17  # 8 turns of 2 items, and the new one
    commits = sum(p.metric("ocxproxy_shared_commits_total", outcome="ok") for p in proxies)
    assert commits == 9


async def test_stored_responses_from_any_replica(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, http: aiohttp.ClientSession
) -> None:
    a, b, c = await replicas(make_proxy, backend, kv_server.url)
    first = await a.client().responses.create(model="m", input="hello")
    second = await b.client().responses.create(
        model="m", input="again", previous_response_id=first.id
    )
    got = await c.client().responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    items = await c.client().responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in items.data if i.type == "message"][::2] == [
        "hello",
        "again",
    ]
    # Another credential sees nothing, anywhere.
    with pytest.raises(openai.NotFoundError):
        await c.client(api_key="sk-other").responses.input_items.list(second.id)
    deleted = await c.client().responses.delete(second.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    before = len(backend.responses_seen)
    with pytest.raises(openai.BadRequestError) as caught:
        await a.client().responses.create(model="m", input="x", previous_response_id=second.id)
    assert caught.value.code == "previous_response_not_found"
    assert len(backend.responses_seen) == before
    async with http.get(
        f"{b.base_url}/responses/{second.id}/input_items",
        headers={"Authorization": "Bearer sk-test-a"},
    ) as resp:
        assert resp.status == 404


async def test_an_item_reference_resolves_on_another_replica(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer
) -> None:
    a, b, _ = await replicas(make_proxy, backend, kv_server.url)
    first = await a.client().responses.create(model="m", input="remember this")
    item_id = first.output[0].id
    await b.client().responses.create(
        model="m",
        input=[{"type": "item_reference", "id": item_id}, {"role": "user", "content": "and?"}],
    )
    forwarded = backend.responses_seen[-1].json["input"]
    assert forwarded[0]["id"] == item_id
    assert forwarded[0]["content"][0]["text"] == first.output_text


async def test_store_down_is_503_before_the_backend_and_recovers(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, http: aiohttp.ClientSession
) -> None:
    a, b, _ = await replicas(make_proxy, backend, kv_server.url)
    first = await a.client().responses.create(model="m", input="hello")
    kv_server.kill9()
    before = len(backend.responses_seen)
    headers = {"Authorization": "Bearer sk-test-a"}
    body = {"model": "m", "input": "more", "previous_response_id": first.id}
    async with http.post(f"{b.base_url}/responses", json=body, headers=headers) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "storage_unavailable"
    for path in (f"/responses/{first.id}", f"/responses/{first.id}/input_items"):
        async with http.get(b.base_url + path, headers=headers) as resp:
            assert resp.status == 503, path
    async with http.delete(f"{b.base_url}/responses/{first.id}", headers=headers) as resp:
        assert resp.status == 503
    assert len(backend.responses_seen) == before  # nothing forwarded
    # A turn that needs no stored state flows, and is not stored.
    body = {"model": "m", "input": "stateless", "store": False}
    async with http.post(f"{b.base_url}/responses", json=body, headers=headers) as resp:
        assert resp.status == 200
    # A store:true turn is forwarded, but its commit fails: never a success.
    async with http.post(
        f"{b.base_url}/responses", json={"model": "m", "input": "x"}, headers=headers
    ) as resp:
        assert resp.status == 503
    async with http.get(f"{b.url}/readyz") as resp:
        assert resp.status == 503
    assert b.metric("ocxproxy_shared_store_available") == 0
    await kv_server.astart()
    for _ in range(50):
        async with http.get(f"{b.url}/readyz") as resp:
            if resp.status == 200:
                break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("not ready again")
    again = await b.client().responses.create(
        model="m", input="more", previous_response_id=first.id
    )
    assert again.previous_response_id == first.id


async def test_a_failed_commit_is_an_error_event_never_a_completion(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, http: aiohttp.ClientSession
) -> None:
    a, b, _ = await replicas(make_proxy, backend, kv_server.url)
    first = await a.client().responses.create(model="m", input="hello")
    client = aioredis.Redis.from_url(kv_server.url)
    try:
        await client.config_set("maxmemory", "1")  # noeviction: reads work, writes fail
        headers = {"Authorization": "Bearer sk-test-a"}
        body = {"model": "m", "input": "more", "previous_response_id": first.id, "stream": True}
        async with http.post(f"{b.base_url}/responses", json=body, headers=headers) as resp:
            assert resp.status == 200
            payloads = sse_payloads(await resp.read())
        assert payloads[-1]["type"] == "error"
        assert payloads[-1]["code"] == "storage_unavailable"
        assert not any(p["type"] == "response.completed" for p in payloads)
        body["stream"] = False
        async with http.post(f"{b.base_url}/responses", json=body, headers=headers) as resp:
            assert resp.status == 503
        assert b.metric("ocxproxy_shared_commits_total", outcome="unavailable") == 2
    finally:
        await client.config_set("maxmemory", "0")
        await client.aclose()


async def test_conversations_and_idempotency_keys_fail_closed_while_the_store_is_down(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, http: aiohttp.ClientSession
) -> None:
    """They need the shared store: 503 with Retry-After and no backend call, never a
    conversation or key kept in one replica; a store:false keyed turn keeps flowing (its
    key stays in the replica)."""
    (a,) = await replicas(make_proxy, backend, kv_server.url, n=1)
    headers = {"Authorization": "Bearer sk-test-a"}
    async with http.post(f"{a.base_url}/conversations", json={}, headers=headers) as resp:
        conv = (await resp.json())["id"]
    kv_server.kill9()
    keyed = {**headers, "Idempotency-Key": "k1"}
    calls = [
        ("POST", "/conversations", {}, headers),
        ("GET", f"/conversations/{conv}", None, headers),
        ("GET", f"/conversations/{conv}/items", None, headers),
        ("POST", "/responses", {"model": "m", "input": "x", "conversation": conv}, headers),
        ("POST", "/responses", {"model": "m", "input": "x"}, keyed),
    ]
    for method, path, body, sent in calls:
        async with http.request(method, a.base_url + path, json=body, headers=sent) as resp:
            assert resp.status == 503, (method, path)
            assert resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "storage_unavailable"
    assert backend.responses_seen == []
    body = {"model": "m", "input": "x", "store": False}
    async with http.post(f"{a.base_url}/responses", json=body, headers=keyed) as resp:
        assert resp.status == 200
    async with http.post(f"{a.base_url}/responses", json=body, headers=keyed) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "true"
    assert len(backend.responses_seen) == 1
    await kv_server.astart()
    async with http.get(f"{a.base_url}/conversations/{conv}", headers=headers) as resp:
        assert resp.status == 200


def test_zdr_refuses_a_shared_store() -> None:
    with pytest.raises(ValueError, match="zdr"):
        Config(zdr=True, shared_store="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="redis://"):
        Config(shared_store="http://127.0.0.1:6379/0")


async def test_websocket_turns_reach_other_replicas_and_store_false_stays_on_the_socket(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, http: aiohttp.ClientSession
) -> None:
    a, b, _ = await replicas(make_proxy, backend, kv_server.url)
    headers = {"Authorization": "Bearer sk-test-a"}
    async with http.ws_connect(a.base_url + "/responses", headers=headers) as ws:

        async def turn(**fields: Any) -> dict[str, Any]:
            await ws.send_str(orjson.dumps({"type": "response.create", **fields}).decode())
            while True:
                event = orjson.loads((await ws.receive()).data)
                if event["type"] in ("response.completed", "error"):
                    return event

        stored = await turn(model="m", input="MARKER-kept", store=True)
        assert stored["type"] == "response.completed"
        local = await turn(model="m", input="MARKER-local", store=False)
        follow = await turn(
            model="m", input="on", store=False, previous_response_id=local["response"]["id"]
        )
        assert follow["type"] == "response.completed"  # the connection's own chain
    again = await b.client().responses.create(
        model="m", input="more", previous_response_id=stored["response"]["id"]
    )
    assert again.previous_response_id == stored["response"]["id"]
    with pytest.raises(openai.BadRequestError):
        await b.client().responses.create(
            model="m", input="x", previous_response_id=local["response"]["id"]
        )
    client = aioredis.Redis.from_url(kv_server.url)
    try:
        values = [await client.dump(k) or b"" async for k in client.scan_iter(match="*")]
    finally:
        await client.aclose()
    blob = b"".join(values)
    assert b"MARKER-local" not in blob
    assert values  # (segments are zstd: MARKER-kept may be compressed; the AOF scan is harness's)


def test_serve_refuses_a_server_that_cannot_keep_ack_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require("valkey")
    with KvServer("valkey", tmp_path / "kv", appendfsync="everysec") as server:
        code = main(
            [
                "serve",
                "--shared-store",
                server.url,
                "--upstream",
                "http://127.0.0.1:9",
                "--port",
                "0",
                "--state-dir",
                str(tmp_path / "state"),
            ]
        )
    assert code == 2
    err = capsys.readouterr().err
    assert "appendfsync always" in err and "--durability relaxed" in err
    code = main(["serve", "--shared-store", "redis://h:1/0", "--zdr"])
    assert code == 2
    assert "--zdr" in capsys.readouterr().err


async def test_a_chain_keeps_its_backend_from_any_replica(
    make_proxy: MakeProxy, kv_server: KvServer
) -> None:
    async with FakeBackend() as one, FakeBackend() as two:
        proxies = [
            await make_proxy(one.url, two.url, shared_store=kv_server.url, state_dir=None)
            for _ in range(3)
        ]
        for chain in range(4):
            previous: str | None = None
            for n in range(6):
                kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
                text = f"chain {chain} turn {n}"
                client = proxies[(chain + n) % 3].client()
                previous = (await client.responses.create(model="m", input=text, **kwargs)).id
        for chain in range(4):
            marker = f"chain {chain} turn 0".encode()
            seen = {b.url: sum(marker in s.body for s in b.responses_seen) for b in (one, two)}
            assert sorted(seen.values()) == [0, 6], seen  # all six turns on one backend
        assert len(one.responses_seen) + len(two.responses_seen) == 24


async def test_a_turn_whose_record_cannot_be_written_leaves_its_idempotency_key_open(
    make_proxy: MakeProxy, backend: FakeBackend, kv_server: KvServer, http: aiohttp.ClientSession
) -> None:
    """The record is refused after the backend answered (its key is made a list meanwhile:
    COMMIT's read of it is WRONGTYPE). The key is written after the record, never before:
    a retry with it runs the turn again rather than replaying a response that was never
    stored."""
    a, b, _ = await replicas(make_proxy, backend, kv_server.url)
    headers = {"Authorization": "Bearer sk-test-a", "Idempotency-Key": "turn-1"}
    keys = Keys("ocx:", scope_of(headers))
    client = aioredis.Redis.from_url(kv_server.url)
    body = {"model": "m", "input": "hello", "stream": True}
    blocked: list[bytes] = []
    try:
        backend.delay = 0.2  # between events: the record's key is blocked before the end
        async with http.post(f"{a.base_url}/responses", json=body, headers=headers) as resp:
            async for line in resp.content:
                if line.startswith(b"data: "):
                    event = orjson.loads(line[6:])
                    if event["type"] == "response.created":
                        blocked.append(keys.record(event["response"]["id"]))
                        await client.rpush(blocked[0], b"not a record")
        assert event["type"] == "error" and event["code"] == "storage_unavailable"
        await client.delete(blocked[0])
        backend.delay = 0
        await asyncio.sleep(1.1)  # the probe finds the server answering again
        async with http.post(f"{b.base_url}/responses", json=body, headers=headers) as resp:
            completed = sse_payloads(await resp.read())[-1]  # the same request, retried
        assert completed["type"] == "response.completed"
        again = completed["response"]["id"]
        assert keys.record(again) != blocked[0]  # run again, not the lost one replayed
        async with http.get(f"{a.base_url}/responses/{again}", headers=headers) as resp:
            assert resp.status == 200
    finally:
        backend.delay = 0
        await client.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_turn_whose_chain_is_evicted_while_it_runs_is_kept_as_on_one_node(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    kv_server: KvServer,
    http: aiohttp.ClientSession,
    stream: bool,
) -> None:
    """A turn in flight on a chain the byte budget evicts meanwhile is acknowledged (its
    answer is valid, a stream's is out already), and continuing it answers 400
    previous_response_not_found, on every replica: what the local store answers, not a
    503 blaming a full disk."""
    a, b = await replicas(make_proxy, backend, kv_server.url, n=2, shared_max_bytes=1)
    first = await a.client().responses.create(model="m", input="first")
    backend.stall_next(0.5)
    body = {"model": "m", "input": "late", "previous_response_id": first.id, "stream": stream}
    late = spawn(respond(http, a.url, body, {"Authorization": "Bearer sk-test-a"}), name="late")
    await asyncio.sleep(0.2)
    await b.client().responses.create(model="m", input="other")  # evicts first's chain
    with pytest.raises(openai.BadRequestError) as gone:
        await b.client().responses.create(model="m", input="x", previous_response_id=first.id)
    assert gone.value.code == "previous_response_not_found"
    status, error, response = await late
    assert status == 200 and error is None and response is not None, error
    assert response["output"][0]["content"][0]["text"].endswith("late")
    for proxy in (a, b):
        with pytest.raises(openai.BadRequestError) as gone:
            await proxy.client().responses.create(
                model="m", input="next", previous_response_id=response["id"]
            )
        assert gone.value.code == "previous_response_not_found"
        # Its Response is stored, so GET answers it; its input items went with the chain.
        kept = await proxy.client().responses.retrieve(response["id"])
        assert kept.model_dump(exclude_unset=True) == response
        with pytest.raises(openai.NotFoundError) as gone_input:
            await proxy.client().responses.input_items.list(response["id"])
        assert "input items" in gone_input.value.message
    assert a.metric("ocxproxy_shared_commits_total", outcome="missing") == 0
    assert a.metric("ocxproxy_shared_commits_total", outcome="ok") == 2
    assert a.metric("ocxproxy_turns_not_recorded_total", reason="storage_unavailable") == 0
    assert b.metric("ocxproxy_store_evictions_total", reason="shared_bytes") >= 1
    # Its record counts in the byte budget as a chain of its own, until that is evicted.
    kv = aioredis.Redis.from_url(kv_server.url)
    chains, per_chain, total = budget_keys("ocx:")
    try:
        assert await kv.zcard(chains) == 2  # "other"'s and its own
        await b.client().responses.create(model="m", input="again")  # evicts both
        assert await kv.zcard(chains) == 1
        counts = [int(n) for n in await kv.hvals(per_chain)]
        assert len(counts) == 1 and counts[0] == int(await kv.get(total))
    finally:
        await kv.aclose()


async def test_an_idempotency_key_the_store_cannot_complete_says_so(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    kv_server: KvServer,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server goes away between a turn's commit and its Idempotency-Key's: the answer
    says the response was stored and the key not (a retry runs the turn again), not that
    nothing was forwarded or stored."""
    (a,) = await replicas(make_proxy, backend, kv_server.url, n=1)

    async def down(*args: Any, **kwargs: Any) -> None:
        raise StorageUnavailable(UNAVAILABLE)

    monkeypatch.setattr(SharedConversations, "idempotency_done", down)
    headers = {"Authorization": "Bearer sk-test-a", "Idempotency-Key": "k-down"}
    body = {"model": "m", "input": "x"}
    async with http.post(f"{a.base_url}/responses", json=body, headers=headers) as resp:
        assert resp.status == 503
        error = (await resp.json())["error"]
    assert error["code"] == "storage_unavailable"
    assert "Idempotency-Key" in error["message"] and "nothing" not in error["message"].lower()
    assert len(backend.responses_seen) == 1
    assert a.metric("ocxproxy_shared_commits_total", outcome="ok") == 1
    monkeypatch.undo()
    async with http.post(f"{a.base_url}/responses", json=body, headers=headers) as resp:
        assert resp.status == 200 and "Idempotent-Replayed" not in resp.headers
    assert len(backend.responses_seen) == 2  # run again, as the answer said
