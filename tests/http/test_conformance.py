"""Every Response and event the proxy emits is valid against the Open Responses schema
(CONTRACT.md C1.9), whatever the backend left out: the JSON answer of a create, each
event of a stream (repaired or not), a continuation, GET, an idempotent replay, WebSocket
frames, a conversation's turn. The checks are tests/openresponses.py's, the rules the
official compliance suite validates with. What reaches the backend is unchanged: the
envelope is not input."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from ocxproxy.continuation import envelope
from tests.conftest import MakeProxy, ProxyHandle
from tests.continuation.envelope_state import python_paths
from tests.fakes.backend import FakeBackend
from tests.fakes.chat_backend import ChatBackend
from tests.http.helpers import assert_append_only, sse_payloads
from tests.openresponses import event_problems, response_problems

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
BODY: dict[str, Any] = {
    "model": "smollm2",
    "input": "Count from 1 to 3.",
    "instructions": "Be brief.",
    "tools": [TOOL],
    "temperature": 0.5,
    "metadata": {"run": "1"},
}
ENVELOPE_ONLY = (b"frequency_penalty", b"top_logprobs", b"service_tier", b"completed_at")


@pytest.fixture(autouse=True, params=["compiled", "python"])
def fast_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on the envelope's compiled fast paths (ocxproxy/_speedups.c) and on
    the Python's."""
    if request.param == "python":
        python_paths(monkeypatch)
    elif envelope._c is None:
        pytest.skip("the compiled fast paths are not built here")


@pytest.fixture(params=["spec", "llama", "chat"])
async def any_proxy(
    request: pytest.FixtureRequest, make_proxy: MakeProxy
) -> AsyncIterator[ProxyHandle]:
    """The proxy in front of a Responses backend with a complete stream, one with
    llama.cpp's incomplete stream, and a Chat Completions backend."""
    if request.param == "chat":
        async with ChatBackend() as chat:
            yield await make_proxy(chat.url, upstream_dialect=("chat",))
        return
    async with FakeBackend(stream_style=request.param) as fake:
        yield await make_proxy(fake.url)


async def create(
    http: aiohttp.ClientSession, handle: ProxyHandle, body: dict[str, Any], **headers: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The terminal Response of a create, and every event when it streamed."""
    async with http.post(handle.base_url + "/responses", json=body, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    if not body.get("stream"):
        return orjson.loads(raw), []
    events = sse_payloads(raw)
    return events[-1]["response"], events


def problems_of(response: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    return response_problems(response) + [p for e in events for p in event_problems(e)]


@pytest.mark.parametrize("stream", [False, True])
async def test_creates_and_continuations_are_valid(
    any_proxy: ProxyHandle, http: aiohttp.ClientSession, stream: bool
) -> None:
    first, events = await create(http, any_proxy, {**BODY, "stream": stream})
    assert problems_of(first, events) == []
    assert first["instructions"] == "Be brief." and first["temperature"] == 0.5
    assert first["tools"][0]["name"] == "get_weather" and first["metadata"] == {"run": "1"}
    assert first["previous_response_id"] is None and first["model"]
    assert isinstance(first["completed_at"], int)
    if events:
        assert events[0]["response"]["completed_at"] is None
    body = {"model": "smollm2", "input": "And on?", "previous_response_id": first["id"]}
    second, events = await create(http, any_proxy, {**body, "stream": stream})
    assert problems_of(second, events) == []
    assert second["previous_response_id"] == first["id"]
    assert second["tools"] == [] and second["instructions"] is None  # only items carry over
    async with http.get(f"{any_proxy.base_url}/responses/{second['id']}") as resp:
        stored = await resp.json()
    assert response_problems(stored) == []
    assert stored == second


async def test_what_the_backend_sees_is_unchanged(
    make_proxy: MakeProxy, llama_backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    """The envelope is not input: a continuation's forwarded input is the previous one's
    bytes plus the output as the backend gave it, and carries no envelope member."""
    handle = await make_proxy(llama_backend.url)
    response, _ = await create(http, handle, {**BODY, "stream": True})
    for text in ("two", "three"):
        body = {"model": "m", "input": text, "previous_response_id": response["id"]}
        response, _ = await create(http, handle, {**body, "stream": True})
    bodies = [seen.body for seen in llama_backend.responses_seen]
    assert_append_only(bodies[1:])  # (the first turn's input is a string)
    for forwarded in bodies:
        assert not any(member in forwarded for member in ENVELOPE_ONLY), forwarded


@pytest.mark.parametrize("stream", [False, True])
async def test_an_idempotent_replay_is_valid(
    proxy: ProxyHandle, http: aiohttp.ClientSession, stream: bool
) -> None:
    body = {**BODY, "stream": stream}
    first, _ = await create(http, proxy, body, **{"Idempotency-Key": f"k-{stream}"})
    again, events = await create(http, proxy, body, **{"Idempotency-Key": f"k-{stream}"})
    assert again["id"] == first["id"]
    assert problems_of(again, events) == []


async def test_websocket_frames_are_valid(
    make_proxy: MakeProxy, llama_backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(llama_backend.url)
    url = handle.base_url.replace("http://", "ws://") + "/responses"
    async with http.ws_connect(url) as ws:
        frames: list[dict[str, Any]] = []
        previous = None
        for create_event in (
            {"type": "response.create", **BODY, "store": False},
            {"type": "response.create", "model": "m", "input": "more", "store": False},
            {"type": "response.create", "model": "m", "input": "warm", "generate": False},
        ):
            if previous is not None:
                create_event["previous_response_id"] = previous
            await ws.send_str(orjson.dumps(create_event).decode())
            while True:
                frame = orjson.loads((await ws.receive()).data)
                frames.append(frame)
                if frame["type"] in ("response.completed", "error"):
                    break
            assert frame["type"] == "response.completed", frame
            previous = frame["response"]["id"]
    assert [p for f in frames for p in event_problems(f)] == []
    completed = [f["response"] for f in frames if f["type"] == "response.completed"]
    assert completed[1]["previous_response_id"] == completed[0]["id"]
    assert completed[0]["store"] is False and completed[0]["temperature"] == 0.5


async def test_a_conversation_turn_is_valid(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    async with http.post(proxy.base_url + "/conversations", json={}) as resp:
        conversation = (await resp.json())["id"]
    for stream in (False, True):
        body = {**BODY, "conversation": conversation, "stream": stream}
        response, events = await create(http, proxy, body)
        assert problems_of(response, events) == []
        assert response["conversation"] == {"id": conversation}


async def test_a_served_model_name_is_what_clients_see(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    """The backend's own name (here fake-model's, often a path) never reaches a client:
    responses and /v1/models show the served names."""
    handle = await make_proxy(backend.url, served_model_name=("smollm2", "small"))
    for requested, shown in (("small", "small"), ("gpt-4o", "smollm2")):
        for stream in (False, True):
            body = {"model": requested, "input": "hi", "stream": stream}
            response, events = await create(http, handle, body)
            assert response["model"] == shown
            assert all(e["response"]["model"] == shown for e in events if "response" in e)
    async with http.get(handle.base_url + "/models") as resp:
        assert resp.status == 200
        listing = await resp.json()
    assert [m["id"] for m in listing["data"]] == ["smollm2", "small"]
    assert b"fake-model" not in orjson.dumps(listing)


# -- every error the proxy emits carries a string code -------------------------------------

NULL_CODE = {"message": "the model failed", "type": "server_error", "param": None, "code": None}


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (500, {"error": NULL_CODE}, "server_error"),
        (400, {"error": {**NULL_CODE, "type": "invalid_request_error"}}, "invalid_request_error"),
        (429, {"error": {**NULL_CODE, "code": 429}}, "rate_limit_exceeded"),
        (503, {"detail": "overloaded"}, "server_error"),  # not OpenAI's shape
    ],
)
async def test_a_backend_error_without_a_string_code_gets_one(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    status: int,
    body: dict[str, Any],
    code: str,
) -> None:
    handle = await make_proxy(backend.url)
    backend.fail_next(status, body)
    async with http.post(handle.base_url + "/responses", json=BODY) as resp:
        assert resp.status == status and resp.content_type == "application/json"
        error = (await resp.json())["error"]
    assert error["code"] == code and isinstance(error["message"], str)


async def test_a_backend_error_with_a_code_is_relayed_as_it_is(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    given = {"error": {**NULL_CODE, "code": "model_overloaded"}, "extra": 1}
    backend.fail_next(503, given)
    async with http.post(handle.base_url + "/responses", json=BODY) as resp:
        assert resp.status == 503 and await resp.json() == given


@pytest.mark.parametrize("nested", [True, False])
async def test_a_streamed_backend_error_gets_a_string_code(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession, nested: bool
) -> None:
    """A backend's SSE `error` event, its error object nested (Open Responses) or flat
    (OpenAI's), with a null code: relayed with a string code, over HTTP and WebSocket."""
    handle = await make_proxy(backend.url)
    payload: dict[str, Any] = {"error": NULL_CODE} if nested else NULL_CODE
    backend.error_event_next(2, payload)
    async with http.post(handle.base_url + "/responses", json={**BODY, "stream": True}) as resp:
        events = sse_payloads(await resp.read())
    error = events[-1]
    assert error["type"] == "error" and [e["type"] for e in events[:2]] == [
        "response.created",
        "response.in_progress",
    ]
    assert event_problems(error) == []
    if nested:
        assert error["error"] == {**NULL_CODE, "code": "server_error"}
    else:
        assert error["code"] == "server_error" and error["message"] == NULL_CODE["message"]
    backend.error_event_next(2, payload)
    url = handle.base_url.replace("http://", "ws://") + "/responses"
    async with http.ws_connect(url) as ws:
        await ws.send_str(orjson.dumps({"type": "response.create", **BODY}).decode())
        while (frame := orjson.loads((await ws.receive()).data))["type"] != "error":
            pass
    assert event_problems(frame) == []
    assert frame["error"]["code"] == "server_error"
    assert frame["error"]["message"] == NULL_CODE["message"]


async def test_the_proxys_own_errors_carry_a_code(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    """An error raised with no code of its own (a malformed item, a body that is not
    JSON)."""
    item_body = orjson.dumps({"model": "m", "input": [{"type": "item_reference"}]})
    for data in (item_body, b"{not json"):
        async with http.post(proxy.base_url + "/responses", data=data) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_request_error"


async def test_a_chat_backends_error_carries_a_code(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    async with ChatBackend() as chat:
        handle = await make_proxy(chat.url, upstream_dialect=("chat",))
        chat.fail_next(500, {"object": "error", "message": "boom", "code": None})
        async with http.post(handle.base_url + "/responses", json=BODY) as resp:
            assert resp.status == 500
            error = (await resp.json())["error"]
    assert error["code"] == "server_error" and error["message"] == "boom"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stored_response_is_complete_whatever_the_backends_json_style(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, stream: bool
) -> None:
    """A backend that escapes non-ASCII text (Python's json.dumps does) writes its output
    items in other bytes than the proxy's encoder: the Response kept for GET is then
    encoded from the parsed one, and must carry the envelope all the same."""
    item = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "héllo", "annotations": []}],
    }
    answer = {"id": "resp_ascii", "object": "response", "created_at": 1, "status": "completed"}
    answer |= {"model": "m", "output": [item], "error": None, "incomplete_details": None}

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()  # \u00e9, not UTF-8

    async def respond(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.Response(body=dumps(answer), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n, kind in enumerate(("response.created", "response.completed")):
            event = {"type": kind, "response": answer, "sequence_number": n}
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/responses", respond)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        handle = await make_proxy(f"http://127.0.0.1:{runner.addresses[0][1]}")
        first, events = await create(http, handle, {**BODY, "stream": stream})
        assert problems_of(first, events) == []
        async with http.get(f"{handle.base_url}/responses/{first['id']}") as resp:
            stored = await resp.json()
    finally:
        await runner.cleanup()
    assert response_problems(stored) == []
    assert stored["instructions"] == "Be brief." and stored["tools"][0]["name"] == "get_weather"
    assert stored["output"][0]["content"][0]["text"] == "héllo"
