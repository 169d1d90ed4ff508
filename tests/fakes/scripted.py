"""ScriptedPeer: a backend on a bare socket that says exactly the bytes a test scripted.

It reads each request (framed by Content-Length or chunked encoding, read by hand here,
not by the code under test) and answers it with the steps the test queued, in order, or,
when none are queued, with its standing answer: bytes written as they are (then drained),
a pause of that many seconds, a wait for an asyncio.Event, or None to close the
connection. It records every byte received and each request, so tests see exactly what
the proxy sent, and can send answers no real server would (desyncs, bad framing).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson

Step = bytes | float | asyncio.Event | None


@dataclass
class Conn:
    """One TCP connection the peer accepted."""

    received: bytearray = field(default_factory=bytearray)  # every byte, partial included
    requests: list[bytes] = field(default_factory=list)  # each complete request, raw
    bodies: list[bytes] = field(default_factory=list)  # each request's body, de-chunked
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the connection is over


class ScriptedPeer:
    """Answers the requests it reads with the queued answers, else the standing one."""

    def __init__(self, *standing: Step) -> None:
        self.standing: list[Step] = list(standing)
        self.answers: list[list[Step]] = []
        self.connections: list[Conn] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return self.base()

    def base(self, prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{prefix}"

    def answer(self, *steps: Step) -> None:
        self.answers.append(list(steps))

    @property
    def requests(self) -> list[bytes]:
        return [request for conn in self.connections for request in conn.requests]

    @property
    def heads(self) -> list[bytes]:
        return [request.partition(b"\r\n\r\n")[0] + b"\r\n\r\n" for request in self.requests]

    @property
    def bodies(self) -> list[bytes]:
        return [body for conn in self.connections for body in conn.bodies]

    async def __aenter__(self) -> ScriptedPeer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

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
                request, body = await read_request(reader, conn)
                conn.requests.append(request)
                conn.bodies.append(body)
                steps = self.answers.pop(0) if self.answers else self.standing
                for step in steps:
                    if step is None:
                        return
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    elif isinstance(step, asyncio.Event):
                        async with asyncio.timeout(5):
                            await step.wait()
                    else:
                        writer.write(step)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            conn.done.set()


async def read_request(reader: asyncio.StreamReader, conn: Conn) -> tuple[bytes, bytes]:
    """One request's raw bytes and its body, framed by Content-Length or chunked."""
    raw = bytearray()
    body = bytearray()

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
        body += await take(n=int(length[0]))
    elif ("transfer-encoding", "chunked") in [(k.lower(), v) for k, v in fields]:
        while size := int((await take(b"\r\n")).split(b";")[0], 16):
            body += (await take(n=size + 2))[:-2]
        while await take(b"\r\n") != b"\r\n":  # trailers
            pass
    return bytes(raw), bytes(body)


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


def json_answer(doc: Any, *headers: bytes) -> bytes:
    return ok(orjson.dumps(doc), b"Content-Type: application/json", *headers)


def chunked(
    pieces: list[bytes], *, hold_at: int | None = None, release: asyncio.Event | None = None
) -> list[Step]:
    """A chunked text/event-stream answer, one chunk per piece a few ms apart; with
    `hold_at=k`, it stops after k pieces until `release` is set."""
    steps: list[Step] = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    ]
    for index, piece in enumerate(pieces):
        if index == hold_at:
            steps.append(release)
        steps += [b"%x\r\n%s\r\n" % (len(piece), piece), 0.005]
    if hold_at == len(pieces):
        steps.append(release)
    steps.append(b"0\r\n\r\n")
    return steps


def trickle(data: bytes, pause: float = 0.001) -> list[Step]:
    """`data` written one byte at a time, with a pause after each."""
    steps: list[Step] = []
    for i in range(len(data)):
        steps += [data[i : i + 1], pause]
    return steps
