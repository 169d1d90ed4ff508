"""What a create on a conversation answers, through real clients against a real proxy and
the fake backend: a turn that could not be appended to its conversation is an error the
client sees (JSON, SSE, WebSocket), never a silent success."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from ocxproxy.aio import spawn
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.store.local.kept import KeptRecords
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import sse_payloads
from tests.store.helpers import all_bytes_under

Json = dict[str, Any]
AUTH = {"Authorization": "Bearer sk-test-a"}
RESPONSE_EVENTS = ("response.created", "response.in_progress", "response.completed")


def user(text: str) -> Json:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def texts(client: openai.AsyncOpenAI, conversation_id: str) -> list[str]:
    items = client.conversations.items.list(conversation_id, order="asc")
    return [item.content[0].text async for item in items if item.type == "message"]


def refuse_conversation_appends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store refuses the write that appends an answered turn to its conversation (the
    only write taken past the caps); every other write goes through. A single-node store
    never refuses it today; a shared tier that is down would."""
    real = KeptRecords.keep

    def keep(self: KeptRecords, record_id: str, *args: Any, **kwargs: Any) -> Any:
        if record_id.startswith("conv_") and kwargs.get("force"):
            raise StoreFailure(FailureReason.WRITE_FAILED, record_id)
        return real(self, record_id, *args, **kwargs)

    monkeypatch.setattr(KeptRecords, "keep", keep)


# -- a turn that could not be appended ----------------------------------------------------


async def test_a_conversation_changed_during_the_turn_is_a_409_not_a_silent_200(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    """The turn's lock (a lease as long as the read timeout) ran out while a slow answer
    arrived, and another request wrote to the conversation: the turn is not appended, and
    the client is told so instead of getting a response it would take for appended."""
    handle = await make_proxy(backend.url, read_timeout=1.0)
    client = handle.client()
    conv = await client.conversations.create()
    backend.drip_next(0.75, parts=3)  # 1.5 s in all, never silent for a read timeout
    turn = spawn(
        client.responses.create(model="m", input="slow", conversation=conv.id), name="turn"
    )
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    await asyncio.sleep(1.1)  # the turn's lease has run out
    await client.conversations.items.create(conv.id, items=[user("meanwhile")])
    with pytest.raises(openai.ConflictError) as changed:
        await turn
    assert changed.value.status_code == 409
    assert changed.value.body == {
        "message": changed.value.body["message"],
        "type": "invalid_request_error",
        "param": "conversation",
        "code": "conversation_changed",
    }
    assert "changed" in changed.value.body["message"]
    assert await texts(client, conv.id) == ["meanwhile"]
    assert handle.metric("ocxproxy_turns_not_recorded_total", reason="conversation_changed") == 1
    assert len(handle.proxy.store.conversations.slots) == 0
    again = await client.responses.create(model="m", input="again", conversation=conv.id)
    assert await texts(client, conv.id) == ["meanwhile", "again", again.output_text]


async def test_a_refused_append_is_a_503_and_nothing_is_kept(
    make_proxy: MakeProxy, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = await make_proxy(backend.url)
    client = handle.client()
    conv = await client.conversations.create(items=[user("before")])
    refuse_conversation_appends(monkeypatch)
    with pytest.raises(openai.InternalServerError) as refused:
        await client.responses.create(
            model="m", input="lost", conversation=conv.id, extra_headers={"Idempotency-Key": "k1"}
        )
    assert refused.value.status_code == 503
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "storage_unavailable"
    assert error["type"] == "server_error" and "conversation" in error["message"]
    assert handle.metric("ocxproxy_turns_not_recorded_total", reason="conversation_failed") == 1
    monkeypatch.undo()
    assert await texts(client, conv.id) == ["before"]
    # Not remembered for the Idempotency-Key either: its retry runs (and is appended).
    retry = await client.responses.create(
        model="m", input="lost", conversation=conv.id, extra_headers={"Idempotency-Key": "k1"}
    )
    assert await texts(client, conv.id) == ["before", "lost", retry.output_text]
    assert len(backend.responses_seen) == 2


async def test_a_refused_append_ends_the_stream_with_an_error_event(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle = await make_proxy(backend.url)
    conv = await handle.client().conversations.create()
    refuse_conversation_appends(monkeypatch)
    body = {"model": "m", "input": "s", "conversation": conv.id, "stream": True}
    async with http.post(f"{handle.base_url}/responses", json=body, headers=AUTH) as r:
        assert r.status == 200  # the status line was out before the turn ended
        payloads = sse_payloads(await r.read())
    kinds = [p["type"] for p in payloads]
    assert kinds[0] == "response.created" and "response.completed" not in kinds
    assert kinds[-1] == "error" and payloads[-1]["code"] == "storage_unavailable"
    assert payloads[-1]["sequence_number"] == payloads[-2]["sequence_number"] + 1
    monkeypatch.undo()
    assert await texts(handle.client(), conv.id) == []


async def test_a_refused_append_over_websocket_is_an_error_event(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle = await make_proxy(backend.url)
    conv = await handle.client().conversations.create()
    refuse_conversation_appends(monkeypatch)
    frame = {"type": "response.create", "model": "m", "input": "w", "conversation": conv.id}
    async with http.ws_connect(handle.base_url + "/responses", headers=AUTH) as ws:
        await ws.send_str(orjson.dumps(frame).decode())
        kinds = []
        async with asyncio.timeout(5):
            while True:
                event = orjson.loads((await ws.receive()).data)
                kinds.append(event["type"])
                if event["type"] in ("error", "response.completed"):
                    break
    assert kinds[-1] == "error" and "response.completed" not in kinds
    assert event["error"]["code"] == "storage_unavailable"
    monkeypatch.undo()
    assert await texts(handle.client(), conv.id) == []


# -- the Response names its conversation -------------------------------------------------


async def test_a_response_echoes_its_conversation_everywhere(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    """`"conversation": {"id": …}` in the JSON answer, in every event that carries the
    Response (SSE and WebSocket), and in the stored response; a turn without one says
    null, as the backend did."""
    client = proxy.client()
    conv = await client.conversations.create()
    plain = await client.responses.create(model="m", input="alone")
    assert plain.conversation is None
    first = await client.responses.create(model="m", input="one", conversation=conv.id)
    assert first.conversation is not None and first.conversation.id == conv.id
    stored = await client.responses.retrieve(first.id)
    assert stored.conversation is not None and stored.conversation.id == conv.id
    assert (await client.responses.retrieve(plain.id)).conversation is None

    body = {"model": "m", "input": "two", "conversation": {"id": conv.id}, "stream": True}
    async with http.post(f"{proxy.base_url}/responses", json=body, headers=AUTH) as r:
        events = sse_payloads(await r.read())
    lifecycle = [e for e in events if e["type"] in RESPONSE_EVENTS]
    assert [e["type"] for e in lifecycle] == list(RESPONSE_EVENTS)
    assert all(e["response"]["conversation"] == {"id": conv.id} for e in lifecycle)
    streamed = await client.responses.retrieve(lifecycle[-1]["response"]["id"])
    assert streamed.conversation is not None and streamed.conversation.id == conv.id

    frame = {"type": "response.create", "model": "m", "input": "three", "conversation": conv.id}
    async with http.ws_connect(proxy.base_url + "/responses", headers=AUTH) as ws:
        await ws.send_str(orjson.dumps(frame).decode())
        kinds = []
        async with asyncio.timeout(5):
            while not kinds or kinds[-1] != "response.completed":
                event = orjson.loads((await ws.receive()).data)
                kinds.append(event["type"])
                if event["type"] in RESPONSE_EVENTS:
                    assert event["response"]["conversation"] == {"id": conv.id}, event
    assert [k for k in kinds if k in RESPONSE_EVENTS] == list(RESPONSE_EVENTS)
    third = await client.responses.retrieve(event["response"]["id"])
    assert await texts(client, conv.id) == [
        "one", first.output_text, "two", streamed.output_text, "three", third.output_text,
    ]  # fmt: skip


# -- the siblings of create --------------------------------------------------------------


def message_texts(items: list[Any]) -> list[str]:
    texts = []
    for item in items:
        content = item["content"]
        texts.append(content if isinstance(content, str) else content[0]["text"])
    return texts


@pytest.mark.parametrize("route", ["input_tokens", "compact"])
async def test_the_siblings_of_create_expand_a_conversation(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession, route: str
) -> None:
    """The backend knows no conversations: `input_tokens` and `compact` get its items in
    front of the input, as a create would, and nothing is appended or locked."""
    client = proxy.client()
    conv = await client.conversations.create(items=[user("earlier")])
    answered = await client.responses.create(model="m", input="turn", conversation=conv.id)
    backend.stall_next(1)  # a turn holds the conversation's lock meanwhile
    running = spawn(
        client.responses.create(model="m", input="running", conversation=conv.id), name="turn"
    )
    await backend.wait_for(lambda: len(backend.responses_seen) == 2)
    for conversation in (conv.id, {"id": conv.id}):
        body = {"model": "m", "input": "how long?", "conversation": conversation}
        async with http.post(f"{proxy.base_url}/responses/{route}", json=body, headers=AUTH) as r:
            await r.read()
        forwarded = backend.seen[-1]
        assert "conversation" not in forwarded.json
        sent = forwarded.json["input"]
        if route == "compact":  # served by the proxy: it asks the backend for a summary
            assert forwarded.path == "/v1/responses" and r.status == 200
            sent = sent[:-1]
        else:
            assert forwarded.path == f"/v1/responses/{route}"
        assert message_texts(sent) == [
            "earlier", "turn", answered.output_text, "how long?",
        ]  # fmt: skip
        if route == "input_tokens":
            assert r.status == 200
    assert len(proxy.proxy.store.conversations.slots) == 1  # the running turn's, untouched
    await running
    assert len(proxy.proxy.store.conversations.slots) == 0
    assert await texts(client, conv.id) == [
        "earlier", "turn", answered.output_text, "running", (await running).output_text,
    ]  # fmt: skip

    before = len(backend.seen)
    unknown = {"model": "m", "input": "x", "conversation": "conv_nope"}
    async with http.post(f"{proxy.base_url}/responses/{route}", json=unknown, headers=AUTH) as r:
        assert r.status == 404
        assert (await r.json())["error"]["param"] == "conversation_id"
    assert len(backend.seen) == before


# -- store:false content of a WebSocket connection ------------------------------------------


async def test_a_connections_store_false_item_never_reaches_a_conversation(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """An item_reference to a store:false item (kept only in the WebSocket connection's
    memory) on a conversation turn would put that item into the conversation, which is
    stored: refused before anything is forwarded, and nothing of it reaches disk."""
    handle = await make_proxy(backend.url)
    conv = await handle.client().conversations.create(items=[user("MARKER-kept")])
    async with http.ws_connect(handle.base_url + "/responses", headers=AUTH) as ws:

        async def turn(**fields: Any) -> Json:
            await ws.send_str(orjson.dumps({"type": "response.create", **fields}).decode())
            while True:
                async with asyncio.timeout(5):
                    event: Json = orjson.loads((await ws.receive()).data)
                if event["type"] in ("response.completed", "error"):
                    return event

        private = await turn(model="m", input="MARKER-private", store=False)
        item_id = private["response"]["output"][0]["id"]
        seen = len(backend.responses_seen)
        refused = await turn(
            model="m", input=[{"type": "item_reference", "id": item_id}], conversation=conv.id
        )
        assert refused["type"] == "error" and refused["status"] == 400, refused
        assert refused["error"]["param"] == "input" and item_id in refused["error"]["message"]
        assert len(backend.responses_seen) == seen
        # store:false on the conversation reads it and appends nothing: allowed
        read = await turn(
            model="m",
            input=[{"type": "item_reference", "id": item_id}],
            conversation=conv.id,
            store=False,
        )
        assert read["type"] == "response.completed", read
    assert await texts(handle.client(), conv.id) == ["MARKER-kept"]
    await handle.server.close()  # graceful: everything durable is flushed
    on_disk = await asyncio.to_thread(all_bytes_under, tmp_path / "state")
    assert b"MARKER-kept" in on_disk  # the scan sees what was kept
    assert b"MARKER-private" not in on_disk
