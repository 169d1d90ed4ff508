"""http/front.py: the hand-written HTTP/1.1 front end, spoken to over raw sockets so the
framing is exact. Plain `POST /v1/responses` is served there (keep-alive, pipelining,
dribbled bytes, errors); anything else is handed to aiohttp, which closes the connection
after its answer.

Which side answered: the `front_served` fixture counts the calls of front.create (the
front end's only way into `exchange.create`). The `Server:` header cannot tell: the
front end relays the backend's, and FakeBackend is an aiohttp server too. RawBackend, a
lenient backend on a bare socket, shows byte for byte what the proxy forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from ocxproxy.aio import spawn
from ocxproxy.http import front
from ocxproxy.http.exchange import create
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
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


class RawBackend:
    """A lenient backend on a bare socket: records each request head exactly as it came
    and answers every request with one fixed Responses JSON."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.extra_head = b""  # header lines added to every answer, as they are
        self.url = ""

    async def __aenter__(self) -> RawBackend:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(length.group(1)) if length else 0)
        body = orjson.dumps(response_object("resp_raw", "raw"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + self.extra_head)
        writer.write(b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()


@pytest.fixture
async def raw_backend() -> AsyncIterator[RawBackend]:
    async with RawBackend() as raw:
        yield raw


def assert_openai_error(answer: Answer, status: int, code: str | None) -> dict[str, Any]:
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
        assert buffered <= 4096 + front.MAX_HEAD + 1024 * 1024  # the bound, plus one read
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
        assert_openai_error(bad, 400, None)
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
async def test_malformed_header_line_is_aiohttps_400(
    line: bytes, proxy: ProxyHandle, backend: FakeBackend, front_served: list[bytes]
) -> None:
    request = post(turn("odd"))
    head, body = request.split(b"\r\n\r\n", 1)
    async with connect(proxy) as conn:
        answer = await conn.ask(head + b"\r\n" + line + b"\r\n\r\n" + body)
        assert answer.status == 400
        assert answer.headers["Content-Type"] == "text/plain; charset=utf-8"  # aiohttp's own
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
    raw_backend: RawBackend, make_proxy: MakeProxy, front_served: list[bytes]
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
    raw_backend: RawBackend, make_proxy: MakeProxy
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
    value: bytes, raw_backend: RawBackend, make_proxy: MakeProxy
) -> None:
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("x"), "X-Odd: " + value.decode()))
    assert raw_backend.heads == []
    assert answer.status == 400


async def test_control_character_in_the_target_never_reaches_the_backend(
    raw_backend: RawBackend, make_proxy: MakeProxy
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


async def test_a_target_that_is_not_ascii_is_aiohttps_400_not_a_500(
    raw_backend: RawBackend, make_proxy: MakeProxy, front_served: list[bytes]
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
    raw_backend: RawBackend, make_proxy: MakeProxy
) -> None:
    raw_backend.extra_head = b"X-Evil: a\nInjected: yes\r\n"
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("x")))
    assert answer.status == 502
    assert "Injected" not in answer.headers


async def test_non_ascii_backend_header_bytes_reach_the_client_unchanged(
    raw_backend: RawBackend, make_proxy: MakeProxy
) -> None:
    raw_backend.extra_head = "X-Name: café\r\n".encode()
    proxy = await make_proxy(raw_backend.url)
    async with connect(proxy) as conn:
        answer = await conn.ask(post(turn("x")))
    assert (answer.status, answer.headers["X-Name"]) == (200, "café")
