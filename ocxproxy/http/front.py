"""The listening socket: `POST /v1/responses` on hand-written HTTP/1.1, the rest on aiohttp.

Why: per continuation turn, aiohttp's server (request and response objects, router,
middleware chain, payload streams) cost about as much CPU as everything else the proxy
does. Coding agents send almost nothing but `POST /v1/responses`, so that one request
gets a lean path; every other request keeps aiohttp.

A connection starts here. A request whose head is a plain `POST /v1/responses`
(HTTP/1.1, one Content-Length within `--max-body-bytes`, no Transfer-Encoding, Expect or
Upgrade, no control bytes, bare line ends or folded header lines) is served here, by the
same `guarded()` (errors, counts, overhead) and `exchange.create` as aiohttp's route.
The first request that is anything else is handed, with the connection and every byte
not yet read, to aiohttp's RequestHandler, which owns the connection from then on: aiohttp
parses, answers, or refuses it exactly as it would have. So this parser only has to
recognise its own case, never to judge anything else. aiohttp closes a handed-over
connection after its answer (`Connection: close`; not a WebSocket's, nor one whose body it
did not read), so the client's next request opens a new connection that starts here
again: one GET of a model list does not put an agent's turns on the slow path for the
rest of its connection's life.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from ocxproxy.aio import FlowControlled
from ocxproxy.errors import OcxError
from ocxproxy.http.context import PROXY, Proxy
from ocxproxy.http.exchange import create
from ocxproxy.http.middleware import guarded
from ocxproxy.metrics import Timing
from ocxproxy.upstream.http1 import has_control_bytes

ROUTE = "/v1/responses"
MAX_HEAD = 64 * 1024
KEEPALIVE = 75.0  # seconds an idle connection stays open, as aiohttp's default


class _Head:
    __slots__ = ("headers", "keep_alive", "length", "target")

    def __init__(self, target: str, headers: CIMultiDictProxy[str], length: int, keep: bool):
        self.target = target
        self.headers = headers
        self.length = length
        self.keep_alive = keep


def parse_head(head: bytes) -> _Head | None:
    """The head of a request this front end serves, else None (aiohttp's then)."""
    if len(head) > MAX_HEAD or has_control_bytes(head):
        return None  # never forwarded from here: aiohttp judges it
    lines = head.decode("utf-8", "surrogateescape").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[0] != "POST" or parts[2] != "HTTP/1.1":
        return None
    target = parts[1]
    if not target.isascii() or (target != ROUTE and not target.startswith(ROUTE + "?")):
        return None
    headers: CIMultiDict[str] = CIMultiDict()
    length: int | None = None
    keep_alive = True
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or " " in name or "\t" in name:
            return None  # folded, malformed, or odd: aiohttp judges it
        value = value.strip(" \t")
        lower = name.lower()
        if lower == "content-length":
            if length is not None or not (value.isascii() and value.isdigit()):
                return None
            length = int(value)
        elif lower in ("transfer-encoding", "expect", "upgrade"):
            return None
        elif lower == "connection":
            tokens = {t.strip().lower() for t in value.split(",")}
            if "upgrade" in tokens:
                return None
            keep_alive = keep_alive and "close" not in tokens
        headers.add(name, value)
    if length is None:
        return None
    return _Head(target, CIMultiDictProxy(headers), length, keep_alive)


class FrontEnd:
    """What the connections share: the proxy, aiohttp's handler factory, who is open."""

    def __init__(self, proxy: Proxy, web_server: Callable[[], asyncio.Protocol]) -> None:
        self.proxy = proxy
        self.web_server = web_server
        self.connections: set[FrontConnection] = set()
        self.closing = False

    async def shutdown(self, grace: float) -> None:
        """Close idle connections now, let requests in flight finish within `grace`."""
        self.closing = True
        busy = []
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()
            else:
                busy.append(conn.task)
        if busy:
            await asyncio.wait(busy, timeout=grace)
        for conn in list(self.connections):
            conn.close()


class FrontConnection(FlowControlled):
    """One client connection, until it is closed or handed to aiohttp."""

    def __init__(self, front: FrontEnd) -> None:
        super().__init__()
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.head: _Head | None = None  # parsed, its body not all in yet
        self.body_at = 0
        self.task: asyncio.Task[None] | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.reading_paused = False
        self.lost = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.front.connections.add(self)
        self.idle = self.loop.call_later(KEEPALIVE, self.close)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next()
        elif len(self.buffer) > self.front.proxy.config.max_body_bytes + MAX_HEAD:
            self._pause_reading()  # pipelined far ahead of the request in flight

    def eof_received(self) -> bool:
        return False  # the client is done sending: close (a request in flight is cancelled)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.front.connections.discard(self)
        if self.idle is not None:
            self.idle.cancel()
        if self.task is not None:
            self.task.cancel()  # the client went away: so does the backend request
        self.resume_writing()

    # -- requests ------------------------------------------------------------------------

    def _next(self) -> None:
        """Start the next request if all of it is in; hand over one that is not ours."""
        buffer = self.buffer
        if self.head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD or b"\n\n" in buffer:  # too long, or bare LFs
                    self._hand_over()
                return
            head = parse_head(bytes(buffer[:end]))
            if head is None or head.length > self.front.proxy.config.max_body_bytes:
                self._hand_over()  # aiohttp serves it, or answers 413 like the route does
                return
            self.head, self.body_at = head, end + 4
            if self.idle is not None:
                self.idle.cancel()
                self.idle = None
        end = self.body_at + self.head.length
        if len(buffer) < end:
            return
        head, body = self.head, bytes(buffer[self.body_at : end])
        del buffer[:end]
        self.head = None
        self.task = self.loop.create_task(self._serve(head, body))

    async def _serve(self, head: _Head, body: bytes) -> None:
        proxy = self.front.proxy
        reply = SocketReply(self, keep_alive=head.keep_alive and not self.front.closing)

        async def run(timing: Timing) -> SocketReply:
            await create(proxy, head.headers, head.target, body, timing, reply)
            return reply

        try:
            await guarded(proxy, "POST", ROUTE, head.headers, run, reply.fail)
        except (asyncio.CancelledError, ConnectionResetError):
            self.close()
            return  # connection lost
        finally:
            self.task = None
        if self.lost:
            return
        if not reply.keep_alive or self.front.closing:
            self.close()
            return
        self.idle = self.loop.call_later(KEEPALIVE, self.close)
        if self.reading_paused:
            self.reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        if self.buffer:
            self._next()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _hand_over(self) -> None:
        """From now on aiohttp serves this connection, starting with the bytes not yet read."""
        transport = self.transport
        assert transport is not None
        if self.idle is not None:
            self.idle.cancel()
        self.front.connections.discard(self)
        handler = self.front.web_server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self.buffer = bytes(self.buffer), bytearray()
        if data:
            handler.data_received(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class SocketReply:
    """The Reply of a request served here: HTTP/1.1 straight onto the transport."""

    __slots__ = ("conn", "keep_alive", "started", "status")

    def __init__(self, conn: FrontConnection, *, keep_alive: bool) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.started = False
        self.status = 0

    def _head(self, status: int, headers: CIMultiDict[str], framing: bytes) -> bytes:
        self.status = status
        self.started = True
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        lines = [f"HTTP/1.1 {status} {phrase}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        if self.conn.front.closing:  # shutdown began while this request ran
            self.keep_alive = False
        if not self.keep_alive:
            lines.append("Connection: close\r\n")
        return "".join(lines).encode("utf-8", "surrogateescape") + framing

    def _write(self, *data: bytes) -> None:
        transport = self.conn.transport
        if transport is not None and not transport.is_closing():
            transport.writelines(data)

    def answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self._write(self._head(status, headers, b"Content-Length: %d\r\n\r\n" % len(body)), body)

    async def start(self, status: int, headers: CIMultiDict[str]) -> None:
        self._write(self._head(status, headers, b"Transfer-Encoding: chunked\r\n\r\n"))

    async def write(self, data: bytes) -> None:
        if data:
            self._write(b"%x\r\n" % len(data), data, b"\r\n")
            await self.conn.wait_drained()

    async def end(self) -> None:
        self._write(b"0\r\n\r\n")

    def fail(self, error: OcxError) -> SocketReply:
        """guarded()'s answer to an error: the error body, or, once the head is out, the
        end of the connection (a half-sent answer cannot be taken back)."""
        if self.started:
            self.keep_alive = False
            self.status = error.status
            return self
        self.answer(error.status, CIMultiDict(error.headers()), error.body())
        return self


async def close_after_answer(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a connection aiohttp serves ends after this answer (see the
    module's docstring). Not a WebSocket's, which keeps its connection by nature, and not
    while the request's body is unread (a 413): closing then would reset the connection
    under the answer, so aiohttp reads the rest and the connection stays with it."""
    if not isinstance(response, web.WebSocketResponse) and request.content.at_eof():
        response.force_close()
        response.headers["Connection"] = "close"  # the head is already prepared: say so too


class FrontSite(web.TCPSite):
    """A TCPSite whose connections start on the FrontEnd. Stopping it stops listening,
    then lets requests served here finish within `grace` (the runner then shuts aiohttp's
    connections down, and only then the app's cleanup contexts run)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, grace: float) -> None:
        super().__init__(runner, host, port)
        self.grace = grace
        server = runner.server
        assert server is not None
        self.front = FrontEnd(runner.app[PROXY], cast(Callable[[], Any], server))

    async def start(self) -> None:
        self._runner._reg_site(self)
        loop = asyncio.get_running_loop()
        front = self.front
        self._server = await loop.create_server(
            lambda: FrontConnection(front), self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await super().stop()
        await self.front.shutdown(self.grace)
