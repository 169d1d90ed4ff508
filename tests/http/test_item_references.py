"""`item_reference` input items: resolved in the caller's scope to the stored
item, byte for byte, over JSON, SSE, the SDK's stream helper and WebSocket; every failure
a 400 with nothing forwarded; and `previous_response_id` echoed in what the client gets."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from ocxproxy.errors import StoreFailure
from ocxproxy.http.context import scope_of
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import assert_append_only, sse_payloads, top_level_span
from tests.serve import Serve

Json = dict[str, Any]
KEY = "sk-test-a"
RESPONSE_EVENTS = ("response.created", "response.in_progress", "response.completed")


def user(text: str) -> Json:
    return {"role": "user", "content": text}


def ref(item_id: str) -> Json:
    return {"type": "item_reference", "id": item_id}


async def post(
    handle: ProxyHandle,
    body: Json,
    *,
    key: str = KEY,
    path: str = "/v1/responses",
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(handle.url + path, data=orjson.dumps(body), headers=headers) as resp,
    ):
        return resp.status, await resp.read()


# -- one turn, by transport -----------------------------------------------------------------

Turn = Callable[[ProxyHandle, Json], Awaitable[Json]]


async def json_turn(handle: ProxyHandle, body: Json) -> Json:
    status, raw = await post(handle, body)
    assert status == 200, raw
    response: Json = orjson.loads(raw)
    return response


async def sse_turn(handle: ProxyHandle, body: Json) -> Json:
    status, raw = await post(handle, {**body, "stream": True})
    assert status == 200, raw
    events = sse_payloads(raw)
    assert events[-1]["type"] == "response.completed", events[-1]
    response: Json = events[-1]["response"]
    return response


async def sdk_stream_turn(handle: ProxyHandle, body: Json) -> Json:
    """The openai SDK's `responses.stream()` helper, which checks the event stream."""
    client: Any = handle.client(KEY)
    async with client.responses.stream(**body) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    response: Json = final.model_dump(mode="json")
    return response


async def ws_turn(handle: ProxyHandle, body: Json) -> Json:
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(
            handle.base_url + "/responses", headers={"Authorization": f"Bearer {KEY}"}
        ) as ws,
    ):
        await ws.send_str(orjson.dumps({"type": "response.create", **body}).decode())
        while True:
            async with asyncio.timeout(5):
                event = orjson.loads((await ws.receive()).data)
            assert event["type"] != "error", event
            if event["type"] == "response.completed":
                response: Json = event["response"]
                return response


TURNS = {"json": json_turn, "sse": sse_turn, "sdk-stream": sdk_stream_turn, "websocket": ws_turn}


@pytest.mark.parametrize("transport", TURNS)
async def test_ai_sdk_history_by_reference_reaches_the_backend_resolved(
    make_proxy: MakeProxy, backend: FakeBackend, transport: str
) -> None:
    """The AI SDK's useChat shape: every turn resends the history, its own earlier
    answers as references. The backend sees the full history, byte-identical to it sent in
    full, each turn's input an append-only byte prefix of the next, and its cache hits."""
    handle = await make_proxy(backend.url)
    turn = TURNS[transport]
    history: list[Json] = []  # as the AI SDK resends it
    full: list[bytes] = []  # the same history in full, as the backend encoded its answers
    previous_input = 0
    for n, word in enumerate(("one", "two", "three", "four")):
        history.append(user(word))
        full.append(orjson.dumps(user(word)))
        response = await turn(handle, {"model": "m", "input": history})
        assert response["output"][0]["content"][0]["text"] == f"echo#{2 * n + 1}: {word}"
        forwarded = top_level_span(backend.responses_seen[-1].body, "input")
        if transport != "sdk-stream":  # the SDK's models reorder what the client sees
            assert forwarded == b"[" + b",".join(full) + b"]"
        resolved = orjson.loads(forwarded)
        assert len(resolved) == 2 * n + 1 and resolved[-1] == user(word)
        for sent, item in zip(history[1::2], resolved[1::2], strict=True):
            assert item["id"] == sent["id"] and item["type"] == "message"
        usage = response["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= previous_input - 1
        previous_input = usage["input_tokens"]
        answer = response["output"][0]
        history.append(ref(answer["id"]))
        full.append(orjson.dumps(answer))
    bodies = [seen.body for seen in backend.responses_seen]
    assert len(bodies) == 4
    assert handle.metric("ocxproxy_item_references_total", outcome="resolved") == 6
    assert_append_only(bodies)
    assert not any(b"item_reference" in body for body in bodies)


# -- what a reference may name ------------------------------------------------------------


async def test_a_function_call_by_reference_binds_its_output(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    """A tool output answering a call that arrives by reference is bound (CONTRACT.md C1.5), with or
    without previous_response_id."""
    handle = await make_proxy(backend.url)
    first = await json_turn(handle, {"model": "m", "input": [user("CALL:get_weather")]})
    call = first["output"][0]
    assert call["type"] == "function_call"
    unrelated = await json_turn(handle, {"model": "m", "input": "something else"})
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    # The call is in neither the unrelated chain nor the request: refused, nothing sent.
    sent = len(backend.responses_seen)
    status, raw = await post(
        handle, {"model": "m", "input": [answer], "previous_response_id": unrelated["id"]}
    )
    assert status == 400 and b"No tool call found" in raw
    assert len(backend.responses_seen) == sent
    # By reference it is: resolved ahead of the output, and bound.
    for prev in (None, unrelated["id"]):
        body: Json = {"model": "m", "input": [user("CALL:get_weather"), ref(call["id"]), answer]}
        if prev:
            body["previous_response_id"] = prev
        response = await json_turn(handle, body)
        assert response["output"][0]["content"][0]["text"].endswith("tool said sunny")
        items = backend.responses_seen[-1].json["input"]
        assert items[-2] == call and items[-1] == answer


async def test_a_reasoning_item_resolves_to_the_bytes_the_client_first_sent(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    """An input item that carried an id is stored as the client wrote it (odd spacing and
    escapes included) and a reference to it brings back exactly those bytes."""
    handle = await make_proxy(backend.url)
    reasoning = (
        b'{ "type" : "reasoning", "id":"rs_abc", "summary":[], "encrypted_content":"caf\\u00e9=="}'
    )
    raw = b'{"model":"m","input":[' + reasoning + b', {"role":"user","content":"hi"}]}'
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(handle.url + "/v1/responses", data=raw, headers=headers) as resp,
    ):
        assert resp.status == 200
    await json_turn(handle, {"model": "m", "input": [ref("rs_abc"), user("again")]})
    forwarded = backend.responses_seen[-1].body
    assert (
        top_level_span(forwarded, "input")
        == b"[" + reasoning + b',{"role":"user","content":"again"}]'
    )


async def test_references_mixed_with_previous_response_id(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url)
    chain = await json_turn(handle, {"model": "m", "input": "chain"})
    other = await json_turn(handle, {"model": "m", "input": "other"})
    other_item = other["output"][0]
    response = await json_turn(
        handle,
        {
            "model": "m",
            "previous_response_id": chain["id"],
            "input": [ref(other_item["id"]), user("both")],
        },
    )
    assert response["previous_response_id"] == chain["id"]
    items = backend.responses_seen[-1].json["input"]
    assert items == [user("chain"), chain["output"][0], other_item, user("both")]
    # the turn is remembered with the resolved item: its chain replays it
    await json_turn(handle, {"model": "m", "previous_response_id": response["id"], "input": "x"})
    assert_append_only([seen.body for seen in backend.responses_seen[-2:]])


# -- what must not resolve: 400, nothing forwarded ------------------------------------------


async def expect_refused(
    handle: ProxyHandle, backend: FakeBackend, item_id: str, **kw: Any
) -> None:
    sent = len(backend.seen)
    status, raw = await post(handle, {"model": "m", "input": [user("q"), ref(item_id)]}, **kw)
    assert status == 400, raw
    error = orjson.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "input"
    assert f"'{item_id}'" in error["message"]
    assert len(backend.seen) == sent


async def test_unresolvable_references_are_refused(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url, retain_unstored=True)
    assert handle.metric("ocxproxy_item_references_total", outcome="unknown") == 0
    await expect_refused(handle, backend, "msg_unknown")
    assert handle.metric("ocxproxy_item_references_total", outcome="unknown") == 1
    mine = await json_turn(handle, {"model": "m", "input": "mine"})
    item_id = mine["output"][0]["id"]
    await expect_refused(handle, backend, item_id, key="sk-test-b")  # another credential
    # store:false: kept in memory for chaining (--retain-unstored), never resolved by item
    unstored = await json_turn(handle, {"model": "m", "input": "private", "store": False})
    await expect_refused(handle, backend, unstored["output"][0]["id"])
    # deleted
    async with (
        aiohttp.ClientSession() as http,
        http.delete(
            handle.base_url + f"/responses/{mine['id']}",
            headers={"Authorization": f"Bearer {KEY}"},
        ) as resp,
    ):
        assert resp.status == 200
    await expect_refused(handle, backend, item_id)
    # a reference without an id
    sent = len(backend.seen)
    status, raw = await post(handle, {"model": "m", "input": [{"type": "item_reference"}]})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "input"
    assert len(backend.seen) == sent


async def test_an_expired_item_is_refused(make_proxy: MakeProxy, backend: FakeBackend) -> None:
    handle = await make_proxy(backend.url, ttl=0.3)
    first = await json_turn(handle, {"model": "m", "input": "soon gone"})
    await asyncio.sleep(0.4)
    await expect_refused(handle, backend, first["output"][0]["id"])


async def test_unknown_references_pass_through_with_forward_unknown_ids(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    """An operator whose backend keeps its own items forwards what the proxy cannot find."""
    handle = await make_proxy(backend.url, forward_unknown_ids=True)
    await post(handle, {"model": "m", "input": [user("q"), ref("msg_backends")]})
    assert backend.responses_seen[-1].json["input"] == [user("q"), ref("msg_backends")]


# -- after a restart -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sigterm", "kill -9"])
async def test_references_resolve_after_a_restart(
    backend: FakeBackend, tmp_path: Path, how: str
) -> None:
    """A `serve` process stopped, or killed right after it answered (an acknowledged turn
    is durable), and started again on the same state dir resolves the item ids it held."""
    state = tmp_path / "state"
    procs = [Serve(backend.url, state), Serve(backend.url, state)]
    try:
        await procs[0].start()
        client = procs[0].client()
        first = await client.responses.create(model="m", input=[user("before")])
        await client.close()
        if how == "sigterm":
            assert await procs[0].stop(signal.SIGTERM) == 0
        else:
            assert await procs[0].stop(signal.SIGKILL) == -signal.SIGKILL
        answered = backend.responses_seen[-1]
        await procs[1].start()
        client = procs[1].client()
        item_id = first.output[0].id
        second = await client.responses.create(
            model="m", input=[user("before"), ref(item_id), user("after")]
        )
        await client.close()
        assert second.output_text == "echo#3: after"
        forwarded = orjson.loads(top_level_span(backend.responses_seen[-1].body, "input"))
        assert forwarded[1]["id"] == item_id
        assert forwarded[1]["content"][0]["text"] == first.output_text
        assert_append_only([answered.body, backend.responses_seen[-1].body])
    finally:
        for proc in procs:
            if proc.proc is not None and proc.proc.returncode is None:
                proc.proc.kill()
                await proc.proc.wait()


# -- the sibling routes and WebSocket's own store -------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses/input_tokens", "/v1/responses/compact"])
async def test_input_tokens_and_compact_see_resolved_items(
    make_proxy: MakeProxy, backend: FakeBackend, path: str
) -> None:
    handle = await make_proxy(backend.url)
    first = await json_turn(handle, {"model": "m", "input": "count me"})
    item = first["output"][0]
    await post(handle, {"model": "m", "input": [user("count me"), ref(item["id"])]}, path=path)
    seen = backend.seen[-1]
    if path.endswith("/compact"):  # served by the proxy: it asks the backend for a summary
        assert seen.path == "/v1/responses"
        assert seen.json["input"][:-1] == [user("count me"), item]
    else:
        assert seen.path == path
        assert seen.json["input"] == [user("count me"), item]


async def test_websocket_items_of_its_own_store_resolve_there_only(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with http.ws_connect(handle.base_url + "/responses", headers=headers) as ws:

        async def turn(**fields: Any) -> Json:
            await ws.send_str(orjson.dumps({"type": "response.create", **fields}).decode())
            while True:
                async with asyncio.timeout(5):
                    event: Json = orjson.loads((await ws.receive()).data)
                if event["type"] in ("response.completed", "error"):
                    return event

        done = await turn(model="m", input="private", store=False)
        item = done["response"]["output"][0]
        # store:true (the default), yet it holds store:false content
        again = await turn(model="m", input=[user("private"), ref(item["id"]), user("more")])
        assert again["type"] == "response.completed", again
        assert backend.responses_seen[-1].json["input"][1] == item
    # not over HTTP, not on another connection; and the turn holding it stayed in the
    # connection's memory with it: the shared store (and so the disk) has neither turn
    await expect_refused(handle, backend, item["id"])
    scope = scope_of({"Authorization": f"Bearer {KEY}"})
    for rid in (done["response"]["id"], again["response"]["id"]):
        with pytest.raises(StoreFailure):
            handle.proxy.store.lookup_nowait(scope, rid)
    async with http.ws_connect(handle.base_url + "/responses", headers=headers) as ws:
        await ws.send_str(
            orjson.dumps(
                {"type": "response.create", "model": "m", "input": [ref(item["id"])]}
            ).decode()
        )
        async with asyncio.timeout(5):
            event = orjson.loads((await ws.receive()).data)
        assert event["type"] == "error" and event["status"] == 400
        assert event["error"]["param"] == "input" and item["id"] in event["error"]["message"]


# -- previous_response_id echoed -------------------------------------------------------------


@pytest.mark.parametrize("style", ["spec", "llama"])  # llama's stream is repaired too
async def test_previous_response_id_is_echoed_everywhere(make_proxy: MakeProxy, style: Any) -> None:
    async with FakeBackend(stream_style=style) as backend:
        await _echoed_everywhere(await make_proxy(backend.url))


async def _echoed_everywhere(handle: ProxyHandle) -> None:
    first = await json_turn(handle, {"model": "m", "input": "one"})
    assert first["previous_response_id"] is None
    second = await json_turn(
        handle, {"model": "m", "input": "two", "previous_response_id": first["id"]}
    )
    assert second["previous_response_id"] == first["id"]
    status, raw = await post(
        handle,
        {"model": "m", "input": "three", "previous_response_id": second["id"], "stream": True},
    )
    assert status == 200
    events = sse_payloads(raw)
    lifecycle = [e for e in events if e["type"] in RESPONSE_EVENTS]
    assert [e["type"] for e in lifecycle] == list(RESPONSE_EVENTS)
    assert all(e["response"]["previous_response_id"] == second["id"] for e in lifecycle)
    third = lifecycle[-1]["response"]
    client: Any = handle.client(KEY)
    for rid, prev in (
        (first["id"], None),
        (second["id"], first["id"]),
        (third["id"], second["id"]),
    ):
        stored = await client.responses.retrieve(rid)
        assert stored.previous_response_id == prev
    events = [
        e
        async for e in await client.responses.create(
            model="m", input="4", previous_response_id=third["id"], stream=True
        )
    ]
    assert all(
        e.response.previous_response_id == third["id"] for e in events if e.type in RESPONSE_EVENTS
    )
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(
            handle.base_url + "/responses", headers={"Authorization": f"Bearer {KEY}"}
        ) as ws,
    ):
        frame = {"type": "response.create", "model": "m", "input": "5"}
        await ws.send_str(orjson.dumps({**frame, "previous_response_id": third["id"]}).decode())
        kinds = []
        while not kinds or kinds[-1] != "response.completed":
            async with asyncio.timeout(5):
                event = orjson.loads((await ws.receive()).data)
            kinds.append(event["type"])
            if event["type"] in RESPONSE_EVENTS:
                assert event["response"]["previous_response_id"] == third["id"], event
        assert [k for k in kinds if k in RESPONSE_EVENTS] == list(RESPONSE_EVENTS)
