"""HTTP/1.1 to the backends, on asyncio.Protocol; answers read by ocxproxy/h1.py.

Why not aiohttp's client: on the continuation hot path it cost about 400 µs of CPU per
request on a 2-core box, more than everything else the proxy does for a turn. This client
does only what a reverse proxy needs: keep-alive connections per backend, a request body
sent as given (`writelines`, so a spliced body is never joined twice) or streamed
chunked, and an answer read as it arrives. No redirects, cookies, proxies, decompression
or retries: the pool (pool.py) decides what to do with each failure, told apart by type.

A connection goes back to the pool only when its answer ended exactly at its framed end,
with nothing after it, and the backend allows reuse; an answer that cannot be framed
exactly (h1.BadMessage) closes it. An idle connection is retired before the backend's own
idle timeout can close it under a new request: the backend's `Keep-Alive: timeout=` less a
second, else `keepalive` (2 s by default, below uvicorn's 5 s). One whose socket holds
bytes or the end the loop has not read yet is not taken (one poll), and a backend seen to
close a connection kept after a chunked answer (llama.cpp closes after every stream,
though it answers `Keep-Alive`) has none kept after a chunked answer for `RELEARN`
seconds: a request written on a connection the backend is closing is cut off with
nothing answered, and a POST is not sent again. Then one is kept again, so a backend
replaced by one that keeps them (a restart, an upgrade) gets its connections reused,
and one that still closes them is seen to again, on the idle connection.
"""

from __future__ import annotations

import asyncio
import re
import select
import ssl
import time
from collections.abc import AsyncIterable, Mapping
from typing import cast
from urllib.parse import urlsplit

from multidict import CIMultiDictProxy

from ocxproxy.aio import FlowControlled
from ocxproxy.h1 import (
    LAST_CHUNK,
    MAX_HEAD,
    BadMessage,
    ResponseParser,
    chunk,
    encode_fields,
)

__all__ = [
    "BrokenOff",
    "ConnectFailed",
    "Disconnected",
    "Http1Client",
    "Http1Error",
    "Http1Response",
    "Unsent",
]

MAX_IDLE = 64  # kept-alive connections per backend
IDLE = 2.0  # seconds an idle connection is kept when the backend names no timeout
IDLE_MARGIN = 1.0  # retire this long before the backend's own Keep-Alive timeout
RELEARN = 60.0  # seconds none is kept after a chunked answer once the backend closed one
MAX_BUFFERED = 1024 * 1024  # body bytes read ahead of the caller before reading pauses
# Framing is the client's job, never the caller's.
_OWN_HEADERS = frozenset(
    ("host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect")
)
_KEEP_ALIVE_TIMEOUT = re.compile(r"(?:^|[,;\s])timeout\s*=\s*(\d+)", re.IGNORECASE)


class Http1Error(Exception):
    """Anything that went wrong talking to a backend, other than a timeout."""


class ConnectFailed(Http1Error):
    """No connection could be made (refused, unreachable, or not within the timeout)."""


class Disconnected(Http1Error):
    """The connection closed after the request was sent, before a status line came back:
    nothing was answered, but the backend may have acted on the request."""


class Unsent(Http1Error):
    """The connection closed before a byte of the request was written: safe to send again."""


class BrokenOff(Http1Error):
    """The answer ended early or could not be framed or passed on."""


class _Connection(FlowControlled):
    """One socket. While a request is out, the bytes that arrive go to its answer's
    parser, and a waiter is woken by them or by the end; idle, any byte spoils it."""

    __slots__ = (
        "buffered",
        "chunked",
        "closed",
        "error",
        "idle_limit",
        "idle_since",
        "loop",
        "parser",
        "paused",
        "poller",
        "transport",
        "waiter",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None  # the answer being read, if any
        self.error: BadMessage | None = None
        self.buffered = 0  # bytes received since the caller last took the body
        self.paused = False
        self.closed = False
        self.waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.idle_limit = IDLE
        self.chunked = False  # its last answer was chunked (a stream)
        self.poller: select.poll | None = None  # its socket's, for `_ended_unread`

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:  # (registered once, not at each reuse)
            self.poller = select.poll()
            self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # nothing was asked: whatever this is, the connection is spoilt
            self.close()
            return
        try:
            parser.feed(data)
        except BadMessage as exc:
            self.error = exc
        self.buffered += len(data)
        if not parser.status:  # the head: bounded, and read on whatever the caller does
            if self.buffered > MAX_HEAD and self.error is None:
                self.error = BadMessage("the head is too large")  # one endless field, say
        elif self.buffered > MAX_BUFFERED and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.drop_parser()
        self._wake()
        self.resume_writing()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def taken(self) -> None:
        """The caller took the body read so far: read on if reading was paused."""
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    async def wait(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Until more bytes arrive or the connection ends; TimeoutError after `timeout`.
        (A timer on the loop: asyncio.timeout() on every read costs several times more.)"""
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, waiter) if timeout else None
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    async def drain(self) -> None:
        await self.wait_drained()
        if self.closed:
            raise Disconnected("The connection closed while the request was being sent.")

    def drop_parser(self) -> None:
        """The answer is done with; its reader, if the caller holds it, stays readable."""
        if self.parser is not None:
            self.parser.release()
            self.parser = None

    def close(self) -> None:
        self.closed = True
        self.drop_parser()
        if self.transport is not None:
            self.transport.close()


def _ended_unread(conn: _Connection) -> bool:
    """Bytes or the end wait on an idle connection's socket that the loop has not read:
    a backend that closes as soon as it has answered (llama.cpp after a stream) when the
    next request comes in the same turn of the loop. One poll, as curl checks before
    reuse; a request written there would be cut off with nothing answered. (Asked only
    of a connection not closed: its socket's descriptor is still its own.)"""
    poller = conn.poller
    return poller is not None and bool(poller.poll(0))


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Origin:
    """One backend base URL: where to connect, the path prefix, idle connections."""

    __slots__ = ("chunked_unkept_until", "host", "host_header", "idle", "port", "prefix", "ssl")

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        secure = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if secure else 80)
        self.host_header = parts.netloc.rpartition("@")[2].encode("idna")
        self.prefix = parts.path.rstrip("/").encode()
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if secure else None
        self.idle: list[_Connection] = []
        # Until when (time.monotonic()) no connection is kept after a chunked answer: the
        # backend was seen to close one (llama.cpp does so after every stream, though it
        # answers Keep-Alive) less than RELEARN seconds before.
        self.chunked_unkept_until = 0.0

    def closed_after_chunked(self) -> None:
        """The backend closed a connection kept after a chunked answer."""
        self.chunked_unkept_until = time.monotonic() + RELEARN


class Http1Client:
    """Keep-alive HTTP/1.1 connections to any number of backends."""

    def __init__(
        self,
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
        keepalive: float = IDLE,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive = keepalive
        self._origins: dict[str, _Origin] = {}

    async def request(
        self,
        method: str,
        base: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | AsyncIterable[bytes] | None,
    ) -> Http1Response:
        """Send `method base+path` and read the answer's head. The caller reads the body
        and then calls `release()` (read to the end: the connection is kept) or `close()`."""
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _Origin(base)
        idle = self._idle(origin)
        conn = idle or await self._connect(origin)
        if conn.closed:  # a new connection the backend closed at once (an idle one is checked)
            conn.close()
            raise Unsent("The connection closed before the request was sent.")
        # Set before a byte is sent (no await in between), so an idle connection's stray
        # bytes were never taken for this answer.
        conn.parser = ResponseParser(head_only=method == "HEAD")
        try:
            await self._send(conn, origin, method, path, headers, body)
            return await Http1Response.read_head(self, conn, origin)
        except BaseException as exc:
            if idle is not None and idle.chunked and isinstance(exc, Disconnected):
                origin.closed_after_chunked()  # it closed under this request
            conn.close()
            raise

    def close(self) -> None:
        """Close the idle connections (one in use closes when its answer is done with)."""
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()

    def _idle(self, origin: _Origin) -> _Connection | None:
        """The newest idle connection still within its idle limit; stale ones are closed."""
        now = time.monotonic()
        idle = origin.idle
        kept = []
        found = None
        while idle:
            conn = idle.pop()
            if now - conn.idle_since >= conn.idle_limit:
                conn.close()
            elif conn.closed or (found is None and _ended_unread(conn)):
                if conn.chunked:
                    origin.closed_after_chunked()
                conn.close()
            elif found is None:
                found = conn
            else:
                kept.append(conn)
        kept.reverse()
        idle.extend(kept)
        return found

    def keep(
        self, conn: _Connection, origin: _Origin, keep_alive: str | None, chunked: bool
    ) -> None:
        """Pool a connection whose answer ended at its framed end; `keep_alive` is the
        answer's Keep-Alive field, whose timeout the connection is retired before;
        `chunked`: the answer was chunked (not kept from a backend that closes then)."""
        conn.drop_parser()
        now = time.monotonic()
        unkept = chunked and now < origin.chunked_unkept_until  # (the backend closes them)
        if conn.closed or len(origin.idle) >= MAX_IDLE or unkept:
            conn.close()
            return
        limit = self.keepalive
        if keep_alive is not None:
            named = _KEEP_ALIVE_TIMEOUT.search(keep_alive)
            if named:
                limit = max(0.0, int(named.group(1)) - IDLE_MARGIN)
        if limit <= 0:
            conn.close()
            return
        conn.idle_limit = limit
        conn.idle_since = now
        conn.chunked = chunked
        origin.idle.append(conn)

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl else None,
                )
        except TimeoutError:
            raise ConnectFailed("connect timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"connect failed: {exc.strerror or type(exc).__name__}") from None
        return conn

    async def _send(
        self,
        conn: _Connection,
        origin: _Origin,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | AsyncIterable[bytes] | None,
    ) -> None:
        fields = encode_fields(
            [(name, value) for name, value in headers.items() if name.lower() not in _OWN_HEADERS]
        )
        request_line = b"%s %s%s HTTP/1.1\r\nHost: %s\r\n" % (
            method.encode(),
            origin.prefix,
            path.encode(),
            origin.host_header,
        )
        head = [request_line, fields]
        transport = conn.transport
        assert transport is not None
        if body is None or isinstance(body, bytes | bytearray):
            if body or method in ("POST", "PUT", "PATCH"):
                head.append(b"Content-Length: %d\r\n" % len(body or b""))
            head.append(b"\r\n")
            if body:
                head.append(body)
            transport.writelines(head)
            return
        head.append(b"Transfer-Encoding: chunked\r\n\r\n")
        transport.writelines(head)
        async for data in body:
            if data:
                transport.writelines(chunk(data))
                await conn.drain()
        transport.write(LAST_CHUNK)


class Http1Response:
    """A backend's answer: status and headers read, the body read on demand.

    It has the surface the proxy reads from an answer (`status`, `reason`, `headers`,
    `content.readany()`, `content.at_eof()`, `content_length`, `read()`).
    """

    __slots__ = (
        "_client",
        "_conn",
        "_origin",
        "_parser",
        "content_length",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self, client: Http1Client, conn: _Connection, origin: _Origin, parser: ResponseParser
    ) -> None:
        self._client = client
        self._conn = conn
        self._origin = origin
        self._parser = parser
        self.status = parser.status
        self.reason = parser.reason
        self.headers: CIMultiDictProxy[str] = parser.headers
        self.content_length = None if parser.head_only else parser.content_length

    def __repr__(self) -> str:
        return f"<Http1Response {self.status} complete={self._parser.complete}>"

    @classmethod
    async def read_head(
        cls, client: Http1Client, conn: _Connection, origin: _Origin
    ) -> Http1Response:
        parser = conn.parser
        assert parser is not None
        while not parser.status:
            if conn.error is not None:
                raise BrokenOff(f"The answer could not be read: {conn.error}")
            if conn.closed:
                raise Disconnected("The connection closed before an answer came back.")
            await conn.wait(client.read_timeout)
        return cls(client, conn, origin, parser)

    # -- the body ------------------------------------------------------------------------

    @property
    def content(self) -> Http1Response:
        return self

    def at_eof(self) -> bool:
        return self._parser.complete and not self._parser.body

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some), b"" at the end."""
        conn, parser = self._conn, self._parser
        while True:
            parts = parser.body
            if parts:
                parser.body = []
                conn.taken()
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if parser.complete:
                return b""
            if conn.error is not None:
                raise BrokenOff(f"The answer could not be read: {conn.error}")
            if conn.closed:
                if parser.content_length is None and not parser.chunked:
                    parser.complete = True  # framed by the close: this is its end
                    return b""
                raise BrokenOff("The connection closed mid-answer.")
            await conn.wait(self._client.read_timeout)

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    # -- the connection ------------------------------------------------------------------

    def release(self) -> None:
        """Done with a body read to its end: keep the connection for the next request if
        the answer ended exactly at its framed end, with nothing after it."""
        parser, conn = self._parser, self._conn
        if (
            parser.complete
            and not parser.body
            and parser.keep_alive
            and not parser.trailing
            and conn.error is None
        ):
            self._client.keep(conn, self._origin, parser.headers.get("Keep-Alive"), parser.chunked)
        else:
            conn.close()

    def close(self) -> None:
        """Done early: close the connection, which tells the backend to stop."""
        self._conn.close()
