"""upstream/http1.py: the HTTP/1.1 client's connection work (keep-alive, reuse only at an
answer's exact framed end, timeouts, flow control), against real loopback servers.

Most tests use tests/fakes/scripted.py's ScriptedPeer: it records the exact bytes of every
request and answers each with the bytes (and pauses, and closes) the test wrote, so
framing edge cases are produced exactly. A real aiohttp server checks that a streamed body
is read. Every way an answer can be malformed is in tests/test_h1.py's tables; here, a
sample of them shows what the client does with one.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import AsyncIterator

import pytest
import uvloop
from aiohttp import web
from aiohttp.test_utils import TestServer

from ocxproxy.h1 import MAX_HEAD
from ocxproxy.upstream import http1
from ocxproxy.upstream.http1 import (
    BrokenOff,
    ConnectFailed,
    Disconnected,
    Http1Client,
    Http1Response,
)
from tests.fakes.scripted import Conn, ScriptedPeer, ok, split_request, trickle

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Kind: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n"
    b"1\r\n \r\n"
    b'A;name="quoted"\r\nchunked!!!\r\n'
    b"0\r\nX-Trailer: t\r\nX-Other: u\r\n\r\n"
)
CHUNKED_BODY = b"hello chunked!!!"


@pytest.fixture
async def server() -> AsyncIterator[ScriptedPeer]:
    async with ScriptedPeer() as scripted:
        yield scripted


@pytest.fixture
async def client() -> AsyncIterator[Http1Client]:
    http = Http1Client(connect_timeout=2, read_timeout=2)
    yield http
    http.close()


async def get(client: Http1Client, server: ScriptedPeer, path: str = "/") -> Http1Response:
    return await client.request("GET", server.base(), path, {}, None)


async def round_trip(client: Http1Client, server: ScriptedPeer) -> bytes:
    """A GET whose body is read whole and whose connection is released."""
    response = await get(client, server)
    body = await response.read()
    response.release()
    return body


async def wait_done(conn: Conn) -> None:
    await asyncio.wait_for(conn.done.wait(), 2)


# -- the request ---------------------------------------------------------------------------


async def test_a_post_sends_its_line_host_length_headers_and_body(
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer,
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client, value: str
) -> None:
    with pytest.raises(ValueError, match="line break"):
        await client.request("POST", server.base(), "/", {"X-Bad": value}, b"body")
    await wait_done(server.connections[0])
    assert [bytes(c.received) for c in server.connections] == [b""]


# -- the answer's framing ------------------------------------------------------------------


async def test_a_content_length_answer_is_read_whole(
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client, method: str, status: bytes
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client, finish: str
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
    server: ScriptedPeer, client: Http1Client, status_line: bytes
) -> None:
    server.answer(status_line + b"\r\nContent-Length: 2\r\n\r\nhi")
    server.answer(ok(b"second"))
    assert await round_trip(client, server) == b"hi"
    assert await round_trip(client, server) == b"second"
    assert [len(c.requests) for c in server.connections] == [1, 1]


async def test_an_idle_connection_the_server_closed_is_not_reused(
    server: ScriptedPeer, client: Http1Client
) -> None:
    server.answer(ok(b"first"), 0.05, None)  # closed once the client has kept it
    server.answer(ok(b"second"))
    assert await round_trip(client, server) == b"first"
    await wait_done(server.connections[0])
    await asyncio.sleep(0.05)  # let the client see the end
    assert await round_trip(client, server) == b"second"
    assert [len(c.requests) for c in server.connections] == [1, 1]


def closes_after_each_answer(answer: bytes) -> tuple[socket.socket, threading.Thread]:
    """A backend in a thread that closes each connection as soon as it has answered one
    request, as llama.cpp does after a streamed answer; its socket and thread."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # the test closed the listener
            with sock:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += sock.recv(65536)
                sock.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


async def test_an_idle_connection_closed_before_the_loop_read_the_end_is_not_reused(
    client: Http1Client,
) -> None:
    """The backend's close arrived but the loop has not read it yet (the next request came
    in the same turn of the loop): the connection is not taken for the next request."""
    listener, thread = closes_after_each_answer(CHUNKED)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        for _ in range(2):
            response = await client.request("GET", base, "/", {}, None)
            assert await response.read() == CHUNKED_BODY
            response.release()
            time.sleep(0.05)  # noqa: ASYNC251 (on purpose: the close is on the socket, unread)
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes its accept()
        listener.close()
    thread.join(2)
    assert not thread.is_alive()


async def test_a_connection_reused_is_polled_with_the_poll_object_made_at_connect(
    server: ScriptedPeer, client: Http1Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unread-end check costs a reuse one poll() call: its poll object is made and
    registered once, when the connection is made."""
    made: list[select.poll] = []

    def poll() -> select.poll:
        made.append(real())
        return made[-1]

    real = select.poll
    monkeypatch.setattr(select, "poll", poll)
    for i in range(3):
        server.answer(ok(b"%d" % i))
        assert await round_trip(client, server) == b"%d" % i
    assert [len(c.requests) for c in server.connections] == [3]
    assert len(made) == 1


async def test_a_backend_that_closes_after_a_chunked_answer_has_none_kept_after_one(
    server: ScriptedPeer, client: Http1Client
) -> None:
    """Once it closed a connection kept after a chunked answer, the next chunked answer's
    connection is closed rather than kept (a request there would race its close); one
    after a Content-Length answer is still kept."""
    server.answer(CHUNKED, 0.05, None)  # closed once the client has kept it
    server.answer(CHUNKED)  # left open: the client closes it
    server.answer(ok(b"third"))
    server.answer(ok(b"fourth"))
    assert await round_trip(client, server) == CHUNKED_BODY
    await wait_done(server.connections[0])
    await asyncio.sleep(0.05)  # let the client see the end
    assert await round_trip(client, server) == CHUNKED_BODY
    assert await round_trip(client, server) == b"third"
    assert await round_trip(client, server) == b"fourth"
    assert [len(c.requests) for c in server.connections] == [1, 1, 2]


async def test_a_backend_that_closed_after_a_chunked_answer_has_one_kept_again_later(
    server: ScriptedPeer, client: Http1Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELEARN seconds after it closed one, a connection after a chunked answer is kept
    again: the backend replaced by one that keeps them (a restart, an upgrade) has its
    connections reused after streams."""
    monkeypatch.setattr(http1, "RELEARN", 0.5)
    server.answer(CHUNKED, 0.05, None)  # closed once the client has kept it
    server.answer(CHUNKED)  # within RELEARN: the client closes it
    server.answer(CHUNKED)  # after RELEARN: kept
    server.answer(ok(b"fourth"))  # on the connection kept
    assert await round_trip(client, server) == CHUNKED_BODY
    await wait_done(server.connections[0])
    await asyncio.sleep(0.05)  # let the client see the end
    assert await round_trip(client, server) == CHUNKED_BODY
    await wait_done(server.connections[1])
    await asyncio.sleep(0.5)
    assert await round_trip(client, server) == CHUNKED_BODY
    assert await round_trip(client, server) == b"fourth"
    assert [len(c.requests) for c in server.connections] == [1, 1, 2]


async def test_an_idle_connection_older_than_keepalive_is_not_reused(
    server: ScriptedPeer,
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client
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
    server: ScriptedPeer, client: Http1Client, answer: bytes, how: str
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


# A sample of tests/test_h1.py's table: whatever is wrong, the client's answer is the same.
MALFORMED_HEADS = [
    b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 000 Zero\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n Folded: x\r\nContent-Length: 0\r\n\r\n",
    b'HTTP/1.1 200 OK\r\nX(a)@"b"{c}: 1\r\nContent-Length: 0\r\n\r\n',
    b"HTTP/1.1 200 OK\r\nSplit: a\nInjected: 1\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 160\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: xchunked\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
]


@pytest.mark.parametrize("answer", MALFORMED_HEADS, ids=repr)
async def test_a_head_that_cannot_be_framed_or_passed_on_is_broken_off_and_closed(
    server: ScriptedPeer, client: Http1Client, answer: bytes
) -> None:
    server.answer(answer, 0.05, b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbad")
    server.answer(ok(b"next"))
    with pytest.raises(BrokenOff, match="could not be read"):
        await get(client, server)
    await wait_done(server.connections[0])  # closed, never pooled
    assert await round_trip(client, server) == b"next"
    assert [len(c.requests) for c in server.connections] == [1, 1]


async def test_an_endless_head_is_broken_off_at_the_bound(
    server: ScriptedPeer, client: Http1Client
) -> None:
    endless = b"HTTP/1.1 200 OK\r\nX-Long: " + b"v" * (MAX_HEAD + 1024)
    server.answer(endless, 1.0)
    with pytest.raises(BrokenOff, match="too large"):
        await get(client, server)


@pytest.mark.parametrize(
    "size_line", [b"zz", b"", b"-5", b"5 5", b"0x5", b"+5", b"5_0", b"3\r\nabcX"]
)
async def test_a_bad_chunk_is_broken_off_and_closed(
    server: ScriptedPeer, client: Http1Client, size_line: bytes
) -> None:
    server.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\n")
    response = await get(client, server)
    with pytest.raises(BrokenOff, match="could not be read"):
        await response.read()
    response.release()  # as Sent does; the connection must not be pooled for all that
    await wait_done(server.connections[0])


@pytest.mark.parametrize("when", ["with the answer", "after release"])
async def test_bytes_after_the_framed_end_keep_the_connection_out_of_the_pool(
    server: ScriptedPeer, client: Http1Client, when: str
) -> None:
    """A response desync: leftovers must never be read as the next request's answer."""
    smuggled = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled"
    if when == "with the answer":
        server.answer(ok(b"first") + smuggled)
    else:
        server.answer(ok(b"first"), 0.1, smuggled)
    server.answer(ok(b"second"))
    response = await get(client, server)
    assert await response.read() == b"first"
    if when == "with the answer":
        await asyncio.sleep(0.05)  # all of it in
    response.release()
    await asyncio.sleep(0.2)
    assert await round_trip(client, server) == b"second"
    assert [len(c.requests) for c in server.connections] == [1, 1]
    await wait_done(server.connections[0])


async def test_a_backends_keep_alive_timeout_is_honoured_with_a_margin(
    server: ScriptedPeer,
) -> None:
    client = Http1Client(connect_timeout=2, read_timeout=2, keepalive=30)
    try:
        server.answer(ok(b"1", b"Keep-Alive: timeout=2, max=100"))
        server.answer(ok(b"2", b"Keep-Alive: timeout=2"))
        server.answer(ok(b"3", b"Keep-Alive: timeout=1"))  # less than the margin: not kept
        server.answer(ok(b"4"))
        assert await round_trip(client, server) == b"1"
        assert await round_trip(client, server) == b"2"  # reused at once
        await asyncio.sleep(1.1)  # past 2 s less the 1 s margin
        assert await round_trip(client, server) == b"3"
        assert await round_trip(client, server) == b"4"
        assert [len(c.requests) for c in server.connections] == [2, 1, 1]
    finally:
        client.close()


async def test_reading_pauses_while_the_caller_does_not_take_the_body(
    server: ScriptedPeer, client: Http1Client
) -> None:
    big = bytes(range(256)) * (16 * 1024)  # 4 MiB
    server.answer(ok(big))
    response = await get(client, server)
    await asyncio.sleep(0.3)
    conn = response._conn
    assert conn.paused
    assert sum(map(len, response._parser.body)) < 3 * 1024 * 1024  # not all of it read
    assert await response.read() == big
    response.release()


async def test_a_server_silent_before_its_head_times_out(server: ScriptedPeer) -> None:
    client = Http1Client(connect_timeout=2, read_timeout=0.2)
    server.answer()  # says nothing
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await get(client, server)
    assert 0.15 < time.monotonic() - start < 1.5
    await wait_done(server.connections[0])  # and the connection was closed


@pytest.mark.parametrize("how", ["read", "readany"])
async def test_a_server_silent_mid_body_times_out(server: ScriptedPeer, how: str) -> None:
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
        server = ScriptedPeer()
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
