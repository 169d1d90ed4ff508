"""A client whose base URL lacks `/v1` (`OPENAI_BASE_URL=http://host:8080`) reaches the
same proxy as one with it: its turns are stored and chained, its stored responses,
conversations and WebSocket turns are the proxy's, and what reaches the backend is always
under `/v1` (CONTRACT.md C2)."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import ProxyHandle
from tests.fakes.backend import RESPONSES_PATH, FakeBackend
from tests.http.helpers import assert_append_only
from tests.http.test_websocket import create as ws_create


async def test_a_chain_of_stored_turns_through_the_sdk(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.url, api_key="sk-bare", max_retries=0)
    proxy.clients.append(client)
    first = await client.responses.create(model="m", input=[{"role": "user", "content": "one"}])
    second = await client.responses.create(model="m", input="two", previous_response_id=first.id)
    streamed = await client.responses.create(
        model="m", input="three", previous_response_id=second.id, stream=True
    )
    third = [e async for e in streamed][-1].response
    assert third.output_text == "echo#5: three"  # the backend saw the whole chain
    assert [s.path for s in backend.seen] == [RESPONSES_PATH] * 3
    assert_append_only([s.body for s in backend.seen])
    # Stored, by the proxy: retrievable with and without /v1, listed, deleted.
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    with_v1 = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-bare", max_retries=0)
    proxy.clients.append(with_v1)
    assert (await with_v1.responses.retrieve(third.id)).id == third.id
    items = await client.responses.input_items.list(third.id)
    assert [i.content[0].text for i in items.data if i.type == "message"][:1] == ["three"]
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await with_v1.responses.retrieve(first.id)
    assert len(backend.seen) == 3  # none of that reached the backend
    # The stored turns are the proxy's, under one route label whatever the base URL.
    assert proxy.metric("ocxproxy_requests_total", route="/v1/responses", outcome="200") == 3
    by_id = "/v1/responses/{response_id}"  # two GETs and the DELETE, with /v1 or without
    assert proxy.metric("ocxproxy_requests_total", route=by_id, outcome="200") == 3
    assert proxy.metric("ocxproxy_requests_total", route=by_id[3:], outcome="200") == 0


async def test_conversations_and_models_without_v1(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.url, api_key="sk-bare", max_retries=0)
    proxy.clients.append(client)
    conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
    turn = await client.responses.create(model="m", input="next", conversation=conversation.id)
    assert turn.output_text == "echo#2: next"
    items = await client.conversations.items.list(conversation.id)
    assert len(items.data) == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == [s.id for s in (await proxy.client().models.list()).data]
    assert [s.path for s in backend.seen] == [RESPONSES_PATH, "/v1/models", "/v1/models"]


@pytest.mark.parametrize("chunked", [False, True], ids=["front", "aiohttp"])
async def test_raw_http_without_v1(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession, chunked: bool
) -> None:
    """Both ways into the proxy: a plain create (its own front end) and a chunked one."""
    body = orjson.dumps({"model": "m", "input": "hello"})

    async def chunks():  # type: ignore[no-untyped-def]
        yield body

    async with http.post(
        proxy.url + "/responses?x=1",
        data=chunks() if chunked else body,
        headers={"Content-Type": "application/json"},
    ) as r:
        assert r.status == 200, await r.text()
        made = await r.json()
    assert backend.seen[-1].path == RESPONSES_PATH
    async with http.post(
        proxy.url + "/responses/input_tokens",
        json={"model": "m", "input": "more", "previous_response_id": made["id"]},
    ) as r:
        assert r.status == 200, await r.text()
    assert backend.seen[-1].path == "/v1/responses/input_tokens"
    async with http.get(proxy.url + f"/responses/{made['id']}") as r:
        assert r.status == 200 and (await r.json())["id"] == made["id"]


async def test_websocket_without_v1(proxy: ProxyHandle, backend: FakeBackend) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(proxy.url + "/responses") as ws,
    ):
        one = [{"role": "user", "content": "one"}]
        first = (await ws_create(ws, model="m", input=one))[-1]["response"]
        events = await ws_create(ws, model="m", input="two", previous_response_id=first["id"])
    assert events[-1]["type"] == "response.completed", events[-1]
    assert [s.path for s in backend.seen] == [RESPONSES_PATH] * 2
    assert_append_only([s.body for s in backend.seen])
