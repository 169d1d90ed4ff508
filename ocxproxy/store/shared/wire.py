"""The shared tier's one client of its server: a lean connection (RESP2, parsed by hiredis).

Every command goes here, the start-up checks' as a turn's: one connection per server,
commands packed once as bytes, concurrent commands pipelined on it, answers matched to
their callers in order as they arrive. The commands of one turn of the event loop go out
in one write, at its end (under load, turns on a replica share a syscall, and the server
reads and answers them together). redis-py's client spent more CPU per command than the
rest of a turn's store work (argument encoding, pool checkout, a timeout context and
retry wrapper per call); redis-py only reads the URL here (host/port, unix socket, TLS
context, user, password, db: the URLs its clients accept), and never connects.

One policy for time and retries: CONNECT_TIMEOUT to open a connection, STALL for an
answer; the caller (shared_server.Server.round_trip) tries a command once more on a
fresh connection after a connection error, never more.

Failures are OSError (the caller's StorageUnavailable): a refused or lost connection
fails every command waiting on it, and the next command opens a new one. An error reply
comes back as a ReplyError value, not raised. A server that leaves a command unanswered
for STALL seconds is cut off by the store's probe (`stalled`, asked every second).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import hiredis
import redis.asyncio as aioredis

CONNECT_TIMEOUT = 2.0
STALL = 5.0  # seconds without an answer while commands wait: the connection is cut


class ReplyError(Exception):
    """An error reply (-ERR ..., -NOSCRIPT ..., a script's error)."""


def pack(*args: bytes | str | int) -> bytes:
    """One command in RESP: an array of bulk strings (hiredis's packer: C, twice as fast
    as building it here)."""
    packed: bytes = hiredis.pack_command(args)  # type: ignore[arg-type]  # (its stub's 1-tuple)
    return packed


class Wire(asyncio.Protocol):
    """One connection: `send` writes packed commands, each answered by a future in order."""

    def __init__(self) -> None:
        self._parser = hiredis.Reader(replyError=ReplyError)
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: Any = None  # asyncio's or uvloop's transport
        self.lost: Exception | None = None
        self.progress = 0.0  # when it last answered, or was sent to while idle
        self._corked: list[bytes] = []  # sent during this turn of the event loop, not written
        # The loop it was made on: asyncio.get_running_loop() costs a getpid() syscall.
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        parser, waiting = self._parser, self._waiting
        parser.feed(data)
        try:
            while (reply := parser.gets()) is not False:
                future = waiting.popleft()
                if not future.done():  # its caller may have been cancelled
                    future.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or an unasked answer
            self.close(ConnectionError(f"shared store sent an unreadable answer: {exc}"))
        self.progress = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"shared store connection lost: {exc or 'closed'}"))

    def _fail(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(self.lost)

    def send(self, packed: bytes, answers: int = 1) -> list[asyncio.Future[Any]]:
        """Write `packed` (one or more commands); a future per answer it takes."""
        if self.lost is not None or self._transport is None:
            raise ConnectionError(f"shared store connection lost: {self.lost}")
        loop = self._loop
        futures = [loop.create_future() for _ in range(answers)]
        if self._corked:
            self._corked.append(packed)
        else:  # the commands of this turn of the loop go out together, in one write
            if not self._waiting:  # (an idle connection: its stall clock starts now)
                self.progress = time.monotonic()
            self._corked = [packed]
            loop.call_soon(self._flush)
        self._waiting.extend(futures)
        return futures

    def _flush(self) -> None:
        """One write (one syscall) for every command sent in the same turn of the loop."""
        corked, self._corked = self._corked, []
        if self.lost is None:
            self._transport.write(corked[0] if len(corked) == 1 else b"".join(corked))

    async def ask(self, *args: bytes | str | int) -> Any:
        """One command's answer (a ReplyError raised)."""
        (future,) = self.send(pack(*args))
        reply = await future
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    def stalled(self, now: float) -> bool:
        return bool(self._waiting) and now - self.progress > STALL

    @property
    def busy(self) -> bool:
        """Commands wait for their answers (the server is answering, or is stalled)."""
        return bool(self._waiting)

    def close(self, exc: Exception | None = None) -> None:
        self._fail(exc or ConnectionError("shared store connection closed"))
        if self._transport is not None:
            self._transport.abort()


W = TypeVar("W", bound=Wire)


async def open_wire(url: str, protocol: Callable[[], W] = Wire) -> W:  # type: ignore[assignment]
    """A connection to the server at `url`, authenticated, on its db (`protocol`: a Wire,
    or a subclass that reads more than answers: background.py's subscriber)."""
    pool = aioredis.ConnectionPool.from_url(url)  # redis-py's reading of the URL
    conn: Any = pool.connection_class(**pool.connection_kwargs)  # not connected: settings
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(CONNECT_TIMEOUT):
        if getattr(conn, "path", None):  # unix://
            _, wire = await loop.create_unix_connection(protocol, conn.path)
        else:
            ssl_context = conn.ssl_context.get() if hasattr(conn, "ssl_context") else None
            _, wire = await loop.create_connection(protocol, conn.host, conn.port, ssl=ssl_context)
        try:
            if conn.password:
                user = [conn.username] if conn.username else []
                await wire.ask("AUTH", *user, conn.password)
            if conn.db:
                await wire.ask("SELECT", conn.db)
        except BaseException:
            wire.close()
            raise
    return wire
