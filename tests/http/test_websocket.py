"""WebSocket mode (CONTRACT.md C3) over real sockets: the store matrix, Codex's warm-up +
incremental pattern, FIFO turns, limits, disconnects and malformed frames."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ocxproxy.continuation.envelope import Envelope
from ocxproxy.http.websocket import (
    TURN_ROUTE,
    backend_error_event,
    parse_frame,
    warmup_response,
)
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.store.helpers import all_bytes_under

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")
Json = dict[str, Any]


async def connect(
    http: aiohttp.ClientSession, handle: ProxyHandle, api_key: str = "sk-test-a"
) -> aiohttp.ClientWebSocketResponse:
    return await http.ws_connect(
        handle.base_url + "/responses", headers={"Authorization": f"Bearer {api_key}"}
    )


async def receive(ws: aiohttp.ClientWebSocketResponse) -> Json:
    async with asyncio.timeout(5):
        msg = await ws.receive()
    assert msg.type is aiohttp.WSMsgType.TEXT, msg
    event: Json = orjson.loads(msg.data)
    return event


async def events_of_turn(ws: aiohttp.ClientWebSocketResponse) -> list[Json]:
    events = [await receive(ws)]
    while events[-1]["type"] not in TERMINAL:
        events.append(await receive(ws))
    return events


async def send(ws: aiohttp.ClientWebSocketResponse, **fields: Any) -> None:
    await ws.send_str(orjson.dumps({"type": "response.create", **fields}).decode())


async def create(ws: aiohttp.ClientWebSocketResponse, **fields: Any) -> list[Json]:
    await send(ws, **fields)
    return await events_of_turn(ws)


def completed(events: list[Json]) -> Json:
    assert events[-1]["type"] == "response.completed", events[-1]
    response: Json = events[-1]["response"]
    return response


def text_of(response: Json) -> str:
    text: str = response["output"][0]["content"][0]["text"]
    return text


def error_of(events: list[Json], status: int = 400) -> Json:
    assert events[-1]["type"] == "error", events[-1]
    assert events[-1]["status"] == status, events[-1]
    error: Json = events[-1]["error"]
    assert set(error) >= {"type", "code", "message", "param"}
    return error


def msg(role: str, text: str) -> Json:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def forwarded_input(raw: bytes) -> bytes:
    """The `input` array's items as forwarded (an expanded body ends with the input)."""
    start = raw.index(b'"input":[') + len(b'"input":[')
    assert raw.endswith(b"]}")
    return raw[start:-2]


class CloseLog(logging.Handler):
    """Counts the proxy's "websocket closed" log lines: its side of a socket ends a moment
    after the client sees the close."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = 0
        self.changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("websocket closed"):
            self.closed += 1
            self.changed.set()

    async def wait(self, count: int) -> None:
        async with asyncio.timeout(5):
            while self.closed < count:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
def closes() -> Iterator[CloseLog]:
    logger = logging.getLogger("ocxproxy.websocket")
    handler, level = CloseLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


# -- the store matrix (CONTRACT.md C3 seed case), through the official SDK ------------------


async def sdk_turn(conn: Any, **fields: Any) -> list[Any]:
    await conn.response.create(**fields)
    events: list[Any] = []
    async with asyncio.timeout(5):
        while not events or events[-1].type not in TERMINAL:
            events.append(await conn.recv())
    return events


async def test_sdk_store_true_resolves_on_same_and_new_connection(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url)
    client = handle.client()
    async with client.responses.connect() as conn:
        first = await sdk_turn(conn, model="m", input="hello", store=True)
        assert first[-1].type == "response.completed"
        assert [e.sequence_number for e in first] == list(range(len(first)))
        r1 = first[-1].response
        assert r1.output_text == "echo#1: hello"
        second = await sdk_turn(conn, model="m", input="again", previous_response_id=r1.id)
        assert second[-1].response.output_text == "echo#3: again"
    async with client.responses.connect() as conn:
        third = await sdk_turn(conn, model="m", input="later", previous_response_id=r1.id)
        assert third[-1].response.output_text == "echo#3: later"
    # store:true turns are the shared store's: HTTP sees them too
    stored = await client.responses.retrieve(r1.id)
    assert stored.id == r1.id
    assert all("previous_response_id" not in s.json for s in backend.responses_seen)
    assert all(s.json["stream"] is True for s in backend.responses_seen)


async def test_sdk_store_false_resolves_only_on_the_same_connection(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url)
    client = handle.client()
    async with client.responses.connect() as conn:
        r1 = (await sdk_turn(conn, model="m", input="hello", store=False))[-1].response
        events = await sdk_turn(
            conn, model="m", input="again", store=False, previous_response_id=r1.id
        )
        assert events[-1].response.output_text == "echo#3: again"
    seen = len(backend.responses_seen)
    async with client.responses.connect() as conn:
        events = await sdk_turn(
            conn, model="m", input="later", store=False, previous_response_id=r1.id
        )
        assert events[-1].type == "error"
        assert events[-1].status == 400
        assert events[-1].error.code == "previous_response_not_found"
        assert events[-1].error.param == "previous_response_id"
        assert r1.id in events[-1].error.message
        # the socket stays open: a fresh request on it works
        fresh = await sdk_turn(conn, model="m", input="fresh", store=False)
        assert fresh[-1].response.output_text == "echo#1: fresh"
    assert len(backend.responses_seen) == seen + 1  # the failed continuation sent nothing


async def test_new_connection_without_previous_id_recalls_nothing(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        completed(await create(ws, model="m", input="one", store=True))
        completed(await create(ws, model="m", input="two", store=False))
    async with await connect(http, handle) as ws:
        response = completed(await create(ws, model="m", input="three", store=False))
        assert text_of(response) == "echo#1: three"
    assert backend.responses_seen[-1].json["input"] == "three"


async def test_store_false_never_reaches_disk_the_shared_store_or_http(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    handle = await make_proxy(backend.url)
    secret = "MARKER-ws-store-false-7f3a"
    async with await connect(http, handle) as ws:
        kept = completed(await create(ws, model="m", input="public", store=True))
        hidden = completed(await create(ws, model="m", input=secret, store=False))
        warm = completed(
            await create(ws, model="m", input=secret + "-warm", store=False, generate=False)
        )
        more = await create(
            ws, model="m", input="more", store=False, previous_response_id=hidden["id"]
        )
        chained = completed(more)
        assert text_of(chained) == "echo#3: more"
        assert warm["store"] is False
    store = handle.proxy.store
    assert len(store) == 1  # only the store:true turn is shared
    auth = {"Authorization": "Bearer sk-test-a"}
    async with http.get(f"{handle.base_url}/responses/{kept['id']}", headers=auth) as r:
        assert r.status == 200
    for response_id in (hidden["id"], warm["id"], chained["id"]):
        async with http.get(f"{handle.base_url}/responses/{response_id}", headers=auth) as r:
            assert r.status == 404  # not the proxy's: forwarded, and the backend has none
    await handle.server.close()  # graceful shutdown: whatever is flushed is flushed now
    assert store.check() == []
    on_disk = await asyncio.to_thread(all_bytes_under, tmp_path / "state")  # .zst opened
    assert b'"public"' in on_disk  # the scan does see what was stored
    for needle in (b"MARKER-ws-store-false", b"echo#3: more"):
        assert needle not in on_disk


# -- Codex's pattern -------------------------------------------------------------------------


async def test_codex_warm_up_then_incremental_store_false_turns(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    common: Json = {
        "model": "m",
        "instructions": "You are Codex.",
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
    }
    history = [msg("developer", "be brief"), msg("user", "CALL:get_weather Paris")]
    async with await connect(http, handle) as ws:
        warm_events = await create(ws, **common, input=history, generate=False)
        assert [e["type"] for e in warm_events] == [
            "response.created",
            "response.in_progress",
            "response.completed",
        ]
        assert [e["sequence_number"] for e in warm_events] == [0, 1, 2]
        warm = completed(warm_events)
        assert warm["id"].startswith("resp_") and warm["output"] == []
        assert warm["usage"]["total_tokens"] == 0
        assert backend.responses_seen == []  # a warm-up generates nothing

        call_turn = completed(await create(ws, **common, input=[], previous_response_id=warm["id"]))
        call = call_turn["output"][0]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        history += call_turn["output"]

        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        tool_turn = completed(
            await create(ws, **common, input=[output], previous_response_id=call_turn["id"])
        )
        assert text_of(tool_turn) == "echo#4: tool said sunny"
        history += [output, *tool_turn["output"]]

        thanks = msg("user", "thanks")
        last = completed(
            await create(ws, **common, input=[thanks], previous_response_id=tool_turn["id"])
        )
        assert text_of(last) == "echo#6: thanks"
        history.append(thanks)

    bodies = [s.body for s in backend.responses_seen]
    assert len(bodies) == 3
    for raw in bodies:
        body = orjson.loads(raw)
        assert "previous_response_id" not in body and "generate" not in body and "type" not in body
        assert body["instructions"] == "You are Codex." and body["tools"] == tools
        assert body["stream"] is True and body["store"] is False
    assert [len(orjson.loads(raw)["input"]) for raw in bodies] == [2, 4, 6]
    assert orjson.loads(bodies[-1])["input"] == history
    # append-only: each forwarded history is a byte prefix of the next one
    inputs = [forwarded_input(raw) for raw in bodies]
    for before, after in itertools.pairwise(inputs):
        assert after.startswith(before + b",")

    # Codex on a new socket: the store:false id is unknown there, so it resends everything
    seen = len(backend.responses_seen)
    async with await connect(http, handle) as ws:
        missing = await create(ws, **common, input=[], previous_response_id=last["id"])
        assert error_of(missing)["code"] == "previous_response_not_found"
        assert len(backend.responses_seen) == seen
        again = completed(await create(ws, **common, input=history))
        assert text_of(again) == "echo#6: thanks"
    assert orjson.loads(backend.responses_seen[-1].body)["input"] == history


async def test_warm_up_chains_from_a_previous_turn(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        first = completed(await create(ws, model="m", input="one", store=False))
        warm = completed(
            await create(
                ws, model="m", input="two", store=False, generate=False,
                previous_response_id=first["id"],
            )
        )  # fmt: skip
        assert warm["previous_response_id"] == first["id"]
        after = completed(
            await create(ws, model="m", input="three", store=False, previous_response_id=warm["id"])
        )
        assert text_of(after) == "echo#4: three"
    assert handle.metric("ocxproxy_websocket_cache_total", result="hit") == 2
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="warmup") == 1


# -- ordering, limits, disconnects -----------------------------------------------------------


async def test_back_to_back_frames_run_fifo(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    backend.delay = 0.01
    async with await connect(http, handle) as ws:
        frames = [
            orjson.dumps({"type": "response.create", "model": "m", "input": word}).decode()
            for word in ("one", "two", "three")
        ]
        await asyncio.gather(*(ws.send_str(frame) for frame in frames))
        turns = [await events_of_turn(ws) for _ in frames]
    for events, word in zip(turns, ("one", "two", "three"), strict=True):
        assert events[0]["type"] == "response.created"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert text_of(completed(events)) == f"echo#1: {word}"
        ids = {e["response"]["id"] for e in events if "response" in e}
        assert len(ids) == 1  # no event of another turn in between
    assert [s.json["input"] for s in backend.responses_seen] == ["one", "two", "three"]


async def test_queue_overflow_is_an_error_event_not_a_close(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    backend.stall_next(0.5)
    async with await connect(http, handle) as ws:
        await send(ws, model="m", input="first")
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        for i in range(19):  # 16 wait in the queue, 3 overflow
            await send(ws, model="m", input=f"q{i}")
        outcomes: list[str] = []
        while len([o for o in outcomes if o == "response.completed"]) < 17:
            event = await receive(ws)
            if event["type"] in TERMINAL:
                outcomes.append(event["type"])
                if event["type"] == "error":
                    assert event["status"] == 429
    assert outcomes.count("error") == 3
    assert len(backend.responses_seen) == 17


async def test_connection_lifetime_limit(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    closes: CloseLog,
) -> None:
    handle = await make_proxy(backend.url, ws_max_age=0.5)
    async with await connect(http, handle) as ws:
        completed(await create(ws, model="m", input="quick"))
        event = await receive(ws)
        assert event == {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_connection_limit_reached",
                "message": "Responses websocket connection limit reached (0.5 seconds). "
                "Create a new websocket connection to continue.",
                "param": None,
            },
        }
        async with asyncio.timeout(5):
            closing = await ws.receive()
        assert closing.type is aiohttp.WSMsgType.CLOSE
        assert closing.data == 1000
    await closes.wait(1)
    assert handle.metric("ocxproxy_websocket_connections") == 0


async def test_lifetime_limit_cancels_the_turn_in_flight(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url, ws_max_age=0.5)
    backend.stall_next(10)
    async with await connect(http, handle) as ws:
        await send(ws, model="m", input="slow")
        error = error_of(await events_of_turn(ws))
        assert error["code"] == "websocket_connection_limit_reached"
        await backend.wait_for(lambda: backend.cancelled == 1)
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="cancelled") == 1


async def test_frames_over_the_size_limit_close_the_socket(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url, max_body_bytes=1000)
    async with await connect(http, handle) as ws:
        await send(ws, model="m", input="x" * 2000)
        async with asyncio.timeout(5):
            closing = await ws.receive()
        assert closing.type is aiohttp.WSMsgType.CLOSE
        assert closing.data == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    async with await connect(http, handle) as ws:
        completed(await create(ws, model="m", input="small"))
    assert len(backend.responses_seen) == 1


async def test_client_disconnect_cancels_the_backend_request(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    closes: CloseLog,
) -> None:
    handle = await make_proxy(backend.url)
    # waiting for the backend's headers, the client closes the socket
    backend.stall_next(10)
    ws = await connect(http, handle)
    await send(ws, model="m", input="slow")
    await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    await ws.close()
    await backend.wait_for(lambda: backend.cancelled == 1)

    # mid-stream, the client's connection drops without a close frame
    backend.delay = 0.2
    ws = await connect(http, handle)
    await send(ws, model="m", input="streaming")
    assert (await receive(ws))["type"] == "response.created"
    assert ws._response.connection is not None
    transport = ws._response.connection.transport
    assert transport is not None
    transport.abort()
    await backend.wait_for(lambda: backend.cancelled == 2)
    await ws.close()

    backend.delay = 0.0
    async with await connect(http, handle) as ws:
        assert text_of(completed(await create(ws, model="m", input="still here"))) == (
            "echo#1: still here"
        )
    await closes.wait(3)
    assert handle.metric("ocxproxy_websocket_connections") == 0
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="cancelled") == 2
    assert handle.proxy.pool.backends[0].in_flight == 0


async def test_server_shutdown_closes_open_sockets(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    ws = await connect(http, handle)
    completed(await create(ws, model="m", input="hi"))
    await handle.server.close()
    async with asyncio.timeout(5):
        msg = await ws.receive()
    assert msg.type is aiohttp.WSMsgType.CLOSE
    assert msg.data == 1001  # going away: clients may reconnect elsewhere
    await ws.close()


# -- errors are events -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        ("not json", "invalid_json", None),
        ("[1, 2]", "invalid_frame", None),
        ('"response.create"', "invalid_frame", None),
        ('{"type": "response.cancel"}', "unknown_event_type", "type"),
        ('{"model": "m"}', "unknown_event_type", "type"),
        ('{"type": "response.create", "background": true}', "unsupported_parameter", "background"),
        ('{"type": "response.create", "stream_id": "lane"}', "unsupported_parameter", "stream_id"),
        ('{"type": "response.create", "generate": "no"}', "invalid_type", "generate"),
        ('{"type": "response.create", "stream": 1}', "invalid_type", "stream"),
        ('{"type": "response.create", "store": "yes"}', "invalid_type", "store"),
        ('{"type": "response.create", "input": 5}', "invalid_type", "input"),
        ('{"type": "response.create", "previous_response_id": 7}', "invalid_type", None),
        (
            '{"type": "response.create", "previous_response_id": "resp_x", "conversation": "c"}',
            "mutually_exclusive_parameters",
            "previous_response_id",
        ),
        (  # an error with no code of its own: its type, never null
            '{"type": "response.create", "input": [{"type": "item_reference"}]}',
            "invalid_request_error",
            "input",
        ),
    ],
)
async def test_malformed_frames_are_error_events(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    frame: str,
    code: str,
    param: str | None,
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        await ws.send_str(frame)
        error = error_of(await events_of_turn(ws))
        assert error["code"] == code
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param
        # the socket stays open and the next frame is served
        completed(await create(ws, model="m", input="ok"))
    assert len(backend.responses_seen) == 1


async def test_binary_frames_and_unknown_ids_are_error_events(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        await ws.send_bytes(orjson.dumps({"type": "response.create", "input": "x"}))
        assert error_of(await events_of_turn(ws))["code"] == "invalid_frame"
        missing = await create(ws, model="m", input="x", previous_response_id="resp_nope")
        error = error_of(missing)
        assert error == {
            "type": "invalid_request_error",
            "code": "previous_response_not_found",
            "message": "Previous response with id 'resp_nope' not found.",
            "param": "previous_response_id",
        }
        completed(await create(ws, model="m", input="ok"))
    async with http.get(handle.url + "/healthz") as r:
        assert r.status == 200
    assert handle.metric("ocxproxy_websocket_cache_total", result="miss") == 1


async def test_failed_turn_evicts_the_continued_id(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        base = completed(await create(ws, model="m", input="base", store=False))
        backend.fail_next(500)
        error = error_of(
            await create(ws, model="m", input="x", store=False, previous_response_id=base["id"]),
            status=500,
        )
        assert error["type"] == "server_error"
        assert error["message"] == "fake: scripted failure 500"
        again = await create(ws, model="m", input="y", store=False, previous_response_id=base["id"])
        assert error_of(again)["code"] == "previous_response_not_found"
        # a failed turn without a previous id evicts nothing
        other = completed(await create(ws, model="m", input="other", store=False))
        refusal = {"message": "bad", "type": "invalid_request_error", "param": "model"}
        backend.fail_next(400, {"error": {**refusal, "code": "model_not_found"}})
        error = error_of(await create(ws, model="m", input="z", store=False))
        assert error == {
            "type": "invalid_request_error",
            "code": "model_not_found",
            "message": "bad",
            "param": "model",
        }
        ok = await create(ws, model="m", input="w", store=False, previous_response_id=other["id"])
        assert text_of(completed(ok)) == "echo#3: w"
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="backend_error") == 2


async def test_backend_breaking_off_mid_stream_is_an_error_event(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        base = completed(await create(ws, model="m", input="base", store=False))
        backend.hang_up_next(3)
        events = await create(ws, model="m", input="x", previous_response_id=base["id"])
        assert [e["type"] for e in events[:3]] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert error_of(events, status=502)["code"] == "upstream_error"
        again = await create(ws, model="m", input="y", store=False, previous_response_id=base["id"])
        assert error_of(again)["code"] == "previous_response_not_found"


@pytest.fixture
async def scripted_stream() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A backend that answers every create with the SSE bytes queued in the list."""
    script: list[bytes] = []

    async def respond(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(script.pop(0))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", respond)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), script
    await server.close()


async def test_streams_without_a_terminal_event_end_with_an_error_event(
    make_proxy: MakeProxy, scripted_stream: tuple[str, list[bytes]], http: aiohttp.ClientSession
) -> None:
    url, script = scripted_stream
    handle = await make_proxy(url)
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}}
    flat_error = {"type": "error", "code": "overloaded", "message": "busy", "param": None}
    script.append(b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
    script.append(
        b"data: " + orjson.dumps(created) + b"\n\n"
        b"event: error\ndata: " + orjson.dumps({**flat_error, "sequence_number": 1}) + b"\n\n"
    )
    async with await connect(http, handle) as ws:
        events = await create(ws, model="m", input="x")
        assert events[0]["response"]["id"] == "resp_1"  # (completed by the proxy)
        assert error_of(events, status=502)["code"] == "upstream_error"
        events = await create(ws, model="m", input="y")
        assert events[0]["response"]["id"] == "resp_1"
        assert events[1] == {
            "type": "error",
            "status": 500,
            "sequence_number": 1,
            "error": {
                "type": "server_error",
                "code": "overloaded",
                "message": "busy",
                "param": None,
            },
        }
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="failed") == 1
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="backend_error") == 1


async def test_unbound_tool_output_is_rejected_before_forwarding(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        base = completed(await create(ws, model="m", input="base", store=False))
        output = {"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}
        events = await create(ws, model="m", input=[output], previous_response_id=base["id"])
        assert error_of(events)["param"] == "input"
    assert len(backend.responses_seen) == 1


# -- handshake, scope, repair, metrics -------------------------------------------------------


async def test_plain_get_without_upgrade_is_forwarded(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with http.get(handle.base_url + "/responses") as r:
        assert r.status == 405  # the backend's answer, passed through
    assert [s.method for s in backend.seen if s.path == "/v1/responses"] == ["GET"]


async def test_client_keys_are_checked_on_the_upgrade(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url, api_keys=("sk-good",))
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await connect(http, handle, api_key="sk-bad")
    assert info.value.status == 401
    async with await connect(http, handle, api_key="sk-good") as ws:
        completed(await create(ws, model="m", input="hi"))
    assert backend.responses_seen[0].headers["Authorization"] == "Bearer sk-good"
    assert not any(k.lower().startswith("sec-websocket") for k in backend.responses_seen[0].headers)


async def test_stored_turns_are_scoped_to_the_credential(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle, api_key="sk-a") as ws:
        mine = completed(await create(ws, model="m", input="mine", store=True))
    async with await connect(http, handle, api_key="sk-b") as ws:
        events = await create(ws, model="m", input="x", previous_response_id=mine["id"])
        assert error_of(events)["code"] == "previous_response_not_found"


async def test_llama_streams_are_repaired_over_websocket(
    make_proxy: MakeProxy, llama_backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle = await make_proxy(llama_backend.url)
    async with await connect(http, handle) as ws:
        events = await create(ws, model="m", input="hi", store=False)
        first = completed(events)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert deltas and all("output_index" in e and "content_index" in e for e in deltas)
        after = completed(
            await create(ws, model="m", input="more", store=False, previous_response_id=first["id"])
        )
        assert text_of(after) == "echo#3: more"


async def test_metrics_count_connections_frames_turns_and_overhead_per_turn(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    closes: CloseLog,
) -> None:
    handle = await make_proxy(backend.url)
    async with await connect(http, handle) as ws:
        assert handle.metric("ocxproxy_websocket_connections") == 1
        events = await create(ws, model="m", input="one")
        await ws.send_str("nope")
        await events_of_turn(ws)
    await closes.wait(1)
    assert handle.metric("ocxproxy_websocket_connections") == 0
    assert handle.metric("ocxproxy_websocket_frames_total", direction="in") == 2
    assert handle.metric("ocxproxy_websocket_frames_total", direction="out") == len(events) + 1
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="completed") == 1
    assert handle.metric("ocxproxy_websocket_turns_total", outcome="rejected") == 1
    overhead = "ocxproxy_proxy_overhead_seconds_count"
    assert handle.metric(overhead, route=TURN_ROUTE) == 2
    assert handle.metric(overhead, route="/v1/responses") == 0  # not the connection's lifetime
    assert handle.metric("ocxproxy_requests_total", route="/v1/responses", outcome="101") == 1


async def test_openai_sdk_error_events_parse(make_proxy: MakeProxy, backend: FakeBackend) -> None:
    handle = await make_proxy(backend.url)
    async with handle.client().responses.connect() as conn:
        events = await sdk_turn(conn, model="m", input="x", previous_response_id="resp_gone")
        error = events[-1]
        assert error.type == "error" and error.status == 400
        assert error.error.code == "previous_response_not_found"


# -- pure helpers ----------------------------------------------------------------------------


def test_parse_frame_strips_client_only_fields_and_forces_stream() -> None:
    body, generate = parse_frame('{"type":"response.create","model":"m","generate":false}')
    assert body == {"model": "m", "stream": True}
    assert generate is False
    body, generate = parse_frame('{"type":"response.create","stream":false,"background":false}')
    assert body == {"stream": True, "background": False}
    assert generate is True


def test_warmup_response_echoes_the_request() -> None:
    response = warmup_response("resp_1", 123)
    body = {"model": "m", "instructions": "i", "store": False, "reasoning": {"effort": "low"}}
    Envelope(body).complete(response, final=True)  # as the exchange does before sending it
    assert response["status"] == "completed" and response["output"] == []
    assert response["store"] is False and response["instructions"] == "i"
    assert response["reasoning"] == {"effort": "low", "summary": None}
    assert response["model"] == "m" and response["created_at"] == 123
    assert response["usage"]["input_tokens"] == 0


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            503,
            b'{"error":{"message":"busy","type":"server_error","code":"overloaded"}}',
            {"type": "server_error", "code": "overloaded", "message": "busy", "param": None},
        ),
        (
            400,
            b'{"object":"error","message":"too long","type":"BadRequestError","code":400}',
            # a numeric code: the one its status stands for, never null
            {
                "type": "BadRequestError",
                "code": "invalid_request_error",
                "message": "too long",
                "param": None,
            },
        ),
        (
            404,
            b'{"detail":"Not Found"}',
            {
                "type": "invalid_request_error",
                "code": "invalid_request_error",
                "message": "Not Found",
                "param": None,
            },
        ),
        (
            502,
            b"<html>bad gateway</html>",
            {
                "type": "server_error",
                "code": "server_error",
                "message": "<html>bad gateway</html>",  # a text body is the message
                "param": None,
            },
        ),
    ],
)
def test_backend_error_keeps_status_and_openai_details(
    status: int, body: bytes, expected: Json
) -> None:
    assert backend_error_event(status, body) == {
        "type": "error",
        "status": status,
        "error": expected,
    }


def test_backend_error_for_a_non_streaming_200() -> None:
    event = backend_error_event(200, b"{}")
    assert event["status"] == 502 and event["error"]["code"] == "upstream_error"
