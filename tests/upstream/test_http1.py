"""upstream/http1.py: the hand-written HTTP/1.1 client, against real loopback servers.

Most tests use a scripted raw TCP server: it records the exact bytes of every request and
answers each with the bytes (and pauses, and closes) the test wrote, so framing edge
cases are produced exactly. A real aiohttp server checks that a streamed body is read.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import uvloop
from aiohttp import web
from aiohttp.test_utils import TestServer

from ocxproxy.upstream.http1 import (
    BrokenOff,
    ConnectFailed,
    Disconnected,
    Http1Client,
    Http1Response,
)

Step = bytes | float | None
"""One thing the scripted server does in an answer: write bytes (and drain), pause for
that many seconds, or (None) close the connection."""


@dataclass
class Conn:
    """One TCP connection the scripted server accepted."""

    received: bytearray = field(default_factory=bytearray)  # every byte, partial included
    requests: list[bytes] = field(default_factory=list)  # each complete request, raw
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the connection is over


class ScriptedServer:
    """Answers the requests it reads, in order, from the answers the test queued."""

    def __init__(self) -> None:
        self.answers: list[list[Step]] = []
        self.connections: list[Conn] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    def base(self, prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{prefix}"

    def answer(self, *steps: Step) -> None:
        self.answers.append(list(steps))

    @property
    def requests(self) -> list[bytes]:
        return [request for conn in self.connections for request in conn.requests]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        for conn in self.connections:
            await asyncio.wait_for(conn.done.wait(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn()
        self.connections.append(conn)
        self._writers.append(writer)
        try:
            while True:
                request = await read_request(reader, conn)
                conn.requests.append(request)
                for step in self.answers.pop(0):
                    if step is None:
                        return
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    else:
                        writer.write(step)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            conn.done.set()


async def read_request(reader: asyncio.StreamReader, conn: Conn) -> bytes:
    """One request's raw bytes, framed by Content-Length or chunked encoding."""
    raw = bytearray()

    async def take(until: bytes | None = None, n: int = 0) -> bytes:
        try:
            data = await (reader.readuntil(until) if until else reader.readexactly(n))
        except asyncio.IncompleteReadError as exc:
            conn.received += exc.partial
            raise
        conn.received += data
        raw.extend(data)
        return data

    _, fields, _ = split_request(await take(b"\r\n\r\n"))
    length = [v for k, v in fields if k.lower() == "content-length"]
    if length:
        await take(n=int(length[0]))
    elif ("transfer-encoding", "chunked") in [(k.lower(), v) for k, v in fields]:
        while size := int((await take(b"\r\n")).split(b";")[0], 16):
            await take(n=size + 2)
        while await take(b"\r\n") != b"\r\n":  # trailers
            pass
    return bytes(raw)


def split_request(raw: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
    """(request line, header fields in order, body)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    line, *lines = head.decode("latin-1").split("\r\n")
    fields = [(name, value.strip()) for name, _, value in (x.partition(":") for x in lines)]
    return line, fields, body


def ok(body: bytes = b"", *headers: bytes, status: bytes = b"200 OK") -> bytes:
    """A whole Content-Length answer."""
    head = b"".join(h + b"\r\n" for h in headers)
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n%s" % (status, len(body), head, body)


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Kind: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n"
    b"1\r\n \r\n"
    b'A; name="quoted"\r\nchunked!!!\r\n'
    b"0\r\nX-Trailer: t\r\nX-Other: u\r\n\r\n"
)
CHUNKED_BODY = b"hello chunked!!!"


def trickle(data: bytes, pause: float = 0.001) -> list[Step]:
    """`data` written one byte at a time, with a pause after each."""
    steps: list[Step] = []
    for i in range(len(data)):
        steps += [data[i : i + 1], pause]
    return steps


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    scripted = ScriptedServer()
    await scripted.start()
    yield scripted
    await scripted.stop()


@pytest.fixture
async def client() -> AsyncIterator[Http1Client]:
    http = Http1Client(connect_timeout=2, read_timeout=2)
    yield http
    http.close()


async def get(client: Http1Client, server: ScriptedServer, path: str = "/") -> Http1Response:
    return await client.request("GET", server.base(), path, {}, None)


async def round_trip(client: Http1Client, server: ScriptedServer) -> bytes:
    """A GET whose body is read whole and whose connection is released."""
    response = await get(client, server)
    body = await response.read()
    response.release()
    return body


async def wait_done(conn: Conn) -> None:
    await asyncio.wait_for(conn.done.wait(), 2)


# -- the request ---------------------------------------------------------------------------


async def test_a_post_sends_its_line_host_length_headers_and_body(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(ok(b"fine"))
    headers = {"Content-Type": "application/json", "X-Trace": "abc def"}
    response = await client.request("POST", server.base("/prefix/"), "/path", headers, b'{"a":1}')
    assert await response.read() == b"fine"
    response.release()

    [conn] = server.connections
    [request] = conn.requests
    assert conn.received == request  # one request and nothing else
    line, fields, body = split_request(request)
    assert line == "POST /prefix/path HTTP/1.1"
    assert sorted(fields) == [
        ("Content-Length", "7"),
        ("Content-Type", "application/json"),
        ("Host", f"127.0.0.1:{server.port}"),
        ("X-Trace", "abc def"),
    ]
    assert body == b'{"a":1}'


async def test_framing_headers_from_the_caller_are_not_forwarded(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(ok(b"1"))
    server.answer(ok(b"2"))
    headers = {
        "host": "evil.example",
        "Content-Length": "999",
        "Transfer-Encoding": "chunked",
        "Connection": "close",
        "Expect": "100-continue",
        "Keep-Alive": "timeout=5",
        "X-Kept": "yes",
    }
    response = await client.request("PUT", server.base(), "/x", headers, b"abc")
    assert await response.read() == b"1"
    response.release()
    assert await round_trip(client, server) == b"2"

    line, fields, body = split_request(server.requests[0])
    assert line == "PUT /x HTTP/1.1"
    assert sorted(fields) == [
        ("Content-Length", "3"),
        ("Host", f"127.0.0.1:{server.port}"),
        ("X-Kept", "yes"),
    ]
    assert body == b"abc"
    assert len(server.connections) == 1  # "Connection: close" was not sent either


@pytest.mark.parametrize(
    ("method", "body", "length"),
    [("GET", None, None), ("DELETE", b"", None), ("POST", None, "0"), ("PUT", b"", "0")],
)
async def test_content_length_is_sent_for_a_body_or_a_method_that_takes_one(
    server: ScriptedServer,
    client: Http1Client,
    method: str,
    body: bytes | None,
    length: str | None,
) -> None:
    server.answer(ok())
    response = await client.request(method, server.base(), "/", {}, body)
    response.release()
    line, fields, sent = split_request(server.requests[0])
    assert line == f"{method} / HTTP/1.1"
    assert [v for k, v in fields if k == "Content-Length"] == ([length] if length else [])
    assert sent == b""


async def test_a_streamed_body_goes_out_chunked_on_the_wire(
    server: ScriptedServer, client: Http1Client
) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"abc"
        yield b""  # an empty chunk would end the body: it must be skipped
        yield b"x" * 300

    server.answer(ok())
    response = await client.request("POST", server.base(), "/s", {"X-A": "1"}, body())
    response.release()
    line, fields, sent = split_request(server.requests[0])
    assert line == "POST /s HTTP/1.1"
    assert sorted(fields) == [
        ("Host", f"127.0.0.1:{server.port}"),
        ("Transfer-Encoding", "chunked"),
        ("X-A", "1"),
    ]
    assert sent == b"3\r\nabc\r\n12c\r\n" + b"x" * 300 + b"\r\n0\r\n\r\n"


async def test_a_streamed_body_arrives_whole_at_an_aiohttp_server(client: Http1Client) -> None:
    seen: list[tuple[str | None, str | None, bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        data = await request.read()
        seen.append((request.headers.get("Transfer-Encoding"), request.headers.get("X-A"), data))
        return web.Response(text=f"got {len(data)}")

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/api/upload", handler)
    pieces = [bytes([i % 256]) * (64 * 1024 + i) for i in range(64)]  # ~4 MiB, backpressure

    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    aio = TestServer(app, host="127.0.0.1", port=0)
    await aio.start_server()
    try:
        base = str(aio.make_url("/api")).rstrip("/")
        response = await client.request("POST", base, "/upload", {"X-A": "1"}, body())
        assert response.status == 200
        expected = b"".join(pieces)
        assert await response.read() == b"got %d" % len(expected)
        response.release()
    finally:
        await aio.close()
    assert seen == [("chunked", "1", expected)]


@pytest.mark.parametrize("value", ["a\r\nX-Evil: 1", "a\nb", "a\rb"])
async def test_a_header_with_a_line_break_is_refused_and_nothing_is_sent(
    server: ScriptedServer, client: Http1Client, value: str
) -> None:
    with pytest.raises(ValueError, match="line break"):
        await client.request("POST", server.base(), "/", {"X-Bad": value}, b"body")
    await wait_done(server.connections[0])
    assert [bytes(c.received) for c in server.connections] == [b""]


# -- the answer's framing ------------------------------------------------------------------


async def test_a_content_length_answer_is_read_whole(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(ok(b"0123456789", b"X-Thing: one", b"x-thing: two", status=b"201 Created Now"))
    response = await get(client, server)
    assert (response.status, response.reason) == (201, "Created Now")
    assert response.content_length == 10
    assert response.headers["CONTENT-LENGTH"] == "10"
    assert response.headers.getall("X-THING") == ["one", "two"]
    assert not response.content.at_eof()
    assert await response.read() == b"0123456789"
    assert response.content.at_eof()
    assert await response.content.readany() == b""
    response.release()


async def test_a_content_length_answer_is_read_as_it_arrives_by_readany(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(ok(b"abcdefghij")[:-7], 0.05, b"defg", 0.05, b"hij")
    response = await get(client, server)
    assert response.content_length == 10
    pieces = []
    while piece := await response.content.readany():
        pieces.append(piece)
    assert pieces == [b"abc", b"defg", b"hij"]
    assert response.content.at_eof()
    response.release()


async def test_a_chunked_answer_sent_at_once_is_decoded_with_extensions_and_trailers(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(CHUNKED)
    server.answer(ok(b"next"))
    response = await get(client, server)
    assert response.status == 200
    assert response.content_length is None
    assert response.headers["x-kind"] == "chunked"
    assert await response.read() == CHUNKED_BODY
    assert response.content.at_eof()
    assert "X-Trailer" not in response.headers
    response.release()
    # The trailers were consumed: the connection is clean for the next answer.
    assert await round_trip(client, server) == b"next"
    assert len(server.connections) == 1


async def test_a_chunked_answer_sent_one_byte_at_a_time_is_decoded(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(*trickle(CHUNKED))
    response = await get(client, server)
    pieces = []
    while piece := await response.content.readany():
        pieces.append(piece)
    assert b"".join(pieces) == CHUNKED_BODY
    assert len(pieces) == len(CHUNKED_BODY)  # each body byte came on its own
    assert response.content.at_eof()
    response.release()


async def test_a_chunked_answer_split_in_two_at_every_offset_is_decoded(
    server: ScriptedServer, client: Http1Client
) -> None:
    for cut in range(1, len(CHUNKED)):
        server.answer(CHUNKED[:cut], 0.002, CHUNKED[cut:])
    for cut in range(1, len(CHUNKED)):
        response = await get(client, server, f"/{cut}")
        assert await response.read() == CHUNKED_BODY, cut
        assert response.content.at_eof()
        response.release()
    assert len(server.connections) == 1
    assert len(server.requests) == len(CHUNKED) - 1


async def test_a_close_delimited_answer_is_read_until_close_and_not_reused(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nuntil", 0.02, b" the end", None)
    server.answer(ok(b"second"))
    response = await get(client, server)
    assert response.content_length is None
    assert await response.read() == b"until the end"
    assert response.content.at_eof()
    response.release()
    assert await round_trip(client, server) == b"second"
    assert [len(c.requests) for c in server.connections] == [1, 1]


@pytest.mark.parametrize(
    ("method", "status"), [("HEAD", b"200 OK"), ("GET", b"204 No Content"), ("GET", b"304 NM")]
)
async def test_head_204_and_304_answers_have_no_body_despite_a_content_length(
    server: ScriptedServer, client: Http1Client, method: str, status: bytes
) -> None:
    server.answer(b"HTTP/1.1 %s\r\nContent-Length: 42\r\n\r\n" % status)
    server.answer(ok(b"next"))
    response = await client.request(method, server.base(), "/", {}, None)
    assert response.headers["Content-Length"] == "42"
    assert response.content.at_eof()
    assert await response.read() == b""
    response.release()
    assert await round_trip(client, server) == b"next"
    assert len(server.connections) == 1


async def test_interim_answers_before_the_final_one_are_skipped(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(
        b"HTTP/1.1 100 Continue\r\n\r\n",
        0.01,
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
        ok(b"final", b"X-Final: yes"),
    )
    response = await client.request("POST", server.base(), "/", {}, b"x")
    assert (response.status, response.reason) == (200, "OK")
    assert "Link" not in response.headers
    assert response.headers["X-Final"] == "yes"
    assert await response.read() == b"final"
    response.release()


# -- keep-alive ----------------------------------------------------------------------------


async def test_two_requests_after_release_share_one_connection(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(ok(b"first"))
    server.answer(CHUNKED)
    assert await round_trip(client, server) == b"first"
    assert await round_trip(client, server) == CHUNKED_BODY
    [conn] = server.connections
    assert len(conn.requests) == 2
    assert not conn.done.is_set()


@pytest.mark.parametrize("finish", ["close", "release"])
async def test_a_connection_left_before_its_body_was_read_is_not_reused(
    server: ScriptedServer, client: Http1Client, finish: str
) -> None:
    server.answer(ok(b"a body that nobody reads"))
    server.answer(ok(b"second"))
    response = await get(client, server)
    getattr(response, finish)()
    await wait_done(server.connections[0])  # the server saw the connection end
    assert await round_trip(client, server) == b"second"
    assert [len(c.requests) for c in server.connections] == [1, 1]


@pytest.mark.parametrize(
    "status_line", [b"HTTP/1.1 200 OK\r\nConnection: close", b"HTTP/1.0 200 OK"]
)
async def test_an_answer_that_ends_keep_alive_is_not_reused(
    server: ScriptedServer, client: Http1Client, status_line: bytes
) -> None:
    server.answer(status_line + b"\r\nContent-Length: 2\r\n\r\nhi")
    server.answer(ok(b"second"))
    assert await round_trip(client, server) == b"hi"
    assert await round_trip(client, server) == b"second"
    assert [len(c.requests) for c in server.connections] == [1, 1]


async def test_an_idle_connection_the_server_closed_is_not_reused(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(ok(b"first"), 0.05, None)  # closed once the client has kept it
    server.answer(ok(b"second"))
    assert await round_trip(client, server) == b"first"
    await wait_done(server.connections[0])
    await asyncio.sleep(0.05)  # let the client see the end
    assert await round_trip(client, server) == b"second"
    assert [len(c.requests) for c in server.connections] == [1, 1]


async def test_an_idle_connection_older_than_keepalive_is_not_reused(
    server: ScriptedServer,
) -> None:
    client = Http1Client(connect_timeout=2, read_timeout=2, keepalive=0.05)
    try:
        server.answer(ok(b"first"))
        server.answer(ok(b"second"))
        server.answer(ok(b"third"))
        assert await round_trip(client, server) == b"first"
        assert await round_trip(client, server) == b"second"  # within keepalive: reused
        await asyncio.sleep(0.1)
        assert await round_trip(client, server) == b"third"
        assert [len(c.requests) for c in server.connections] == [2, 1]
        await wait_done(server.connections[0])  # and the stale one was closed
    finally:
        client.close()


async def test_client_close_closes_its_idle_connections(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(ok(b"x"))
    assert await round_trip(client, server) == b"x"
    assert not server.connections[0].done.is_set()
    client.close()
    await wait_done(server.connections[0])


# -- errors, by type -----------------------------------------------------------------------


async def test_a_refused_connection_is_connect_failed(client: Http1Client) -> None:
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectFailed):
        await client.request("GET", f"http://127.0.0.1:{port}", "/", {}, None)


async def test_a_server_that_closes_without_answering_is_disconnected(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(None)
    with pytest.raises(Disconnected):
        await get(client, server)
    assert len(server.requests) == 1


@pytest.mark.parametrize("how", ["read", "readany"])
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
    ],
    ids=["length", "mid-chunk", "before-last-chunk"],
)
async def test_a_close_mid_body_is_broken_off(
    server: ScriptedServer, client: Http1Client, answer: bytes, how: str
) -> None:
    server.answer(answer, 0.02, None)
    response = await get(client, server)
    assert response.status == 200
    with pytest.raises(BrokenOff, match="closed mid-answer"):
        if how == "read":
            await response.read()
        else:
            while await response.content.readany():
                pass
    response.close()


@pytest.mark.parametrize(
    "status_line",
    [b"HTTP/2 200 OK", b"ICY 200 OK", b"HTTP/1.1 20 OK", b"HTTP/1.1 abc OK", b"garbage"],
)
async def test_a_malformed_status_line_is_broken_off(
    server: ScriptedServer, client: Http1Client, status_line: bytes
) -> None:
    server.answer(status_line + b"\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(BrokenOff, match="status line"):
        await get(client, server)


@pytest.mark.parametrize("header", [b" Folded: x", b"No colon here", b"Bad : space"])
async def test_a_malformed_header_line_is_broken_off(
    server: ScriptedServer, client: Http1Client, header: bytes
) -> None:
    server.answer(b"HTTP/1.1 200 OK\r\n" + header + b"\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(BrokenOff, match="header line"):
        await get(client, server)


@pytest.mark.parametrize("header", [b"Split: a\nInjected: 1", b"Cr: a\rb", b"Nul: a\x00b"])
async def test_control_bytes_in_the_head_are_broken_off(
    server: ScriptedServer, client: Http1Client, header: bytes
) -> None:
    """A bare LF would split one header into two on the way to the client."""
    server.answer(b"HTTP/1.1 200 OK\r\n" + header + b"\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(BrokenOff, match="control bytes"):
        await get(client, server)


@pytest.mark.parametrize("length", [b"abc", b"-1", b"1, 1"])
async def test_a_bad_content_length_is_broken_off(
    server: ScriptedServer, client: Http1Client, length: bytes
) -> None:
    server.answer(b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\n")
    with pytest.raises(BrokenOff, match="Content-Length"):
        await get(client, server)


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", b"HTTP/1.1 2\xb20 OK\r\n\r\n"],
    ids=["content-length", "status"],
)
async def test_non_ascii_digits_in_the_head_are_broken_off(
    server: ScriptedServer, client: Http1Client, answer: bytes
) -> None:
    server.answer(answer)
    with pytest.raises(BrokenOff):
        await get(client, server)


@pytest.mark.parametrize("size_line", [b"zz", b"", b"-5", b"5 5", b"0x5", b"+5", b"5_0"])
async def test_a_bad_chunk_size_is_broken_off(
    server: ScriptedServer, client: Http1Client, size_line: bytes
) -> None:
    server.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\n")
    response = await get(client, server)
    with pytest.raises(BrokenOff, match="bad chunk size"):
        await response.read()
    response.close()


async def test_a_chunk_without_its_crlf_is_broken_off(
    server: ScriptedServer, client: Http1Client
) -> None:
    server.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n")
    response = await get(client, server)
    with pytest.raises(BrokenOff, match="no CRLF"):
        await response.read()
    response.close()


async def test_a_server_silent_before_its_head_times_out(server: ScriptedServer) -> None:
    client = Http1Client(connect_timeout=2, read_timeout=0.2)
    server.answer()  # says nothing
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await get(client, server)
    assert 0.15 < time.monotonic() - start < 1.5
    await wait_done(server.connections[0])  # and the connection was closed


@pytest.mark.parametrize("how", ["read", "readany"])
async def test_a_server_silent_mid_body_times_out(server: ScriptedServer, how: str) -> None:
    client = Http1Client(connect_timeout=2, read_timeout=0.2)
    server.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    response = await get(client, server)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await (response.read() if how == "read" else response.content.readany())
    assert 0.15 < time.monotonic() - start < 1.5
    response.close()


# -- uvloop --------------------------------------------------------------------------------


def test_a_round_trip_works_under_uvloop() -> None:
    async def main() -> list[bytes]:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        server = ScriptedServer()
        await server.start()
        client = Http1Client(connect_timeout=2, read_timeout=2)
        try:
            server.answer(*trickle(CHUNKED))
            server.answer(ok(b"second"))

            async def body() -> AsyncIterator[bytes]:
                yield b"streamed "
                yield b"body"

            response = await client.request("POST", server.base(), "/a", {}, body())
            first = await response.read()
            response.release()
            second = await round_trip(client, server)
            assert len(server.connections) == 1
            return [first, second, server.requests[0].partition(b"\r\n\r\n")[2]]
        finally:
            client.close()
            await server.stop()

    first, second, sent = uvloop.run(main())
    assert first == CHUNKED_BODY
    assert second == b"second"
    assert sent == b"9\r\nstreamed \r\n4\r\nbody\r\n0\r\n\r\n"
