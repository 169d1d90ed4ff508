"""The listening socket: `POST /v1/responses` served here, the rest by aiohttp.

Why: per continuation turn, aiohttp's server (request and response objects, router,
middleware chain, payload streams) cost about as much CPU as everything else the proxy
does. Coding agents send almost nothing but `POST /v1/responses`, so that one request
gets a lean path; every other request keeps aiohttp.

A connection starts here, and every request head is read here, by ocxproxy/h1.py (llhttp):
a malformed one, or one that cannot be framed, gets 400 and the connection closes. A
plain `POST /v1/responses` (HTTP/1.1, a Content-Length within `--max-body-bytes`, no
Expect or Upgrade) is served here, by the same `guarded()` (errors, counts, overhead) and
`exchange.create` as aiohttp's route. The first request that is anything else is handed,
with the connection and every byte not yet read, to aiohttp's RequestHandler, which owns
the connection from then on (through `_HandedOver`, which keeps the body timeout and the
connection count). aiohttp closes a handed-over connection after its answer
(`Connection: close`; not a WebSocket's, nor one whose body it did not read), so the
client's next request opens a new connection that starts here again: one GET of a model
list does not put an agent's turns on the slow path for the rest of its connection's life.

Time limits (config): a head must be complete within `head_timeout` of its first byte; a
body may pause at most `body_timeout` between reads (both: 408 and close); an idle
connection closes after `keepalive_timeout`. Past `max_connections` open client
connections, a new one gets 503 and is closed. At a graceful stop, a request in flight has
until `shutdown_timeout` to finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from multidict import CIMultiDict

from ocxproxy.aio import FlowControlled
from ocxproxy.errors import InvalidRequest, OcxError
from ocxproxy.h1 import (
    LAST_CHUNK,
    MAX_HEAD,
    BadMessage,
    RequestHead,
    RequestParser,
    chunk,
    encode_fields,
    status_line,
)
from ocxproxy.http.body import codings_of, decoded
from ocxproxy.http.context import PROXY, V1, Proxy, Stopping
from ocxproxy.http.exchange import create
from ocxproxy.http.headers import answer_request_id, new_request_id, request_id
from ocxproxy.http.middleware import guarded
from ocxproxy.metrics import Timing
from ocxproxy.upstream.sse import Event, wire

ROUTE = "/v1/responses"
_BARE = ROUTE.removeprefix(V1)  # a client whose base URL lacks /v1


def _ours(head: RequestHead) -> bool:
    """A request this front end serves: a plain create with a Content-Length."""
    target = head.target
    return (
        head.method == "POST"
        and (target in (ROUTE, _BARE) or target.startswith((ROUTE + "?", _BARE + "?")))
        and head.version == "1.1"
        and head.length is not None
        and not head.expect
        and not head.upgrade
    )


class FrontEnd:
    """What the connections share: the proxy, aiohttp's handler factory, who is open."""

    def __init__(self, proxy: Proxy, web_server: Callable[[], asyncio.Protocol]) -> None:
        self.proxy = proxy
        self.config = proxy.config
        self.web_server = web_server
        self.connections: set[FrontConnection] = set()
        self.handed: set[_HandedOver] = set()  # connections aiohttp serves now
        self.closing = False

    def full(self) -> bool:
        cap = self.config.max_connections
        return bool(cap) and len(self.connections) + len(self.handed) >= cap

    async def shutdown(self, stopping: Stopping) -> None:
        """Close idle connections now, let requests in flight finish by the deadline; cut
        the rest then (each ends with ShuttingDown: a 503, or an `error` event ending its
        stream), and close their connections."""
        self.closing = True
        busy = []
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()
            else:
                busy.append(conn.task)
        await stopping.finish(busy)
        for conn in list(self.connections):
            conn.close()


def _refuse(transport: asyncio.BaseTransport, error: OcxError) -> None:
    """An error answer, then the end of the connection."""
    body = error.body()
    headers = [*error.headers().items(), ("X-Request-Id", new_request_id())]
    fields = encode_fields([*headers, ("Connection", "close")])
    head = status_line(error.status) + fields + b"Content-Length: %d\r\n\r\n" % len(body)
    cast(asyncio.Transport, transport).writelines((head, body))
    transport.close()


def _timed_out() -> OcxError:
    return InvalidRequest("The request was not sent in time.", code="request_timeout", status=408)


class FrontConnection(FlowControlled):
    """One client connection, until it is closed or handed to aiohttp."""

    def __init__(self, front: FrontEnd) -> None:
        super().__init__()
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.parser = RequestParser()
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_for = ""  # what the timer bounds: "idle", "head" or "body"
        self.last_read = 0.0
        self.reading_paused = False
        self.lost = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self.front.full():
            error = OcxError("Too many open connections.", code="too_many_connections")
            error.status = 503
            _refuse(transport, error)
            return
        self.front.connections.add(self)
        self._idle()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.last_read = self.loop.time()
        if self.task is None:
            self._next()
        elif len(self.buffer) > self.front.config.max_body_bytes + MAX_HEAD:
            self._pause_reading()  # pipelined far ahead of the request in flight

    def eof_received(self) -> bool:
        return False  # the client is done sending: close (a request in flight is cancelled)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.parser.release()
        self.front.connections.discard(self)
        self._stop_timer()
        if self.task is not None:
            self.task.cancel()  # the client went away: so does the backend request
        self.resume_writing()

    # -- timers --------------------------------------------------------------------------

    def _start_timer(self, purpose: str, delay: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer_for = purpose
        self.timer = self.loop.call_later(delay, self._expired)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.timer_for = ""

    def _idle(self) -> None:
        self._start_timer("idle", self.front.config.keepalive_timeout)

    def _expired(self) -> None:
        self.timer = None
        if self.timer_for == "body":  # idle between reads, not since the head
            left = self.last_read + self.front.config.body_timeout - self.loop.time()
            if left > 0:
                self.timer = self.loop.call_later(left, self._expired)
                return
        if self.timer_for == "idle":
            self.close()
        elif self.transport is not None:
            _refuse(self.transport, _timed_out())

    # -- requests ------------------------------------------------------------------------

    def _next(self) -> None:
        """Start the next request if all of it is in; hand over one that is not ours."""
        buffer = self.buffer
        parser = self.parser
        head = parser.head
        if head is None:
            try:
                head = parser.feed_head(buffer)
            except BadMessage as exc:
                assert self.transport is not None
                self._stop_timer()
                _refuse(self.transport, InvalidRequest(f"Malformed HTTP request: {exc}."))
                return
            if head is None:
                if buffer and self.timer_for != "head":
                    self._start_timer("head", self.front.config.head_timeout)
                return
            if not _ours(head) or cast(int, head.length) > self.front.config.max_body_bytes:
                self._hand_over(head)  # aiohttp serves it, or answers 413 like the route does
                return
        assert head.length is not None
        if len(buffer) < head.size + head.length:
            if self.timer_for != "body":
                self._start_timer("body", self.front.config.body_timeout)
            return
        self._stop_timer()
        body = parser.feed_body(buffer)
        self.task = self.loop.create_task(self._serve(head, body))

    async def _serve(self, head: RequestHead, body: bytes) -> None:
        proxy = self.front.proxy
        timing = Timing(request_id(head.headers))
        keep_alive = head.keep_alive and not self.front.closing
        reply = SocketReply(self, timing.request_id, keep_alive=keep_alive)
        target = head.target if head.target.startswith(ROUTE) else V1 + head.target

        async def run(timing: Timing) -> SocketReply:
            codings = codings_of(head.headers)
            raw = await decoded(codings, body, proxy.config.max_body_bytes) if codings else body
            await create(proxy, head.headers, target, raw, timing, reply)
            return reply

        try:
            await guarded(proxy, "POST", ROUTE, head.headers, timing, run, reply.fail)
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
        if self.reading_paused:
            self.reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        if self.buffer:
            self._next()
        else:
            self._idle()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _hand_over(self, head: RequestHead) -> None:
        """From now on aiohttp serves this connection, starting with the bytes not yet read."""
        transport = self.transport
        assert transport is not None
        self._stop_timer()
        self.front.connections.discard(self)
        handler = self.front.web_server()
        watch = _HandedOver(self.front, handler, head, self.parser, self.loop)
        transport.set_protocol(watch)
        handler.connection_made(transport)
        watch.transport = transport
        data, self.buffer = bytes(self.buffer), bytearray()
        watch.received(data, head.size)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _HandedOver(asyncio.Protocol):
    """A connection aiohttp serves: every call goes on to aiohttp's handler. Until the
    body of the request being read is in, the client may pause at most `body_timeout`
    between reads (aiohttp has no such limit); the connection counts as open here."""

    def __init__(
        self,
        front: FrontEnd,
        handler: asyncio.Protocol,
        head: RequestHead,
        parser: RequestParser,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.front = front
        self.handler = handler
        self.parser = parser
        parser.keep_body = False  # aiohttp reads the body; this only frames it
        self.loop = loop
        self.transport: asyncio.BaseTransport | None = None
        self.watching = not head.upgrade  # after an upgrade, the bytes are not HTTP
        self.last_read = loop.time()
        self.timer: asyncio.TimerHandle | None = None
        front.handed.add(self)

    def received(self, data: bytes, offset: int = 0) -> None:
        """Bytes for aiohttp; the parser reads them from `offset` on (the head is read)."""
        self.handler.data_received(data)
        if not self.watching:
            return
        parser = self.parser
        self.last_read = self.loop.time()
        fed = memoryview(data)[offset:]
        try:
            if parser.complete and fed:
                parser.next()
            parser.feed(fed)
        except BadMessage:
            self.watching = False  # aiohttp answers it as it sees fit, then closes
        head = parser.head
        if head is not None and head.upgrade:
            self.watching = False  # what follows is not HTTP
        reading = not parser.complete and (head is not None or bool(fed))
        if not (self.watching and reading):
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
        elif self.timer is None:
            self.timer = self.loop.call_later(self.front.config.body_timeout, self._expired)

    def _expired(self) -> None:
        left = self.last_read + self.front.config.body_timeout - self.loop.time()
        if left > 0:
            self.timer = self.loop.call_later(left, self._expired)
            return
        self.timer = None
        if self.transport is not None:
            _refuse(self.transport, _timed_out())

    def data_received(self, data: bytes) -> None:
        self.received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.parser.release()
        self.front.handed.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class SocketReply:
    """The Reply of a request served here: HTTP/1.1 straight onto the transport."""

    __slots__ = ("conn", "keep_alive", "request_id", "started", "status")

    def __init__(self, conn: FrontConnection, request_id: str, *, keep_alive: bool) -> None:
        self.conn = conn
        self.request_id = request_id
        self.keep_alive = keep_alive
        self.started = False
        self.status = 0

    def _head(self, status: int, headers: CIMultiDict[str], framing: bytes) -> bytes:
        self.status = status
        self.started = True
        if self.conn.front.closing:  # shutdown began while this request ran
            self.keep_alive = False
        answer_request_id(headers, self.request_id)
        fields = encode_fields(list(headers.items()))
        close = b"" if self.keep_alive else b"Connection: close\r\n"
        return b"".join((status_line(status), fields, close, framing))

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
            self._write(*chunk(data))
            await self.conn.wait_drained()

    async def write_events(self, events: list[Event]) -> None:
        if events:  # (uvloop writes the parts with one writev: no join, no copy)
            self._write(*wire(events, True))
            await self.conn.wait_drained()

    async def end(self) -> None:
        self._write(LAST_CHUNK)

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
    """A TCPSite whose connections start on the FrontEnd. Stopping it (once the proxy's
    `stopping` is set) stops listening, then lets requests served here finish by the
    deadline (the runner then shuts aiohttp's connections down, and only then the app's
    cleanup contexts run)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner, host, port)
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
        await self.front.shutdown(self.front.proxy.stop())
