"""Idempotency-Key on responses.create through the official SDK: a retry after completion
gets the same response (JSON or an SSE replay) with no second backend call; a retry in
flight gets 409; another body 422; per credential; across a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from ocxproxy.continuation.locks import idempotency_record_id
from ocxproxy.http.context import scope_of
from ocxproxy.http.idempotency import TTL
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.store.helpers import all_bytes_under


def key(value: str) -> dict[str, Any]:
    return {"extra_headers": {"Idempotency-Key": value}}


async def test_a_sequential_retry_gets_the_same_response_without_a_backend_call(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    first = await client.responses.create(model="m", input="hi", **key("k1"))
    raw = await client.responses.with_raw_response.create(model="m", input="hi", **key("k1"))
    again = raw.parse()
    assert again.id == first.id and again.output_text == first.output_text == "echo#1: hi"
    assert raw.headers["Idempotent-Replayed"] == "true"
    assert len(backend.responses_seen) == 1
    # As an SSE replay too, for a retry that asks for a stream.
    stream = await client.responses.create(model="m", input="hi", stream=True, **key("k2"))
    streamed = [event async for event in stream]
    replay = await client.responses.create(model="m", input="hi", stream=True, **key("k2"))
    replayed = [event async for event in replay]
    assert len(backend.responses_seen) == 2
    assert replayed[-1].type == "response.completed"
    assert replayed[-1].response.id == streamed[-1].response.id
    assert replayed[-1].response.output_text == "echo#1: hi"
    assert [e.sequence_number for e in replayed] == list(range(len(replayed)))
    assert replayed[0].type == "response.created"


async def test_a_retry_gets_the_members_echoed_from_the_request(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    # The backend leaves these out: the first answer takes them from the request, and so
    # does the one a retry gets (not the defaults).
    client = proxy.client().responses.with_raw_response
    asked = {"presence_penalty": 0.5, "prompt_cache_key": "pk", "max_tool_calls": 3}
    answers = [
        (await client.create(model="m", input="hi", extra_body=asked, **key("k"))).http_response
        for _ in range(2)
    ]
    assert len(backend.responses_seen) == 1
    assert answers[1].headers["Idempotent-Replayed"] == "true"
    for answer in answers:
        response = answer.json()
        assert {name: response[name] for name in asked} == asked


async def test_a_concurrent_retry_gets_409_and_no_second_backend_call(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    backend.stall_next(2)
    results = await asyncio.gather(
        *(client.responses.create(model="m", input="hi", **key("k")) for _ in range(3)),
        return_exceptions=True,
    )
    done = [r for r in results if isinstance(r, openai.types.responses.Response)]
    conflicts = [r for r in results if isinstance(r, openai.ConflictError)]
    assert len(done) == 1 and len(conflicts) == 2, results
    assert len(backend.responses_seen) == 1
    retried = await client.responses.create(model="m", input="hi", **key("k"))
    assert retried.id == done[0].id
    assert len(backend.responses_seen) == 1


async def test_the_same_key_with_another_body_is_422(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    await client.responses.create(model="m", input="hi", **key("k"))
    with pytest.raises(openai.UnprocessableEntityError):
        await client.responses.create(model="m", input="other", **key("k"))
    backend.stall_next(1)
    running = asyncio.gather(client.responses.create(model="m", input="a", **key("k2")))
    await backend.wait_for(lambda: len(backend.responses_seen) == 2)
    with pytest.raises(openai.UnprocessableEntityError):
        await client.responses.create(model="m", input="b", **key("k2"))
    await running
    assert len(backend.responses_seen) == 2


async def test_keys_are_per_credential_and_failures_are_not_kept(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    mine = await proxy.client().responses.create(model="m", input="hi", **key("k"))
    theirs = await proxy.client(api_key="sk-other").responses.create(
        model="m", input="hi", **key("k")
    )
    assert mine.id != theirs.id and len(backend.responses_seen) == 2
    backend.fail_next(500)
    with pytest.raises(openai.InternalServerError):
        await proxy.client().responses.create(model="m", input="x", **key("k3"))
    ok = await proxy.client().responses.create(model="m", input="x", **key("k3"))
    assert ok.output_text == "echo#1: x" and len(backend.responses_seen) == 4
    record = proxy.proxy.store.record(
        scope_of({"Authorization": "Bearer sk-test-a"}),
        idempotency_record_id(scope_of({"Authorization": "Bearer sk-test-a"}), "k3"),
    )
    assert record.expires_at - record.created_at == TTL


async def test_a_retry_on_a_conversation_appends_once(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    conv = await client.conversations.create()
    first = await client.responses.create(model="m", input="x", conversation=conv.id, **key("k"))
    again = await client.responses.create(model="m", input="x", conversation=conv.id, **key("k"))
    assert again.id == first.id and len(backend.responses_seen) == 1
    items = [item async for item in client.conversations.items.list(conv.id)]
    assert len(items) == 2


async def test_a_completed_key_survives_a_restart(
    make_proxy: MakeProxy, backend: FakeBackend, tmp_path: Path
) -> None:
    first = await make_proxy(backend.url)
    done = await first.client().responses.create(model="m", input="hi", **key("k"))
    hidden = await first.client().responses.create(
        model="m", input="MARKER-idem-store-false", store=False, **key("k-private")
    )
    replay = await first.client().responses.create(
        model="m", input="MARKER-idem-store-false", store=False, **key("k-private")
    )
    assert replay.id == hidden.id and len(backend.responses_seen) == 2
    await first.server.close()
    on_disk = await asyncio.to_thread(all_bytes_under, tmp_path / "state")
    assert done.id.encode() in on_disk
    assert b"MARKER-idem-store-false" not in on_disk  # store:false: memory only

    second = await make_proxy(backend.url)
    again = await second.client().responses.create(model="m", input="hi", **key("k"))
    assert again.id == done.id and len(backend.responses_seen) == 2
