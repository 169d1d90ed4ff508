"""HTTP/1.1 to the backends, written by hand on asyncio.Protocol.

Why not aiohttp's client: on the continuation hot path it cost about 400 µs of CPU per
request on a 2-core box, more than everything else the proxy does for a turn. This client
does only what a reverse proxy needs: keep-alive connections per backend, a request body
sent as given (`writelines`, so a spliced body is never joined twice) or streamed
chunked, and an answer framed by Content-Length, chunked encoding or the connection's
close, read as it arrives. No redirects, cookies, proxies, decompression or retries: the
pool (client.py) decides what to do with each failure, told apart by type here.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import AsyncIterable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

from multidict import CIMultiDict, CIMultiDictProxy

from ocxproxy.aio import FlowControlled

__all__ = [
    "BrokenOff",
    "ConnectFailed",
    "Disconnected",
    "Http1Client",
    "Http1Error",
    "Http1Response",
]

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_CHUNK_LINE = 4096
MAX_IDLE = 64  # kept-alive connections per backend
# Framing is the client's job, never the caller's.
_OWN_HEADERS = frozenset(
    ("host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect")
)
_NO_BODY_STATUS = frozenset((204, 304))
_HEX = b"0123456789abcdefABCDEF"


# Control bytes other than tab: searched for once the CRLF pairs are gone (a lookaround
# pattern for "CR or LF outside a pair" costs ~13 µs a head, this ~2 µs).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def has_control_bytes(head: bytes) -> bool:
    """A bare CR or LF, NUL or another control byte in an HTTP head (CRLF line ends
    excluded): never passed on, since it could split one header into two."""
    return _CONTROL.search(head.replace(b"\r\n", b"")) is not None


def _is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # isdigit() alone takes "²"


class Http1Error(Exception):
    """Anything that went wrong talking to a backend, other than a timeout."""


class ConnectFailed(Http1Error):
    """No connection could be made (refused, unreachable, or not within the timeout)."""


class Disconnected(Http1Error):
    """The connection closed before a status line came back: nothing was answered."""


class BrokenOff(Http1Error):
    """The answer ended early or could not be parsed."""


class _Connection(FlowControlled):
    """One socket: bytes in a buffer, a waiter woken by new data or by the end."""

    __slots__ = ("buffer", "closed", "idle_since", "loop", "transport", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()
        self.resume_writing()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Origin:
    """One backend base URL: where to connect, the path prefix, idle connections."""

    __slots__ = ("host", "host_header", "idle", "port", "prefix", "ssl")

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        secure = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if secure else 80)
        self.host_header = parts.netloc.rpartition("@")[2].encode("idna")
        self.prefix = parts.path.rstrip("/").encode()
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if secure else None
        self.idle: list[_Connection] = []


class Http1Client:
    """Keep-alive HTTP/1.1 connections to any number of backends."""

    def __init__(
        self,
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
        keepalive: float = 60.0,
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
        conn = self._idle(origin) or await self._connect(origin)
        try:
            await self._send(conn, origin, method, path, headers, body)
            return await Http1Response.read_head(self, conn, origin, method == "HEAD")
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        """Close the idle connections (one in use closes when its answer is done with)."""
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()

    def _idle(self, origin: _Origin) -> _Connection | None:
        """The newest usable idle connection; stale ones (the oldest first) are closed."""
        oldest = time.monotonic() - self.keepalive
        idle = origin.idle
        while idle and idle[0].idle_since <= oldest:
            idle.pop(0).close()
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > oldest and not conn.buffer:
                return conn
            conn.close()
        return None

    def keep(self, conn: _Connection, origin: _Origin) -> None:
        if conn.closed or len(origin.idle) >= MAX_IDLE:
            conn.close()
            return
        conn.idle_since = time.monotonic()
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
        lines = [
            f"{name}: {value}\r\n"
            for name, value in headers.items()
            if name.lower() not in _OWN_HEADERS
        ]
        fields = "".join(lines)
        if fields.count("\n") != len(lines) or fields.count("\r") != len(lines):
            raise ValueError("a header holds a line break")  # one CRLF per line, no more
        request_line = b"%s %s%s HTTP/1.1\r\nHost: %s\r\n" % (
            method.encode(),
            origin.prefix,
            path.encode(),
            origin.host_header,
        )
        head = [request_line, fields.encode("utf-8", "surrogateescape")]
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
        async for chunk in body:
            if chunk:
                transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                await conn.drain()
        transport.write(b"0\r\n\r\n")


class Http1Response:
    """A backend's answer: status and headers read, the body read on demand.

    It has the surface the proxy reads from an answer (`status`, `reason`, `headers`,
    `content.readany()`, `content.at_eof()`, `content_length`, `read()`).
    """

    __slots__ = (
        "_chunk_left",
        "_client",
        "_conn",
        "_framing",
        "_in_trailers",
        "_keep_alive",
        "_left",
        "_origin",
        "_want_crlf",
        "content_length",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self,
        client: Http1Client,
        conn: _Connection,
        origin: _Origin,
        status: int,
        reason: str,
        headers: CIMultiDict[str],
        keep_alive: bool,
        no_body: bool,
    ) -> None:
        self._client = client
        self._conn = conn
        self._origin = origin
        self.status = status
        self.reason = reason
        self.headers = CIMultiDictProxy(headers)
        self._keep_alive = keep_alive
        self._chunk_left = 0
        self._want_crlf = False
        self._in_trailers = False
        self._left = 0
        self.content_length: int | None = None
        length = headers.get("Content-Length")
        if no_body:
            self._framing = "done"
        elif "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._framing = "chunked"
        elif length is not None:
            if not _is_digits(length.strip()):
                raise BrokenOff(f"bad Content-Length {length!r}")
            self.content_length = self._left = int(length)
            self._framing = "length" if self._left else "done"
        else:
            self._framing = "close"
            self._keep_alive = False

    def __repr__(self) -> str:
        return f"<Http1Response {self.status} {self._framing}>"

    @classmethod
    async def read_head(
        cls, client: Http1Client, conn: _Connection, origin: _Origin, head_only: bool
    ) -> Http1Response:
        buffer = conn.buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    raise BrokenOff("the answer's headers are too large")
                if conn.closed:
                    raise Disconnected("The connection closed before an answer came back.")
                await conn.wait(client.read_timeout)
                continue
            head = bytes(buffer[:end])
            del buffer[: end + 4]
            if end > MAX_HEAD or has_control_bytes(head):
                raise BrokenOff("the answer's head is too large or holds control bytes")
            # As aiohttp decodes heads, and as front.py encodes them again: byte-exact.
            lines = head.decode("utf-8", "surrogateescape").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or not _is_digits(code) or len(code) != 3:
                raise BrokenOff(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): skip
                continue
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if not colon or not name or name != name.strip():
                    raise BrokenOff(f"bad header line: {line[:80]!r}")
                headers.add(name, value.strip())
            connection = headers.get("Connection", "").lower()
            keep_alive = version == "HTTP/1.1" and "close" not in connection
            no_body = head_only or status in _NO_BODY_STATUS
            return cls(client, conn, origin, status, reason, headers, keep_alive, no_body)

    # -- the body ------------------------------------------------------------------------

    @property
    def content(self) -> Http1Response:
        return self

    def at_eof(self) -> bool:
        return self._framing == "done"

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some), b"" at the end."""
        conn = self._conn
        while self._framing != "done":
            chunk = self._take()
            if chunk:
                return chunk
            if self._framing == "done":
                break
            if conn.closed:
                if self._framing == "close":
                    self._framing = "done"
                    break
                raise BrokenOff("The connection closed mid-answer.")
            await conn.wait(self._client.read_timeout)
        return b""

    async def read(self) -> bytes:
        """The whole body; a Content-Length body is taken in one slice once all is in."""
        if self._framing == "length":
            conn = self._conn
            while len(conn.buffer) < self._left:
                if conn.closed:
                    raise BrokenOff("The connection closed mid-answer.")
                await conn.wait(self._client.read_timeout)
            body = bytes(conn.buffer[: self._left])
            del conn.buffer[: self._left]
            self._left = 0
            self._framing = "done"
            return body
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def _take(self) -> bytes:
        buffer = self._conn.buffer
        if not buffer:
            return b""
        framing = self._framing
        if framing == "close":
            data = bytes(buffer)
            buffer.clear()
            return data
        if framing == "length":
            n = min(len(buffer), self._left)
            data = bytes(buffer[:n])
            del buffer[:n]
            self._left -= n
            if not self._left:
                self._framing = "done"
            return data
        return self._take_chunked(buffer)

    def _take_chunked(self, buffer: bytearray) -> bytes:
        parts: list[Any] = []
        pos, size = 0, len(buffer)
        while pos < size:
            if self._chunk_left:
                n = min(size - pos, self._chunk_left)
                parts.append(buffer[pos : pos + n])
                pos += n
                self._chunk_left -= n
                if self._chunk_left:
                    break
                self._want_crlf = True
                continue
            if self._want_crlf:
                if size - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise BrokenOff("bad chunked encoding: no CRLF after a chunk")
                pos += 2
                self._want_crlf = False
                continue
            end = buffer.find(b"\r\n", pos)
            if end < 0:
                if size - pos > MAX_CHUNK_LINE:
                    raise BrokenOff("bad chunked encoding: chunk size line too long")
                break
            line = buffer[pos:end]
            pos = end + 2
            if self._in_trailers:
                if not line:
                    self._framing = "done"
                    break
                continue
            digits = bytes(line.split(b";", 1)[0]).rstrip(b" \t")
            if not digits or digits.strip(_HEX):
                raise BrokenOff("bad chunked encoding: bad chunk size")
            chunk_size = int(digits, 16)
            if chunk_size == 0:
                self._in_trailers = True
            self._chunk_left = chunk_size
        del buffer[:pos]
        return b"".join(parts)

    # -- the connection ------------------------------------------------------------------

    def release(self) -> None:
        """Done with a body read to its end: keep the connection for the next request."""
        if self._framing == "done" and self._keep_alive and not self._conn.buffer:
            self._client.keep(self._conn, self._origin)
        else:
            self._conn.close()

    def close(self) -> None:
        """Done early: close the connection, which tells the backend to stop."""
        self._conn.close()
