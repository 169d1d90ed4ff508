"""The benchmarks' own loopback HTTP/1.1: one hand-written server, one client, one way to
listen. Not ocxproxy's code: the yardsticks and load generators must cost as little CPU as
possible next to the proxy they measure, so they skip aiohttp where asked.

Only what the benchmarks send: keep-alive, requests framed by Content-Length, answers by
Content-Length or chunked encoding, no pipelining.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.I)
_CONTENT_TYPE = re.compile(rb"\r\ncontent-type: *([^\r;]+)", re.I)

# (request head, body) → (content type, payload), at once or after an await
Answer = tuple[bytes, bytes]
Handler = Callable[[bytes, bytes], Answer | Awaitable[Answer]]


def message_length(buffer: bytes | bytearray) -> int:
    """The length of the first whole HTTP message in `buffer` (Content-Length or chunked
    framing), else 0."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return 0
    m = CONTENT_LENGTH.search(buffer, 0, end + 2)
    if m is not None:
        total = end + 4 + int(m.group(1))
        return total if len(buffer) >= total else 0
    last = buffer.find(b"\r\n0\r\n\r\n", end)
    return last + 7 if last >= 0 else 0


class RawServer(asyncio.Protocol):
    """One keep-alive connection: each request whole (Content-Length bodies) to `handler`,
    its answer written with a Content-Length. A handler that answers at once costs no task."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.buffer = bytearray()
        self.body_start = 0
        self.end: int | None = None
        self.transport: Any = None  # uvloop's transport is no asyncio.Transport subclass

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.end is None:
                head_end = self.buffer.find(b"\r\n\r\n")
                if head_end < 0:
                    return
                m = CONTENT_LENGTH.search(self.buffer, 0, head_end + 2)
                self.body_start = head_end + 4
                self.end = self.body_start + (int(m.group(1)) if m else 0)
            if len(self.buffer) < self.end:
                return
            head = bytes(self.buffer[: self.body_start])
            body = bytes(self.buffer[self.body_start : self.end])
            del self.buffer[: self.end]
            self.end = None
            answer = self.handler(head, body)
            if isinstance(answer, tuple):
                self._write(answer)
            else:
                task = asyncio.ensure_future(self._later(answer))
                _TASKS.add(task)
                task.add_done_callback(_TASKS.discard)

    async def _later(self, answer: Awaitable[Answer]) -> None:
        self._write(await answer)

    def _write(self, answer: Answer) -> None:
        kind, payload = answer
        head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
        self.transport.writelines((head % (kind, len(payload)), payload))


_TASKS: set[asyncio.Task[None]] = set()


class RawClient:
    """HTTP/1.1 keep-alive POSTs over one connection; Content-Length or chunked answers."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bytes]:
        """(status, content type, body) of the answer."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: %d\r\n\r\n"
        self.writer.writelines((head % (path.encode(), self.host.encode(), len(body)), body))
        response = await self.reader.readuntil(b"\r\n\r\n")
        status = int(response[9:12])
        m = _CONTENT_TYPE.search(response)
        kind = m.group(1) if m else b"application/json"
        m = CONTENT_LENGTH.search(response)
        if m is not None:
            return status, kind, await self.reader.readexactly(int(m.group(1)))
        chunks: list[bytes] = []
        while True:  # chunked
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return status, kind, b"".join(chunks)
            chunks.append(chunk[:-2])

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def serve(
    port: int,
    banner: str,
    *,
    app: web.Application | None = None,
    handler: Handler | None = None,
) -> None:
    """Serve `app` on aiohttp, or `handler` on RawServer, on 127.0.0.1:`port` (0: a free
    one) until cancelled. Prints `banner` with the URL (`{url}`) once it is listening."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    if handler is not None:
        sock.listen(1024)
        server = await asyncio.get_running_loop().create_server(
            lambda: RawServer(handler), sock=sock
        )
        print(banner.format(url=url), flush=True)
        async with server:
            await server.serve_forever()
        return
    assert app is not None
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=1024).start()
    print(banner.format(url=url), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run a server's main coroutine on uvloop when it is installed, until Ctrl-C."""
    try:
        import uvloop
    except ImportError:
        runner: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
    else:
        runner = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(main)
