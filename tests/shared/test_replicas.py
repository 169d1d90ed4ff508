"""Three `ocxproxy serve` replicas on one real Valkey / redis-server (black box: the real CLI
as child processes, the fake backend, real clients): a chain continues on whichever replica
a turn lands, byte-stable (CONTRACT.md C1.2); the stored-response routes answer from any
replica; a credential never sees another's turns (CONTRACT.md C5); siblings off one parent fork."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Literal

import aiohttp
import orjson
import pytest
import redis.asyncio as redis
from prometheus_client.parser import text_string_to_metric_families

from ocxproxy.store.shared.keys import budget_keys, compaction_key_name
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only
from tests.serve import Serve, output_text, respond
from tests.shared.conftest import MakeReplicas
from tests.shared.servers import KvServer

Mode = Literal["json", "sse", "sdk_stream"]
KEY_A, KEY_B = "sk-shared-a", "sk-shared-b"


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def turn(
    http: aiohttp.ClientSession,
    serve: Serve,
    text: str,
    prev: str | None = None,
    mode: Mode = "json",
    key: str = KEY_A,
    **body: Any,
) -> tuple[str, str]:
    """One acknowledged turn on `serve`: (response id, output text); fails the test on an error."""
    payload: dict[str, Any] = {"model": "m", "input": [{"role": "user", "content": text}], **body}
    if prev is not None:
        payload["previous_response_id"] = prev
    if mode == "sdk_stream":
        client = serve.client(api_key=key)
        try:
            async with client.responses.stream(**payload) as events:
                final = await events.get_final_response()
        finally:
            await client.close()
        return final.id, final.output_text
    payload["stream"] = mode == "sse"
    status, error, response = await respond(http, serve.url, payload, auth(key))
    assert status == 200 and error is None and response is not None, (status, error)
    return response["id"], output_text(response)


async def error_of(
    http: aiohttp.ClientSession, serve: Serve, method: str, path: str, key: str = KEY_A, **kw: Any
) -> tuple[int, dict[str, Any]]:
    async with http.request(method, serve.url + path, headers=auth(key), **kw) as r:
        return r.status, orjson.loads(await r.read()).get("error") or {}


async def samples(http: aiohttp.ClientSession, serve: Serve) -> Counter[tuple[str, str]]:
    """The replica's metrics: (sample name, its one label value or "") → value."""
    async with http.get(serve.url + "/metrics") as r:
        text = await r.text()
    out: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, next(iter(sample.labels.values()), "")] += sample.value
    return out


@pytest.mark.parametrize("mode", ["json", "sse", "sdk_stream"])
async def test_ten_turns_alternate_over_three_replicas(
    kv_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    mode: Mode,
) -> None:
    replicas = await make_replicas(kv_server.url)
    prev: str | None = None
    for i in range(10):
        prev, text = await turn(http, replicas[i % 3], f"turn {i}", prev, mode)
        # the backend saw the whole history: i earlier user turns, i answers, this one
        assert text == f"echo#{2 * i + 1}: turn {i}"
    bodies = [seen.body for seen in backend.responses_seen]
    assert len(bodies) == 10
    assert_append_only(bodies)  # each body a byte prefix of the next: the prefix cache hits
    last = orjson.loads(bodies[-1])["input"]
    assert [m["content"] for m in last if m.get("role") == "user"] == [
        f"turn {i}" for i in range(10)
    ]
    # What the replicas counted: ten commits, nine begins, and each replica fetched each
    # segment at most once (segments never change: a cached one is never fetched again).
    total: Counter[tuple[str, str]] = Counter()
    for serve in replicas.slots:
        total.update(await samples(http, serve))
    assert total["ocxproxy_shared_commits_total", "ok"] == 10
    assert total["ocxproxy_shared_store_seconds_count", "commit"] == 10
    assert total["ocxproxy_shared_store_seconds_count", "begin"] == 9
    hits = total["ocxproxy_shared_segment_cache_total", "hit"]
    misses = total["ocxproxy_shared_segment_cache_total", "miss"]
    assert hits > 0 and 0 < misses <= 3 * 10, (hits, misses)


async def test_get_delete_input_items_and_item_references_from_any_replica(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    a, b, c = (await make_replicas(valkey_server.url)).slots
    r1, _ = await turn(http, a, "one")
    r2, text2 = await turn(http, b, "two", r1)
    for serve in (a, b, c):
        async with http.get(f"{serve.url}/v1/responses/{r2}", headers=auth()) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["id"] == r2 and doc["previous_response_id"] == r1
        assert doc["output"][0]["content"][0]["text"] == text2
        url = f"{serve.url}/v1/responses/{r2}/input_items?order=asc"
        async with http.get(url, headers=auth()) as r:
            assert r.status == 200
            items = (await r.json())["data"]
        assert [i["content"][0]["text"] for i in items] == ["one", "echo#1: one", "two"]

    # An item of r2's output, referenced by id on another replica, is the stored item.
    item_id = doc["output"][0]["id"]
    body = {
        "model": "m",
        "input": [{"role": "user", "content": "quote"}, {"type": "item_reference", "id": item_id}],
    }
    status, error, response = await respond(http, a.url, body, auth())
    assert response is not None, (status, error)
    forwarded = backend.responses_seen[-1].json["input"]
    assert forwarded[1]["id"] == item_id and forwarded[1]["content"][0]["text"] == text2
    status, error = await error_of(http, c, "POST", "/v1/responses", KEY_B, json=body)
    assert status == 400, (status, error)  # another credential cannot reference it

    async with http.delete(f"{c.url}/v1/responses/{r2}", headers=auth()) as r:
        assert r.status == 200 and (await r.json())["deleted"] is True
    calls = len(backend.responses_seen)
    for serve in (a, b, c):  # the delete is seen by every replica's next request
        status, error = await error_of(http, serve, "GET", f"/v1/responses/{r2}")
        assert status == 404, (status, error)
        status, _ = await error_of(http, serve, "GET", f"/v1/responses/{r2}/input_items")
        assert status == 404
        body = {"model": "m", "input": "x", "previous_response_id": r2}
        status, error = await error_of(http, serve, "POST", "/v1/responses", json=body)
        assert status == 400 and error["code"] == "previous_response_not_found", error
    assert len(backend.responses_seen) == calls  # refused before the backend
    _, text = await turn(http, c, "again", r1)  # the parent is untouched
    assert text == "echo#3: again"


async def test_another_credential_sees_nothing_on_any_replica(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    a, b, c = (await make_replicas(valkey_server.url)).slots
    rid, _ = await turn(http, a, "mine")
    calls = len(backend.responses_seen)
    for serve in (a, b, c):
        body = {"model": "m", "input": "x", "previous_response_id": rid}
        status, error = await error_of(http, serve, "POST", "/v1/responses", KEY_B, json=body)
        assert status == 400 and error["code"] == "previous_response_not_found", error
        for method, path in [
            ("GET", f"/v1/responses/{rid}"),
            ("GET", f"/v1/responses/{rid}/input_items"),
            ("DELETE", f"/v1/responses/{rid}"),
        ]:
            status, _ = await error_of(http, serve, method, path, KEY_B)
            assert status == 404, (method, path, status)
    assert len(backend.responses_seen) == calls
    _, text = await turn(http, c, "still mine", rid)  # B's DELETE deleted nothing
    assert text == "echo#3: still mine"


async def test_siblings_off_one_parent_on_two_replicas_at_once(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    a, b, c = (await make_replicas(valkey_server.url)).slots
    parent, _ = await turn(http, a, "root")
    mid, _ = await turn(http, b, "mid", parent)
    for _ in range(2):  # both in flight together, so their commits race
        backend.stall_next(0.3)
    (left, lt), (right, rt) = await asyncio.gather(
        turn(http, b, "left", mid, "sse"), turn(http, c, "right", mid, "json")
    )
    assert (lt, rt) == ("echo#5: left", "echo#5: right")
    calls = len(backend.responses_seen)
    for k, serve in enumerate((a, b, c)):  # each branch has its own history, on any replica
        left, text = await turn(http, serve, "after left", left)
        assert text == f"echo#{7 + 2 * k}: after left"
        right, text = await turn(http, serve, "after right", right)
        assert text == f"echo#{7 + 2 * k}: after right"
    seen = [s.json["input"] for s in backend.responses_seen[calls:]]
    lefts = [[m["content"] for m in body if m.get("role") == "user"] for body in seen[0::2]]
    rights = [[m["content"] for m in body if m.get("role") == "user"] for body in seen[1::2]]
    assert lefts[-1] == ["root", "mid", "left", "after left", "after left", "after left"]
    assert rights[-1] == ["root", "mid", "right", "after right", "after right", "after right"]
    assert_append_only([s.body for s in backend.responses_seen[calls:][0::2]])
    assert_append_only([s.body for s in backend.responses_seen[calls:][1::2]])


async def test_ttl_expires_a_chain_on_every_replica_and_in_the_store(
    valkey_server: KvServer,
    make_replicas: MakeReplicas,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
) -> None:
    """--ttl applies to the shared tier: once it has passed, no replica finds the turns and
    the server holds none of their keys (it expires them itself)."""
    a, b, c = (await make_replicas(valkey_server.url, 3, "--ttl", "2s")).slots
    r1, _ = await turn(http, a, "one")
    r2, text = await turn(http, b, "two", r1)
    assert text == "echo#3: two"
    async with redis.Redis.from_url(valkey_server.url) as client:
        assert [key async for key in client.scan_iter()]
        await asyncio.sleep(2.5)
        calls = len(backend.responses_seen)
        for serve in (a, b, c):
            for rid in (r1, r2):
                body = {"model": "m", "input": "x", "previous_response_id": rid}
                status, error = await error_of(http, serve, "POST", "/v1/responses", json=body)
                assert status == 400 and error["code"] == "previous_response_not_found", error
                status, _ = await error_of(http, serve, "GET", f"/v1/responses/{rid}")
                assert status == 404
        assert len(backend.responses_seen) == calls
        keys = [key async for key in client.scan_iter() if await client.exists(key)]
    # what is left is the byte budget's bookkeeping (its own pseudo-scope, no content) and
    # the compaction key's fingerprint (a setting the replicas share)
    settings = {*budget_keys("ocx:"), compaction_key_name("ocx:").encode()}
    assert [key for key in keys if key not in settings] == []
