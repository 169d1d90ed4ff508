"""The Conversations API through the official openai SDK against a real proxy and the fake
backend: every endpoint, pagination both ways, include, errors; responses.create with
`conversation` over JSON, SSE and WebSocket (splice byte-stable, append order, the
lock); store:false; restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from ocxproxy.aio import spawn
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only, sse_payloads
from tests.store.helpers import all_bytes_under

Json = dict[str, Any]
LOCKED_MESSAGE = (
    "Another process is currently operating on this conversation. Please retry in a few seconds."
)


def user(text: str) -> Json:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def texts(items: list[Any]) -> list[str]:
    """The first text of each message item, in order."""
    return [item.content[0].text for item in items if item.type == "message"]


async def all_items(client: openai.AsyncOpenAI, conversation_id: str, **query: Any) -> list[Any]:
    return [item async for item in client.conversations.items.list(conversation_id, **query)]


# -- the endpoints ------------------------------------------------------------------------


async def test_every_endpoint_through_the_sdk(proxy: ProxyHandle) -> None:
    client = proxy.client()
    conv = await client.conversations.create(
        items=[user("one"), user("two")], metadata={"topic": "demo"}
    )
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "demo"} and conv.created_at > 0

    got = await client.conversations.retrieve(conv.id)
    assert (got.id, got.created_at, got.metadata) == (conv.id, conv.created_at, conv.metadata)

    updated = await client.conversations.update(conv.id, metadata={"topic": "other"})
    assert updated.metadata == {"topic": "other"}
    assert (await client.conversations.retrieve(conv.id)).metadata == {"topic": "other"}

    added = await client.conversations.items.create(conv.id, items=[user("three")])
    assert [item.content[0].text for item in added.data] == ["three"]
    assert added.data[0].id.startswith("msg_") and added.data[0].status == "completed"
    assert added.first_id == added.last_id == added.data[0].id and not added.has_more

    assert texts(await all_items(client, conv.id, order="asc")) == ["one", "two", "three"]
    assert texts(await all_items(client, conv.id)) == ["three", "two", "one"]  # desc default

    item = await client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert item.id == added.data[0].id and item.content[0].text == "three"

    first = (await all_items(client, conv.id, order="asc"))[0]
    after_delete = await client.conversations.items.delete(first.id, conversation_id=conv.id)
    assert after_delete.id == conv.id and after_delete.object == "conversation"
    assert texts(await all_items(client, conv.id, order="asc")) == ["two", "three"]
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve(first.id, conversation_id=conv.id)

    deleted = await client.conversations.delete(conv.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (
        conv.id,
        "conversation.deleted",
        True,
    )
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conv.id)


async def test_pagination_both_orders(proxy: ProxyHandle) -> None:
    client = proxy.client()
    conv = await client.conversations.create(items=[user(f"m{i}") for i in range(7)])
    for order, expected in (("asc", range(7)), ("desc", reversed(range(7)))):
        page = await client.conversations.items.list(conv.id, order=order, limit=3)
        assert len(page.data) == 3 and page.has_more
        assert (page.first_id, page.last_id) == (page.data[0].id, page.data[-1].id)
        seen = [item async for item in page]  # the SDK follows after=last_id
        assert texts(seen) == [f"m{i}" for i in expected]
        last = await client.conversations.items.list(conv.id, order=order, after=seen[4].id)
        assert texts(last.data) == texts(seen[5:]) and not last.has_more


async def test_include_keeps_only_what_was_asked(proxy: ProxyHandle) -> None:
    client = proxy.client()
    reasoning = {
        "type": "reasoning",
        "id": "rs_given",
        "summary": [],
        "encrypted_content": "SECRET-BLOB",
    }
    conv = await client.conversations.create(items=[user("q"), reasoning])
    plain = await all_items(client, conv.id, order="asc")
    assert plain[1].id == "rs_given" and plain[1].encrypted_content is None
    kept = await all_items(client, conv.id, order="asc", include=["reasoning.encrypted_content"])
    assert kept[1].encrypted_content == "SECRET-BLOB"
    one = await client.conversations.items.retrieve(
        "rs_given", conversation_id=conv.id, include=["reasoning.encrypted_content"]
    )
    assert one.encrypted_content == "SECRET-BLOB"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.conversations.items.list(conv.id, include=["no.such.field"])  # type: ignore[list-item]
    assert bad.value.body["param"] == "include"  # type: ignore[index]


async def test_errors_in_openai_shape(proxy: ProxyHandle) -> None:
    client = proxy.client()
    conv = await client.conversations.create()
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve("conv_nope")
    with pytest.raises(openai.NotFoundError):  # another credential's: unknown
        await proxy.client(api_key="sk-other").conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        await proxy.client(api_key="sk-other").conversations.items.create(
            conv.id, items=[user("x")]
        )
    cases: list[tuple[Any, str]] = [
        (client.conversations.items.list(conv.id, limit=0), "limit"),
        (client.conversations.items.list(conv.id, limit=101), "limit"),
        (client.conversations.items.list(conv.id, order="up"), "order"),  # type: ignore[arg-type]
        (client.conversations.items.list(conv.id, after="msg_unknown"), "after"),
        (client.conversations.items.create(conv.id, items=[user("x")] * 21), "items"),
        (client.conversations.create(items=[user("x")] * 21), "items"),
        (client.conversations.create(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
        (client.conversations.update(conv.id, extra_body={"metadata": "nope"}, metadata={}), ""),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            await call
        error = bad.value.body
        assert isinstance(error, dict) and error["type"] == "invalid_request_error"
        if param:
            assert error["param"] == param, error
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.delete("msg_nope", conversation_id=conv.id)


async def test_update_needs_metadata(proxy: ProxyHandle, http: aiohttp.ClientSession) -> None:
    conv = await proxy.client().conversations.create()
    auth = {"Authorization": "Bearer sk-test-a"}
    async with http.post(f"{proxy.base_url}/conversations/{conv.id}", json={}, headers=auth) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "metadata"


# -- responses.create with a conversation ---------------------------------------------------


async def test_turns_splice_the_conversation_byte_stable_and_append_in_order(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    conv = await client.conversations.create(items=[user("hello")])
    first = await client.responses.create(model="m", input="one", conversation=conv.id)
    assert first.output_text == "echo#2: one"
    sent = backend.responses_seen[-1].json
    assert "conversation" not in sent and len(sent["input"]) == 2

    await client.conversations.items.create(conv.id, items=[user("between")])
    stream = await client.responses.create(
        model="m", input="two", conversation={"id": conv.id}, stream=True
    )
    events = [event async for event in stream]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "echo#5: two"
    third = await client.responses.create(
        model="m", input=[user("three")], conversation=conv.id, store=True
    )
    assert third.output_text == "echo#7: three"

    # Only appended to: each forwarded input is a byte prefix of the next (the cache hits).
    assert_append_only([seen.body for seen in backend.responses_seen])
    items = await all_items(client, conv.id, order="asc")
    assert texts(items) == [
        "hello", "one", "echo#2: one", "between", "two", "echo#5: two", "three", "echo#7: three",
    ]  # fmt: skip
    assert len({item.id for item in items}) == len(items)
    # The response itself is stored as usual, and chains like any other.
    assert (await client.responses.retrieve(third.id)).output_text == "echo#7: three"
    chained = await client.responses.create(model="m", input="four", previous_response_id=third.id)
    assert chained.output_text == "echo#9: four"


async def test_a_tool_call_round_trip_on_a_conversation(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    conv = await client.conversations.create()
    called = await client.responses.create(
        model="m", input="CALL:get_weather now", conversation=conv.id
    )
    call = called.output[0]
    assert call.type == "function_call"
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    done = await client.responses.create(model="m", input=[answer], conversation=conv.id)
    assert done.output_text == "echo#3: tool said sunny"
    kinds = [item.type for item in await all_items(client, conv.id, order="asc")]
    assert kinds == ["message", "function_call", "function_call_output", "message"]
    # An output that answers no call of the conversation is refused before forwarding.
    seen = len(backend.responses_seen)
    stray = {"type": "function_call_output", "call_id": "call_stray", "output": "x"}
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input=[stray], conversation=conv.id)
    assert len(backend.responses_seen) == seen


async def test_unknown_or_foreign_conversation_forwards_nothing(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    conv = await proxy.client().conversations.create()
    for client, conversation_id in (
        (proxy.client(), "conv_unknown"),
        (proxy.client(), "resp_not_a_conversation"),
        (proxy.client(api_key="sk-other"), conv.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(model="m", input="x", conversation=conversation_id)
        assert conversation_id in missing.value.message
    with pytest.raises(openai.BadRequestError) as both:
        await proxy.client().responses.create(
            model="m", input="x", conversation=conv.id, previous_response_id="resp_x"
        )
    assert both.value.code == "mutually_exclusive_parameters"
    assert backend.responses_seen == []
    # A conversation is not a response: no response route answers for one.
    with pytest.raises(openai.BadRequestError):
        await proxy.client().responses.create(model="m", input="x", previous_response_id=conv.id)


async def test_ten_concurrent_creates_one_backend_call_nine_locked(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    conv = await client.conversations.create()
    backend.stall_next(2)

    async def turn(i: int) -> Any:
        return await client.responses.create(model="m", input=f"t{i}", conversation=conv.id)

    results = await asyncio.gather(*(turn(i) for i in range(10)), return_exceptions=True)
    done = [r for r in results if not isinstance(r, BaseException)]
    locked = [r for r in results if isinstance(r, openai.BadRequestError)]
    assert len(done) == 1 and len(locked) == 9, results
    assert len(backend.responses_seen) == 1
    for error in locked:
        assert error.status_code == 400
        assert error.body == {
            "message": LOCKED_MESSAGE,
            "type": "invalid_request_error",
            "param": "conversation",
            "code": "conversation_locked",
        }
    # Free again the moment the turn ended; items writes are locked out meanwhile too.
    assert len(await all_items(client, conv.id)) == 2
    backend.stall_next(1)
    running = spawn(turn(10), name="turn")
    await backend.wait_for(lambda: len(backend.responses_seen) == 2)
    with pytest.raises(openai.BadRequestError) as write:
        await client.conversations.items.create(conv.id, items=[user("late")])
    assert write.value.code == "conversation_locked"
    await running
    await client.conversations.items.create(conv.id, items=[user("late")])
    assert len(proxy.proxy.store.conversations.slots) == 0


async def test_the_lock_is_released_on_failure_break_and_disconnect(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    client = proxy.client()
    conv = await client.conversations.create()
    backend.fail_next(500)
    with pytest.raises(openai.InternalServerError):
        await client.responses.create(model="m", input="a", conversation=conv.id)
    backend.status_next("failed")
    failed = await client.responses.create(model="m", input="b", conversation=conv.id)
    assert failed.status == "failed"
    backend.hang_up_next(after_events=2)
    stream = await client.responses.create(model="m", input="c", conversation=conv.id, stream=True)
    with pytest.raises(openai.APIError, match="broke off"):
        [event async for event in stream]
    assert await all_items(client, conv.id) == []  # nothing appended by a turn that failed

    backend.stall_next(1)  # the client gives up while the backend is still thinking
    body = {"model": "m", "input": "d", "conversation": conv.id}
    auth = {"Authorization": "Bearer sk-test-a"}
    task = spawn(http.post(f"{proxy.base_url}/responses", json=body, headers=auth), name="gone")
    await backend.wait_for(lambda: len(backend.responses_seen) == 4)
    assert len(proxy.proxy.store.conversations.slots) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await backend.wait_for(lambda: backend.cancelled >= 1)  # the proxy hung up on it
    assert len(proxy.proxy.store.conversations.slots) == 0
    ok = await client.responses.create(model="m", input="e", conversation=conv.id)
    assert ok.output_text == "echo#1: e"


async def test_a_lost_lease_expires(make_proxy: MakeProxy, backend: FakeBackend) -> None:
    """A holder that never releases (a stuck or vanished task) blocks no longer than the
    lease; here the lease is the backend read timeout."""
    handle = await make_proxy(backend.url, read_timeout=1.0)
    client = handle.client()
    conv = await client.conversations.create()
    slots = handle.proxy.store.conversations.slots  # another holder takes the lock for 1 s
    assert await slots.hold(conv.id, "another holder", 1.0)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="x", conversation=conv.id)
    await asyncio.sleep(1.05)
    ok = await client.responses.create(model="m", input="x", conversation=conv.id)
    assert ok.output_text == "echo#1: x"
    await slots.drop(conv.id, "another holder")  # it cannot free the new one's lock
    assert len(handle.proxy.store.conversations.slots) == 0


async def test_sse_stream_is_relayed_and_appended(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    conv = await proxy.client().conversations.create()
    auth = {"Authorization": "Bearer sk-test-a"}
    body = {"model": "m", "input": "s", "conversation": conv.id, "stream": True}
    async with http.post(f"{proxy.base_url}/responses", json=body, headers=auth) as r:
        payloads = sse_payloads(await r.read())
    assert payloads[-1]["type"] == "response.completed"
    assert texts(await all_items(proxy.client(), conv.id, order="asc")) == ["s", "echo#1: s"]


async def test_websocket_turns_on_a_conversation(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    client = proxy.client()
    conv = await client.conversations.create(items=[user("hi")])
    async with client.responses.connect() as conn:
        for text in ("one", "two"):
            await conn.response.create(model="m", input=text, conversation=conv.id)
            async with asyncio.timeout(5):
                event = await conn.recv()
                while event.type not in ("response.completed", "error"):
                    event = await conn.recv()
            assert event.type == "response.completed"
    assert texts(await all_items(client, conv.id, order="asc")) == [
        "hi", "one", "echo#2: one", "two", "echo#4: two",
    ]  # fmt: skip
    assert_append_only([seen.body for seen in backend.responses_seen])
    # Locked over the socket too, before anything is forwarded.
    slots = proxy.proxy.store.conversations.slots  # another holder has the lock
    assert await slots.hold(conv.id, "another holder", 60.0)
    auth = {"Authorization": "Bearer sk-test-a"}
    async with http.ws_connect(proxy.base_url + "/responses", headers=auth) as ws:
        await ws.send_str(
            orjson.dumps(
                {"type": "response.create", "model": "m", "input": "x", "conversation": conv.id}
            ).decode()
        )
        async with asyncio.timeout(5):
            error = orjson.loads((await ws.receive()).data)
        assert error["type"] == "error" and error["status"] == 400
        assert error["error"]["code"] == "conversation_locked"
        await slots.drop(conv.id, "another holder")
        await ws.send_str(
            orjson.dumps(
                {"type": "response.create", "model": "m", "input": "x", "conversation": "conv_no"}
            ).decode()
        )
        async with asyncio.timeout(5):
            unknown = orjson.loads((await ws.receive()).data)
        assert unknown["status"] == 404 and "conv_no" in unknown["error"]["message"]
    assert len(backend.responses_seen) == 2


# -- store:false, privacy, restart ------------------------------------------------------------


async def test_store_false_reads_the_conversation_but_leaves_nothing_on_disk(
    make_proxy: MakeProxy, backend: FakeBackend, tmp_path: Path
) -> None:
    """Nothing from a store:false turn is written to disk (CONTRACT.md C5), conversation or
    not: the turn sees the conversation's items but is not appended to it, and its response
    object is stored nowhere. A store:true turn on the same conversation is kept, so the scan
    is shown to see what was stored."""
    handle = await make_proxy(backend.url)
    client = handle.client()
    conv = await client.conversations.create()
    await client.responses.create(model="m", input="MARKER-stored-turn", conversation=conv.id)
    hidden = await client.responses.create(
        model="m",
        input="MARKER-in-conversation",
        conversation=conv.id,
        store=False,
        metadata={"tag": "MARKER-response-object"},
    )
    assert b"MARKER-stored-turn" in backend.responses_seen[-1].body  # it read the conversation
    bare = await client.responses.create(model="m", input="MARKER-no-conversation", store=False)
    assert texts(await all_items(client, conv.id, order="asc")) == [
        "MARKER-stored-turn",
        "echo#1: MARKER-stored-turn",
    ]
    for response_id in (hidden.id, bare.id):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response_id)
    await handle.server.close()  # graceful: everything durable is flushed
    on_disk = await asyncio.to_thread(all_bytes_under, tmp_path / "state")
    assert b"MARKER-stored-turn" in on_disk  # the scan sees what was kept
    assert b"MARKER-in-conversation" not in on_disk
    assert b"MARKER-no-conversation" not in on_disk
    assert b"MARKER-response-object" not in on_disk
    assert hidden.id.encode() not in on_disk


async def test_conversations_survive_a_restart(
    make_proxy: MakeProxy, backend: FakeBackend, tmp_path: Path
) -> None:
    first = await make_proxy(backend.url)
    client = first.client()
    conv = await client.conversations.create(items=[user("a")], metadata={"k": "v"})
    await client.responses.create(model="m", input="b", conversation=conv.id)
    await client.conversations.items.create(conv.id, items=[user("c")])
    before = [item.model_dump() for item in await all_items(client, conv.id, order="asc")]
    await first.server.close()

    second = await make_proxy(backend.url)
    client = second.client()
    assert (await client.conversations.retrieve(conv.id)).metadata == {"k": "v"}
    after = [item.model_dump() for item in await all_items(client, conv.id, order="asc")]
    assert after == before
    again = await client.responses.create(model="m", input="d", conversation=conv.id)
    assert again.output_text == "echo#5: d"
    assert_append_only([seen.body for seen in backend.responses_seen])


async def test_a_chat_completions_backend_serves_conversations(make_proxy: MakeProxy) -> None:
    """The proxy owns the conversation: the chat dialect sees only messages."""
    from tests.fakes.chat_backend import ChatBackend

    async with ChatBackend() as chat:
        handle = await make_proxy(chat.url, upstream_dialect=("chat",))
        client = handle.client()
        conv = await client.conversations.create(items=[user("hello")])
        first = await client.responses.create(model="m", input="one", conversation=conv.id)
        second = await client.responses.create(model="m", input="two", conversation=conv.id)
        assert [len(body["messages"]) for body in chat.chats] == [2, 4]
        assert first.output_text.endswith("one") and second.output_text.endswith("two")


async def test_a_write_that_would_drop_conversation_items_is_refused(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url, zdr=True, max_resident_bytes=4096, max_entries=3)
    client = handle.client()
    conv = await client.conversations.create(items=[user("x" * 1500)])
    await client.conversations.create()
    await client.conversations.create()
    with pytest.raises(openai.InternalServerError) as full:  # a fourth: the entry cap
        await client.conversations.create()
    assert full.value.status_code == 507 and full.value.code == "store_full"
    with pytest.raises(openai.InternalServerError):  # past the bytes: refused before a call
        await client.conversations.items.create(conv.id, items=[user("y" * 3000)])
    with pytest.raises(openai.InternalServerError):
        await client.responses.create(model="m", input="z" * 3000, conversation=conv.id)
    assert backend.responses_seen == []
    # Responses still come and go around them; the conversations keep every item.
    for i in range(5):
        await client.responses.create(model="m", input=f"r{i}")
    turn = await client.responses.create(model="m", input="fits", conversation=conv.id)
    assert turn.output_text == "echo#2: fits"
    assert len(await all_items(client, conv.id)) == 3


async def test_the_access_log_names_a_conversation_turn(
    make_proxy: MakeProxy, backend: FakeBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = await make_proxy(backend.url, access_log="json")
    client = handle.client()
    conv = await client.conversations.create(items=[user("SECRET-PROMPT-TEXT")])
    await client.responses.create(model="m", input="x", conversation=conv.id)
    out = capsys.readouterr().out
    lines = [orjson.loads(line) for line in out.splitlines() if line.startswith("{")]
    turn = next(line for line in lines if line.get("expansion") == "conversation")
    assert turn["history_bytes"] > 0
    assert "SECRET-PROMPT-TEXT" not in out
