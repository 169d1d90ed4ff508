"""What `serve` relies on when it freezes its heap every second (ocxproxy/heap.py): the
HTTP readers of finished requests and answers are freed by reference counting. One left
in a reference cycle while frozen would stay in memory until the next full pass."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web

from ocxproxy.h1 import RequestParser, ResponseParser
from tests.conftest import MakeProxy
from tests.fakes.backend import FakeBackend
from tests.http.helpers import sse_payloads

READERS = (RequestParser, ResponseParser)


@pytest.fixture
def saved_garbage() -> Iterator[list[object]]:
    """What the cyclic GC finds from here on, kept in gc.garbage instead of freed."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def sockets_alive() -> int:
    return sum(isinstance(o, web.WebSocketResponse) for o in gc.get_objects())


def readers_alive() -> int:
    return sum(isinstance(o, READERS) for o in gc.get_objects())


async def test_finished_requests_and_answers_leave_no_reader_in_a_reference_cycle(
    make_proxy: MakeProxy, backend: FakeBackend, saved_garbage: list[object]
) -> None:
    handle = await make_proxy(backend.url)
    url = handle.base_url + "/responses"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json={"model": "m", "input": "one"}) as answer:
            first = (await answer.json())["id"]
        body = {"model": "m", "input": "two", "previous_response_id": first, "stream": True}
        async with http.post(url, json=body) as answer:
            assert sse_payloads(await answer.read())[-1]["type"] == "response.completed"
        backend.fail_next(500)
        async with http.post(url, json={"model": "m", "input": "refused"}) as answer:
            assert answer.status == 500
        backend.hang_up_next(after_events=1)
        async with http.post(url, json={"model": "m", "input": "cut", "stream": True}) as answer:
            await answer.read()
        backend.stall_next(10)  # the client gives up: the backend request is cancelled
        with contextlib.suppress(asyncio.TimeoutError):
            async with http.post(
                url,
                json={"model": "m", "input": "slow"},
                timeout=aiohttp.ClientTimeout(total=0.3),
            ) as answer:
                await answer.read()
        await backend.wait_for(lambda: backend.cancelled == 1)
    for _ in range(250):  # until the proxy has seen every connection go (or 5 s)
        if not readers_alive():
            break
        await asyncio.sleep(0.02)
    gc.collect()
    cyclic = [type(o).__name__ for o in saved_garbage if isinstance(o, READERS)]
    assert cyclic == []
    assert readers_alive() == 0


async def test_a_closed_websocket_leaves_nothing_of_aiohttp_or_ours_in_a_reference_cycle(
    make_proxy: MakeProxy, backend: FakeBackend, saved_garbage: list[object]
) -> None:
    handle = await make_proxy(backend.url)
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(handle.base_url + "/responses") as ws,
    ):
        await ws.send_json({"type": "response.create", "model": "m", "input": "hi"})
        while (await ws.receive_json())["type"] != "response.completed":
            pass
    for _ in range(250):  # until the proxy has seen the connection go (or 5 s)
        if not sockets_alive():
            break
        await asyncio.sleep(0.02)
    gc.collect()
    # asyncio's own selector transport is a cycle of its own (uvloop's, in `serve`, is not)
    cyclic = {type(o).__module__ + "." + type(o).__qualname__ for o in saved_garbage}
    assert sorted(k for k in cyclic if k.startswith(("aiohttp.", "ocxproxy."))) == []
    assert sockets_alive() == 0
