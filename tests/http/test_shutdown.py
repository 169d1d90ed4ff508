"""The graceful stop (what SIGTERM starts): requests and WebSocket turns in flight finish
within --shutdown-timeout, or end with a `server_shutting_down` error that says why (a
503, or an `error` event closing the stream), and the access log calls them `shutdown`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from ocxproxy.aio import spawn
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.test_websocket import connect, events_of_turn, receive, send
from tests.serve import Serve

Json = dict[str, Any]
BODY = {"model": "m", "input": "a long answer", "stream": True}


@pytest.fixture
async def slow() -> AsyncIterator[FakeBackend]:
    async with FakeBackend(delay=0.4) as backend:  # SSE events 0.4 s apart: ~3 s a stream
        yield backend


def access_lines(capsys: pytest.CaptureFixture[str]) -> list[Json]:
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


async def chunked() -> AsyncIterator[bytes]:
    yield orjson.dumps(BODY)  # a chunked body: served by aiohttp, not the front end


def sse_events(raw: bytes) -> list[Json]:
    return [orjson.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data:")]


@pytest.mark.parametrize("way", ["front", "aiohttp"])
async def test_a_stream_past_the_shutdown_timeout_ends_with_an_error_event(
    way: str,
    make_proxy: MakeProxy,
    slow: FakeBackend,
    capsys: pytest.CaptureFixture[str],
) -> None:
    handle = await make_proxy(slow.url, shutdown_timeout=0.5, access_log="json")
    data: Any = orjson.dumps(BODY) if way == "front" else chunked()
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            handle.base_url + "/responses",
            data=data,
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert b"response.created" in first
        closing = spawn(handle.server.close(), name="test-shutdown")
        async with asyncio.timeout(5):
            rest = await resp.content.read()
    async with asyncio.timeout(5):
        await closing
    events = sse_events(first + rest)
    assert events[-1]["type"] == "error", events[-1]
    assert events[-1]["code"] == "server_shutting_down"
    assert "shutting down" in events[-1]["message"]
    assert "response.completed" not in [e["type"] for e in events]
    [line] = access_lines(capsys)
    assert (line["outcome"], line["status"]) == ("shutdown", 503)
    assert handle.metric("ocxproxy_requests_total", route="/v1/responses", outcome="shutdown")


async def test_a_json_request_past_the_shutdown_timeout_gets_503(
    make_proxy: MakeProxy, backend: FakeBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = await make_proxy(backend.url, shutdown_timeout=0.3, access_log="json")
    backend.stall_next(10)
    async with aiohttp.ClientSession() as http:
        request = spawn(
            http.post(handle.base_url + "/responses", json={"model": "m", "input": "x"}),
            name="test-request",
        )
        await backend.wait_for(lambda: len(backend.seen) == 1)
        closing = spawn(handle.server.close(), name="test-shutdown")
        async with asyncio.timeout(5):
            async with await request as resp:
                assert resp.status == 503
                error = (await resp.json())["error"]
            await closing
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    [line] = access_lines(capsys)
    assert line["outcome"] == "shutdown"
    await backend.wait_for(lambda: backend.cancelled == 1)  # the backend's work stops too


async def test_a_stream_within_the_shutdown_timeout_finishes(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    handle = await make_proxy(backend.url, shutdown_timeout=30)
    backend.stall_next(1.5)
    async with aiohttp.ClientSession() as http:
        async with http.post(handle.base_url + "/responses", json=BODY) as resp:
            await backend.wait_for(lambda: len(backend.seen) == 1)
            closing = spawn(handle.server.close(), name="test-shutdown")
            raw = await resp.content.read()
        assert sse_events(raw)[-1]["type"] == "response.completed"
        async with asyncio.timeout(5):
            await closing


async def test_a_websocket_turn_in_flight_finishes_then_the_socket_closes(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    handle: ProxyHandle = await make_proxy(backend.url, shutdown_timeout=30)
    backend.stall_next(1.0)
    ws = await connect(http, handle)
    await send(ws, model="m", input="finish me")
    await backend.wait_for(lambda: len(backend.seen) == 1)
    closing = spawn(handle.server.close(), name="test-shutdown")
    await asyncio.sleep(0.1)
    await send(ws, model="m", input="too late")  # after the stop began: refused
    first = await events_of_turn(ws)
    assert first[-1]["type"] == "response.completed"
    second = await events_of_turn(ws)
    assert second[-1]["type"] == "error"
    assert second[-1]["error"]["code"] == "server_shutting_down"
    async with asyncio.timeout(5):
        msg = await ws.receive()
    assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1001
    async with asyncio.timeout(5):
        await closing
    assert len(backend.responses_seen) == 1


async def test_a_websocket_turn_past_the_shutdown_timeout_gets_an_error_event(
    make_proxy: MakeProxy,
    slow: FakeBackend,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    handle = await make_proxy(slow.url, shutdown_timeout=0.5, access_log="json")
    ws = await connect(http, handle)
    await send(ws, model="m", input="a long answer")
    assert (await receive(ws))["type"] == "response.created"
    closing = spawn(handle.server.close(), name="test-shutdown")
    events = await events_of_turn(ws)
    assert events[-1]["type"] == "error"
    assert events[-1]["status"] == 503
    assert events[-1]["error"]["code"] == "server_shutting_down"
    async with asyncio.timeout(5):
        msg = await ws.receive()
    assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1001
    async with asyncio.timeout(5):
        await closing
    [line] = access_lines(capsys)
    assert (line["method"], line["outcome"]) == ("WS", "shutdown")


async def test_sigterm_on_serve_cuts_a_long_stream_at_the_shutdown_timeout(
    tmp_path: Path, slow: FakeBackend, processes: list[Serve]
) -> None:
    """The real process: the flag, SIGTERM, the closing event, the access line, exit 0."""
    proxy = Serve(slow.url, tmp_path, "--shutdown-timeout", "1s", "--access-log", "json")
    processes.append(proxy)
    await proxy.start()
    async with (
        aiohttp.ClientSession() as http,
        http.post(proxy.url + "/v1/responses", json=BODY) as resp,
    ):
        first = await resp.content.readuntil(b"\n\n")
        os.kill(proxy.pid, signal.SIGTERM)
        async with asyncio.timeout(10):
            rest = await resp.content.read()
    assert await proxy.stop() == 0
    events = sse_events(first + rest)
    assert (events[-1]["type"], events[-1]["code"]) == ("error", "server_shutting_down")
    lines = [json.loads(line) for line in proxy.output if line.startswith("{")]
    assert [(line["outcome"], line["status"]) for line in lines] == [("shutdown", 503)]
