"""http/front.py: the hand-written HTTP/1.1 front end, spoken to over raw sockets so the
framing is exact. Plain `POST /v1/responses` is served there (keep-alive, pipelining,
dribbled bytes, errors); anything else is handed to aiohttp, which closes the connection
after its answer.

Which side answered: the `front_served` fixture counts the calls of front.create (the
front end's only way into `exchange.create`). The `Server:` header cannot tell: the
front end relays the backend's, and FakeBackend is an aiohttp server too. ScriptedPeer, a
lenient backend on a bare socket, shows byte for byte what the proxy forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from ocxproxy.aio import spawn
from ocxproxy.h1 import MAX_HEAD
from ocxproxy.http import front
from ocxproxy.http.exchange import create
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.fakes.scripted import ScriptedPeer, Step, json_answer
from tests.http.helpers import response_object, sse_payloads

MODELS = {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

# -- a raw HTTP/1.1 client ------------------------------------------------------------------


def turn(text: str, previous: str | None = None, *, stream: bool = False) -> bytes:
    body: dict[str, Any] = {"model": "m", "input": text}
    if previous is not None:
        body["previous_response_id"] = previous
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def post(body: bytes, *extra: str, length: bool = True) -> bytes:
    """A raw `POST /v1/responses` with a Content-Length (unless `length` is False)."""
    lines = ["POST /v1/responses HTTP/1.1", "Host: proxy", "Content-Type: application/json"]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    lines.extend(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Answer:
    status: int
    headers: CIMultiDict[str]
    body: bytes  # de-chunked

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def text(self) -> str:
        return str(self.json()["output"][0]["content"][0]["text"])


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """One HTTP/1.1 answer: body by Content-Length, chunked, or until the server closes."""
    async with asyncio.timeout(5):
        version, status, _ = (await reader.readuntil(b"\r\n")).decode().split(" ", 2)
        assert version in ("HTTP/1.1", "HTTP/1.0"), version  # aiohttp's 400s say 1.0
        headers: CIMultiDict[str] = CIMultiDict()
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, colon, value = line.decode().partition(":")
            assert colon, line
            headers.add(name, value.strip())
        body = b""
        if int(status) < 200:
            pass
        elif headers.get("Transfer-Encoding", "").lower() == "chunked":
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                body += await reader.readexactly(size)
                assert await reader.readexactly(2) == b"\r\n"
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
        elif "Content-Length" in headers:
            body = await reader.readexactly(int(headers["Content-Length"]))
        else:
            body = await reader.read()
    return Answer(int(status), headers, body)


class Raw:
    """One client connection to the proxy."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> Answer:
        return await read_answer(self.reader)

    async def ask(self, data: bytes) -> Answer:
        await self.send(data)
        return await self.answer()

    async def closed_by_server(self) -> bool:
        """True once the server has closed the connection (with no more bytes sent)."""
        async with asyncio.timeout(5):
            return await self.reader.read(1) == b""


def address(proxy: ProxyHandle) -> tuple[str, int]:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


@contextlib.asynccontextmanager
async def connect(proxy: ProxyHandle) -> AsyncIterator[Raw]:
    reader, writer = await asyncio.open_connection(*address(proxy))
    try:
        yield Raw(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.fixture
def front_served(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The request bodies the front end served itself, in order."""
    served: list[bytes] = []

    async def counting(proxy: Any, headers: Any, target: str, raw: bytes, *rest: Any) -> None:
        served.append(raw)
        await create(proxy, headers, target, raw, *rest)

    monkeypatch.setattr(front, "create", counting)
    return served


def raw_answer(*extra: bytes) -> list[Step]:
    """The scripted backend's standing answer: one fixed Responses JSON, then the close."""
    return [json_answer(response_object("resp_raw", "raw"), *extra, b"Connection: close"), None]


@pytest.fixture
async def raw_backend() -> AsyncIterator[ScriptedPeer]:
    async with ScriptedPeer(*raw_answer()) as peer:
        yield peer


def assert_openai_error(answer: Answer, status: int, code: str) -> dict[str, Any]:
    assert answer.status == status
    assert answer.headers["Content-Type"].startswith("application/json")
    body = answer.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == ("invalid_request_error", code)
    return dict(body["error"])


async def serves_a_create_on_the_front_end(proxy: ProxyHandle, served: list[bytes]) -> None:
    before = len(served)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("again")))
    assert (answer.status, answer.text) == (200, "echo#1: again")
    assert "Connection" not in answer.headers
    assert len(served) == before + 1


# -- served on the front end ----------------------------------------------------------------


async def test_keep_alive_chains_three_turns_on_one_connection(
    proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    previous: str | None = None
    ids = []
    async with connect(proxy) as conn:
        for text in ("one", "two", "three"):
            answer = await conn.ask(post(turn(text, previous)))
            assert answer.status == 200
            assert "Connection" not in answer.headers
            previous = answer.json()["id"]
            ids.append(previous)
    assert answer.text == "echo#5: three"
    assert front_served == [turn("one"), turn("two", ids[0]), turn("three", ids[1])]
    forwarded = backend.responses_seen[2].json
    assert "previous_response_id" not in forwarded
    assert [(item["role"], item["content"]) for item in forwarded["input"][::2]] == [
        ("user", "one"),
        ("user", "two"),
        ("user", "three"),
    ]
    assert forwarded["input"][1]["content"][0]["text"] == "echo#1: one"


async def test_pipelined_requests_are_answered_in_order(
    proxy: ProxyHandle, front_served: list[bytes]
) -> None:
    async with connect(proxy) as conn:
        await conn.send(post(turn("first")) + post(turn("second")))
        first, second = await conn.answer(), await conn.answer()
        assert (first.status, first.text) == (200, "echo#1: first")
        assert (second.status, second.text) == (200, "echo#1: second")
        third = await conn.ask(post(turn("third")))  # still open, nothing left over
        assert third.text == "echo#1: third"
    assert front_served == [turn("first"), turn("second"), turn("third")]


async def test_request_sent_while_one_is_in_flight_waits_its_turn(
    proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    backend.stall_next(0.3)
    async with connect(proxy) as conn:
        await conn.send(post(turn("slow")))
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        await conn.send(post(turn("quick")))
        first, second = await conn.answer(), await conn.answer()
    assert (first.text, second.text) == ("echo#1: slow", "echo#1: quick")
    assert [seen.body for seen in backend.responses_seen] == [turn("slow"), turn("quick")]
    assert front_served == [turn("slow"), turn("quick")]


async def test_bytes_pipelined_far_ahead_of_the_request_in_flight_are_not_all_buffered(
    make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    proxy = await make_proxy(backend.url, max_body_bytes=4096)
    (site,) = proxy.server.runner.sites
    assert isinstance(site, front.FrontSite)
    backend.stall_next(1.0)
    flood = post(b"x" * 4000) * 2000  # 8 MB of pipelined requests behind the stalled one
    async with connect(proxy) as conn:
        await conn.send(post(turn("slow")))
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        conn.writer.write(flood)
        await asyncio.sleep(0.5)  # the proxy reads until it pauses; the rest waits in TCP
        (connection,) = site.front.connections
        buffered = len(connection.buffer)
        assert connection.reading_paused
        assert buffered <= 4096 + MAX_HEAD + 1024 * 1024  # the bound, plus one read
        first = await conn.answer()
        assert first.text == "echo#1: slow"
        second = await conn.answer()  # reading resumed: the flood is served in turn
        assert second.status == 400  # "x..." is not JSON


async def test_request_dribbled_one_byte_at_a_time_is_served(
    proxy: ProxyHandle, front_served: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces: list[bytes] = []
    data_received = front.FrontConnection.data_received

    def recording(self: front.FrontConnection, data: bytes) -> None:
        pieces.append(data)
        data_received(self, data)

    monkeypatch.setattr(front.FrontConnection, "data_received", recording)
    request = post(turn("slowly"))
    async with connect(proxy) as conn:
        for i in range(len(request)):
            await conn.send(request[i : i + 1])
            await asyncio.sleep(0.001)
        answer = await conn.answer()
    assert (answer.status, answer.text) == (200, "echo#1: slowly")
    assert front_served == [turn("slowly")]
    assert b"".join(pieces) == request
    assert len(pieces) > len(request) // 2  # it really came in dribbles


async def test_connection_close_is_honoured(proxy: ProxyHandle, front_served: list[bytes]) -> None:
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("bye"), "Connection: close"))
        assert (answer.status, answer.text) == (200, "echo#1: bye")
        assert answer.headers["Connection"] == "close"
        assert await conn.closed_by_server()
    assert front_served == [turn("bye")]


async def test_bad_json_is_400_and_the_connection_serves_on(
    proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    async with connect(proxy) as conn:
        bad = await conn.ask(post(b'{"model": "m", "input": '))
        assert_openai_error(bad, 400, "invalid_request_error")
        assert "Connection" not in bad.headers
        assert backend.seen == []
        good = await conn.ask(post(turn("fine")))
        assert (good.status, good.text) == (200, "echo#1: fine")
    assert front_served == [b'{"model": "m", "input": ', turn("fine")]


async def test_stream_is_chunked_sse_and_the_connection_serves_on(
    proxy: ProxyHandle, front_served: list[bytes]
) -> None:
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("flow", stream=True)))
        assert answer.status == 200
        assert answer.headers["Transfer-Encoding"] == "chunked"
        assert "Content-Length" not in answer.headers
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        events = sse_payloads(answer.body)
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] == "response.completed"
        done = events[-1]["response"]
        assert done["output"][0]["content"][0]["text"] == "echo#1: flow"
        after = await conn.ask(post(turn("next", done["id"])))
        assert (after.status, after.text) == (200, "echo#3: next")
    assert len(front_served) == 2


async def test_openai_sdk_chains_through_the_front_end(
    proxy: ProxyHandle, front_served: list[bytes]
) -> None:
    client = proxy.client()
    first = await client.responses.create(model="m", input="sdk")
    second = await client.responses.create(model="m", input="more", previous_response_id=first.id)
    assert second.output_text == "echo#3: more"
    assert len(front_served) == 2


# -- handed over to aiohttp -----------------------------------------------------------------


async def test_other_request_is_handed_over_then_closed(
    proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    async with connect(proxy) as conn:
        created = await conn.ask(post(turn("hello")))
        assert (created.status, created.text) == (200, "echo#1: hello")
        models = await conn.ask(b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n")
        assert (models.status, models.json()) == (200, MODELS)
        assert models.headers["Connection"] == "close"
        assert await conn.closed_by_server()
    assert [seen.path for seen in backend.seen] == ["/v1/responses", "/v1/models"]
    assert len(front_served) == 1
    await serves_a_create_on_the_front_end(proxy, front_served)


async def test_body_over_the_limit_is_413_and_never_forwarded(
    backend: FakeBackend, make_proxy: MakeProxy, front_served: list[bytes]
) -> None:
    proxy = await make_proxy(backend.url, max_body_bytes=1000)
    big = turn("x" * 5000)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(big))
        error = assert_openai_error(answer, 413, "request_too_large")
        assert "1000" in error["message"]
        # aiohttp read the unread body away and kept the connection: it serves one more
        after = await conn.ask(post(turn("small")))
        assert (after.status, after.text) == (200, "echo#1: small")
        assert after.headers["Connection"] == "close"
        assert await conn.closed_by_server()
    assert [seen.body for seen in backend.seen] == [turn("small")]
    assert front_served == []
    await serves_a_create_on_the_front_end(proxy, front_served)


async def test_chunked_create_is_served_by_aiohttp_and_chains(
    proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    body = turn("chunky")
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    async with connect(proxy) as conn:
        answer = await conn.ask(post(chunked, "Transfer-Encoding: chunked", length=False))
        assert (answer.status, answer.text) == (200, "echo#1: chunky")
        assert answer.headers["Connection"] == "close"
        assert await conn.closed_by_server()
    assert backend.responses_seen[0].body == body
    assert front_served == []
    async with connect(proxy) as conn:
        after = await conn.ask(post(turn("then", answer.json()["id"])))
    assert (after.status, after.text) == (200, "echo#3: then")
    assert len(front_served) == 1


async def test_expect_100_continue_gets_the_interim_answer_first(
    proxy: ProxyHandle, front_served: list[bytes]
) -> None:
    request = post(turn("patient"), "Expect: 100-continue")
    head, body = request.split(b"\r\n\r\n", 1)
    async with connect(proxy) as conn:
        interim = await conn.ask(head + b"\r\n\r\n")
        assert (interim.status, interim.body) == (100, b"")
        await conn.send(body)
        answer = await conn.answer()
    assert (answer.status, answer.text) == (200, "echo#1: patient")
    assert answer.headers["Connection"] == "close"  # aiohttp's answer
    assert front_served == []


@pytest.mark.parametrize(
    "line",
    [b"NoColonHere", b"X-Spaced : value", b"X Spaced: value", b" folded-continuation"],
    ids=str,
)
async def test_malformed_header_line_is_400_and_the_connection_closes(
    line: bytes, proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    request = post(turn("odd"))
    head, body = request.split(b"\r\n\r\n", 1)
    async with connect(proxy) as conn:
        answer = await conn.ask(head + b"\r\n" + line + b"\r\n\r\n" + body)
        assert_openai_error(answer, 400, "invalid_request_error")
        assert answer.headers["Connection"] == "close"
        assert await conn.closed_by_server()
    assert backend.seen == []
    assert front_served == []
    await serves_a_create_on_the_front_end(proxy, front_served)


# -- shutdown and disconnects ---------------------------------------------------------------


async def test_graceful_shutdown_finishes_the_request_in_flight(
    proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    backend.stall_next(1.0)
    async with connect(proxy) as conn:
        await conn.send(post(turn("last orders")))
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
        closing = spawn(proxy.server.close(), name="test-shutdown")
        await asyncio.sleep(0.1)
        assert not closing.done()  # waiting for the request in flight
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(*address(proxy))
        answer = await conn.answer()
        assert (answer.status, answer.text) == (200, "echo#1: last orders")
        assert answer.headers.get("Connection") == "close"  # said, not only done
        assert await conn.closed_by_server()
    async with asyncio.timeout(5):
        await closing
    assert backend.cancelled == 0
    assert front_served == [turn("last orders")]
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(*address(proxy))


async def test_client_disconnect_cancels_the_backend_request(
    proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    backend.stall_next(30)
    async with connect(proxy) as conn:
        await conn.send(post(turn("never mind")))
        await backend.wait_for(lambda: len(backend.responses_seen) == 1)
    await backend.wait_for(lambda: backend.cancelled == 1, within=3)  # not after 30 s
    registry = proxy.proxy.metrics.registry
    labels = {"route": "/v1/responses", "outcome": "client_disconnected"}
    async with asyncio.timeout(5):  # counted as the request unwinds
        while registry.get_sample_value("ocxproxy_requests_total", labels) != 1:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert front_served == [turn("never mind")]
    await serves_a_create_on_the_front_end(proxy, front_served)


# -- odd bytes in the head: aiohttp refuses them, so the front end hands them to it -----------


async def test_raw_backend_sees_a_plain_create(
    raw_backend: ScriptedPeer, make_proxy: MakeProxy, front_served: list[bytes]
) -> None:
    """The control for the tests below: a plain create does reach the raw backend."""
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("plain")))
    assert (answer.status, answer.text) == (200, "raw")
    assert len(raw_backend.heads) == 1
    assert raw_backend.heads[0].startswith(b"POST /v1/responses HTTP/1.1\r\n")
    assert len(front_served) == 1


async def test_bare_lf_in_the_target_never_reaches_the_backend(
    raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    """Whatever aiohttp makes of it (llhttp reads `X-Injected:1 HTTP/1.1` as a header of
    an HTTP/0.9 request), no bare LF may reach the backend's request line."""
    proxy = await make_proxy(raw_backend.url)
    target = b"/v1/responses?a\nX-Injected:1"
    request = post(turn("x"), "Connection: close").replace(b"/v1/responses", target, 1)
    async with connect(proxy) as conn:
        await conn.send(request)
        async with asyncio.timeout(5):
            await conn.reader.read()  # the answer, whatever it is, then the close
    for head in raw_backend.heads:
        assert b"\n" not in head.replace(b"\r\n", b""), head


@pytest.mark.parametrize(
    "value", [b"b\nX-Injected: 1", b"b\rc", b"b\x00c"], ids=["lf", "cr", "nul"]
)
async def test_line_break_or_nul_in_a_header_value_is_400(
    value: bytes, raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("x"), "X-Odd: " + value.decode()))
    assert raw_backend.heads == []
    assert answer.status == 400


async def test_control_character_in_the_target_never_reaches_the_backend(
    raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(raw_backend.url)
    request = post(turn("x")).replace(b"/v1/responses", b"/v1/responses?a\x01b", 1)
    async with connect(proxy) as conn:
        answer = await conn.ask(request)
    assert raw_backend.heads == []
    assert answer.status == 400


async def test_head_with_bare_lf_line_ends_is_answered_at_once(proxy: ProxyHandle) -> None:
    async with connect(proxy) as conn:
        await conn.send(b"GET /healthz HTTP/1.1\nHost: proxy\n\n")
        async with asyncio.timeout(1):
            answer = await conn.answer()
    assert answer.status == 400


async def test_a_target_that_is_not_ascii_is_400_not_a_500(
    raw_backend: ScriptedPeer, make_proxy: MakeProxy, front_served: list[bytes]
) -> None:
    proxy = await make_proxy(raw_backend.url)
    request = post(turn("x")).replace(b"/v1/responses", b"/v1/responses?x=\xff", 1)
    async with connect(proxy) as conn:
        answer = await conn.ask(request)
    assert answer.status == 400
    assert (front_served, raw_backend.heads) == ([], [])
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("y")))
    assert (answer.status, answer.text, len(front_served)) == (200, "raw", 1)


async def test_a_backend_header_with_a_bare_lf_never_reaches_the_client(
    raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    raw_backend.standing = raw_answer(b"X-Evil: a\nInjected: yes")
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("x")))
    assert answer.status == 502
    assert "Injected" not in answer.headers


async def test_non_ascii_backend_header_bytes_reach_the_client_unchanged(
    raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    raw_backend.standing = raw_answer("X-Name: café".encode())
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("x")))
    assert (answer.status, answer.headers["X-Name"]) == (200, "café")


# -- hostile clients and backends, both ways into create ------------------------------------
#
# `way` runs a test through the front end's own create (a Content-Length body) and through
# aiohttp's handler (a chunked body, which the front end hands over), as uvicorn runs its
# protocol tests on both of its implementations.


@pytest.fixture(params=["front", "aiohttp"])
def way(request: pytest.FixtureRequest, front_served: list[bytes]) -> Any:
    yield request.param
    # the request really went the way it says (nothing served: refused before either)
    assert request.param == "front" or front_served == []


def create_request(way: str, body: bytes, *extra: str) -> bytes:
    """A raw create that the front end serves itself, or hands to aiohttp."""
    if way == "front":
        return post(body, *extra)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return post(chunked, "Transfer-Encoding: chunked", *extra, length=False)


OWN = json_answer(response_object("resp_own", "own"))
SMUGGLED = json_answer(response_object("resp_evil", "smuggled"))
UNFRAMEABLE = {
    "CL 5 then 160": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 160\r\n\r\nhello",
    "TE xchunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: xchunked\r\n\r\n",
    "TE gzip then chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
    ),
    "status 000": b"HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\nhi",
    "non-token name": b'HTTP/1.1 200 OK\r\nX(a)@"b"{c}: 1\r\nContent-Length: 2\r\n\r\nhi',
}


async def next_client_gets_its_own_answer(
    proxy: ProxyHandle, peer: ScriptedPeer, request: bytes, check: Any
) -> None:
    """A second client's request is answered from a new backend connection, and the first
    backend connection was closed, not pooled with the leftovers in it."""
    async with connect(proxy) as conn:
        second = await conn.ask(request)
    check(second)
    await asyncio.wait_for(peer.connections[0].done.wait(), 2)
    assert [len(c.requests) for c in peer.connections] == [1, 1]


@pytest.mark.parametrize("bad", UNFRAMEABLE.values(), ids=UNFRAMEABLE.keys())
async def test_an_answer_that_cannot_be_framed_is_502_and_never_reaches_the_next_client(
    bad: bytes, way: str, make_proxy: MakeProxy
) -> None:
    async with ScriptedPeer(OWN) as peer:
        peer.answer(bad + SMUGGLED)
        proxy = await make_proxy(peer.url)
        async with connect(proxy) as conn:
            first = await conn.ask(create_request(way, turn("one")))
        assert first.status == 502

        def own(answer: Answer) -> None:
            assert (answer.status, answer.text) == (200, "own")

        await next_client_gets_its_own_answer(proxy, peer, create_request(way, turn("two")), own)


@pytest.mark.parametrize("bad", UNFRAMEABLE.values(), ids=UNFRAMEABLE.keys())
async def test_a_passthrough_answer_that_cannot_be_framed_is_502_and_goes_no_further(
    bad: bytes, make_proxy: MakeProxy
) -> None:
    async with ScriptedPeer(json_answer(MODELS)) as peer:
        peer.answer(bad + json_answer({"smuggled": True}))
        proxy = await make_proxy(peer.url)
        models = b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n"
        async with connect(proxy) as conn:
            first = await conn.ask(models)
        assert first.status == 502

        def own(answer: Answer) -> None:
            assert (answer.status, answer.json()) == (200, MODELS)

        await next_client_gets_its_own_answer(proxy, peer, models, own)


BAD_HEADS = {
    "tab in the target": lambda r: r.replace(b"/v1/responses", b"/v1/responses?a=1\tHTTP/1.0", 1),
    "space in the target": lambda r: r.replace(b"/v1/responses", b"/v1/responses?a b", 1),
    "non-token name": lambda r: r.replace(b"Host: proxy", b'Host: proxy\r\nX(a)@"b"{c}: 1'),
    "non-ASCII name": lambda r: r.replace(b"Host: proxy", "Host: proxy\r\nXé: 1".encode()),
    "no Host": lambda r: r.replace(b"Host: proxy\r\n", b""),
    "two Hosts": lambda r: r.replace(b"Host: proxy", b"Host: proxy\r\nHost: other"),
    "129 fields": lambda r: r.replace(b"Host: proxy", b"Host: proxy" + b"\r\nX-F: v" * 126),
    "an 8191-byte value": lambda r: r.replace(b"Host: p", b"Host: p\r\nX-Big: " + b"v" * 8191),
    "head ending LF CR LF": lambda r: r.replace(b"\r\n\r\n", b"\n\r\n", 1),
    "bare CR line ends": lambda r: r.replace(b"\r\n", b"\r"),
}  # fmt: skip


@pytest.mark.parametrize("spoil", BAD_HEADS.values(), ids=BAD_HEADS.keys())
async def test_a_bad_head_is_400_at_once_and_nothing_is_forwarded(
    spoil: Any, way: str, raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        await conn.send(spoil(create_request(way, turn("x"))))
        async with asyncio.timeout(1):  # at once, not at a deadline
            answer = await conn.answer()
        assert_openai_error(answer, 400, "invalid_request_error")
        assert await conn.closed_by_server()
    assert raw_backend.requests == []


async def test_aiohttps_limits_are_the_front_ends_too(
    way: str, raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    """128 fields and an 8190-byte value are served; one more of either is 400 (above)."""
    proxy = await make_proxy(raw_backend.url)
    fields = [f"X-F{i}: v" for i in range(124)] + ["X-Big: " + "v" * 8190]
    async with connect(proxy) as conn:  # with Host, Content-Type and the framing: 128
        answer = await conn.ask(create_request(way, turn("x"), *fields))
    assert (answer.status, answer.text) == (200, "raw")
    assert raw_backend.heads[0].count(b"\r\nX-F") == 124


async def test_fields_named_in_connection_are_removed_both_ways(
    way: str, make_proxy: MakeProxy
) -> None:
    answer_fields = (b"Connection: X-Bar, keep-alive", b"X-Bar: 1", b"X-Shown: 1")
    body = response_object("resp_raw", "raw")
    async with ScriptedPeer(json_answer(body, *answer_fields)) as peer:
        proxy = await make_proxy(peer.url)
        extra = ("Connection: keep-alive, X-Foo", "X-Foo: secret", "X-Kept: yes")
        async with connect(proxy) as conn:
            answer = await conn.ask(create_request(way, turn("x"), *extra))
    assert (answer.status, answer.text) == (200, "raw")
    assert (answer.headers.get("X-Bar"), answer.headers.get("X-Shown")) == (None, "1")
    (head,) = peer.heads
    assert b"X-Kept: yes" in head
    assert b"X-Foo" not in head


# -- time limits and the connection cap -----------------------------------------------------

LIMITS = {"head_timeout": 0.4, "body_timeout": 0.4, "keepalive_timeout": 0.4}


async def times_out(conn: Raw, *, within: float) -> Answer:
    """The 408 the proxy sends when a limit runs out, and the close after it."""
    async with asyncio.timeout(within):
        answer = await conn.answer()
    assert_openai_error(answer, 408, "request_timeout")
    assert await conn.closed_by_server()
    return answer


async def test_a_stalled_body_is_408_and_closed_by_the_body_timeout(
    way: str, raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(raw_backend.url, **LIMITS)
    if way == "front":  # declares 32 MiB, then sends nothing
        request = post(b"", f"Content-Length: {32 * 1024 * 1024}", length=False) + b"{"
    else:
        request = create_request(way, turn("x"))[:-20]  # mid-chunk
    async with connect(proxy) as conn:
        await conn.send(request)
        start = asyncio.get_running_loop().time()
        await times_out(conn, within=3)
        assert asyncio.get_running_loop().time() - start >= 0.35
    assert raw_backend.requests == []


async def test_a_body_that_keeps_coming_is_not_cut_off_by_the_body_timeout(
    way: str, raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    """The body timeout bounds silence between reads, not the whole body (nginx's
    client_body_timeout): a body dribbled over longer than the timeout is served."""
    proxy = await make_proxy(raw_backend.url, **LIMITS)
    request = create_request(way, turn("dribbled"))
    cut = len(request) - 8
    async with connect(proxy) as conn:
        await conn.send(request[:cut])
        for i in range(cut, len(request)):  # ~0.8 s in all, 0.1 s apart
            await asyncio.sleep(0.1)
            await conn.send(request[i : i + 1])
        answer = await conn.answer()
    assert (answer.status, answer.text) == (200, "raw")


@pytest.mark.parametrize("dribble", [False, True], ids=["stalled", "dribbled"])
async def test_a_head_not_complete_in_time_is_408_and_closed(
    dribble: bool, raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    """A deadline from the head's first byte: bytes that keep coming do not extend it."""
    proxy = await make_proxy(raw_backend.url, **LIMITS)
    async with connect(proxy) as conn:
        await conn.send(b"POST /v1/responses HTTP/1.1\r\nHost: p\r\n")
        sender = None
        if dribble:

            async def drip() -> None:
                with contextlib.suppress(ConnectionError):
                    for _ in range(20):
                        await asyncio.sleep(0.1)
                        await conn.send(b"X-A: 1\r\n")

            sender = spawn(drip(), name="test-drip")
        await times_out(conn, within=2)
        if sender is not None:
            sender.cancel()
    assert raw_backend.requests == []


async def test_an_idle_connection_is_closed_by_the_keepalive_timeout(
    raw_backend: ScriptedPeer, make_proxy: MakeProxy, backend: FakeBackend
) -> None:
    proxy = await make_proxy(backend.url, **LIMITS)
    async with connect(proxy) as conn:  # never says a thing
        async with asyncio.timeout(2):
            assert await conn.reader.read() == b""
    async with connect(proxy) as conn:  # idle after an answer
        answer = await conn.ask(post(turn("once")))
        assert (answer.status, answer.text) == (200, "echo#1: once")
        start = asyncio.get_running_loop().time()
        assert await conn.closed_by_server()
        assert asyncio.get_running_loop().time() - start >= 0.35


async def test_connections_past_the_cap_get_503_and_are_closed(
    way: str, raw_backend: ScriptedPeer, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(raw_backend.url, max_connections=3)
    async with contextlib.AsyncExitStack() as stack:
        idle = [await stack.enter_async_context(connect(proxy)) for _ in range(2)]
        busy = await stack.enter_async_context(connect(proxy))
        await busy.send(
            create_request(way, turn("x"))[:-20]
        )  # mid-body: served here, or by aiohttp
        await asyncio.sleep(0.1)
        async with connect(proxy) as refused:
            answer = await refused.answer()
            assert answer.status == 503
            assert answer.json()["error"]["code"] == "too_many_connections"
            assert answer.headers["Connection"] == "close"
            assert await refused.closed_by_server()
        idle[0].writer.close()
        await asyncio.sleep(0.1)
        async with connect(proxy) as conn:  # room again
            answer = await conn.ask(create_request(way, turn("x"), "Connection: close"))
            assert (answer.status, answer.text) == (200, "raw")
