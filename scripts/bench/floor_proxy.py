"""The least a continuation proxy on aiohttp can do, as a yardstick for ocxproxy's overhead.

One aiohttp server, one keep-alive ClientSession, an in-memory dict of response id →
history bytes, and the same byte splice as ocxproxy. No metrics, no validation, no
header filtering, no limits, no affinity, no error mapping, no eviction. It is what the
framework costs; whatever ocxproxy spends above it is its own.

`--upstream-client raw` swaps aiohttp's client for a hand-written HTTP/1.1 keep-alive
pool (asyncio streams), and `--server raw` aiohttp's server for an asyncio.Protocol
(Content-Length bodies; an SSE answer is passed on whole): what each side of aiohttp
costs per request.

    python scripts/floor_proxy.py --upstream URL --port 0   # prints "... listening on URL/v1"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web

_TERMINAL = re.compile(rb"^data: (\{\"type\":\"response\.completed\".*)$", re.M)
_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.I)
_TYPE = re.compile(rb"\r\ncontent-type: *([^\r;]+)", re.I)


class RawPool:
    """Keep-alive HTTP/1.1 POSTs to one backend; Content-Length or chunked answers."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: bytes, body: bytes) -> tuple[bytes, bytes]:
        """(content type, body) of the answer."""
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: %d\r\n\r\n"
        writer.writelines((head % (path, self.host.encode(), len(body)), body))  # no join
        response = await reader.readuntil(b"\r\n\r\n")
        m = _TYPE.search(response)
        kind = m.group(1) if m else b"application/json"
        m = _LENGTH.search(response)
        if m is not None:
            data = await reader.readexactly(int(m.group(1)))
        else:
            chunks = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                chunks.append(chunk[:-2])
            data = b"".join(chunks)
        self.idle.append((reader, writer))
        return kind, data


class Floor:
    def __init__(self, upstream: str, raw_client: bool) -> None:
        self.url = upstream.rstrip("/") + "/v1/responses"
        self.history: dict[str, tuple[bytes, ...]] = {}  # response id → chain segments
        self.session: aiohttp.ClientSession | None = None
        self.pool = RawPool(upstream) if raw_client else None

    def splice(self, raw: bytes) -> tuple[bytes, bytes, tuple[bytes, ...]]:
        """(forwarded body, own items, history segments) for a client body; the history
        is copied once, by the one join."""
        body = orjson.loads(raw)
        prev = body.pop("previous_response_id", None)
        items = body.pop("input", [])
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        own = b",".join(orjson.dumps(item) for item in items)
        prefix = self.history[prev] if prev else ()
        head = orjson.dumps(body)
        parts = [b","] * (2 * len(prefix) + 1)
        parts[0] = head[:-1] + (b',"input":[' if body else b'"input":[')
        parts[1::2] = prefix
        if own:
            parts.append(own)
        elif prefix:
            parts.pop()
        parts.append(b"]}")
        return b"".join(parts), own, prefix

    async def handle_raw(self, raw: bytes) -> tuple[bytes, bytes]:
        """For the raw server: the whole answer (content type, body)."""
        data, own, prefix = self.splice(raw)
        if self.pool is not None:
            kind, answer = await self.pool.post(b"/v1/responses", data)
        else:
            assert self.session is not None
            headers = {"Content-Type": "application/json"}
            async with self.session.post(self.url, data=data, headers=headers) as upstream:
                kind, answer = upstream.content_type.encode(), await upstream.read()
        if kind == b"text/event-stream":
            m = _TERMINAL.search(answer)
            if m:
                self.remember(orjson.loads(m.group(1))["response"], own, prefix)
        else:
            self.remember(orjson.loads(answer), own, prefix)
        return kind, answer

    def remember(self, response: Any, own: bytes, prefix: tuple[bytes, ...]) -> None:
        output = b",".join(orjson.dumps(item) for item in response["output"])
        segment = own + b"," + output if own and output else own or output
        self.history[response["id"]] = (*prefix, segment) if segment else prefix

    async def create(self, request: web.Request) -> web.StreamResponse:
        if self.pool is not None:
            kind, answer = await self.handle_raw(await request.read())
            return web.Response(body=answer, headers={"Content-Type": kind.decode()})
        assert self.session is not None
        data, own, prefix = self.splice(await request.read())
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.url, data=data, headers=headers) as upstream:
            if upstream.content_type == "text/event-stream":
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                tail = b""
                async for chunk in upstream.content.iter_any():
                    tail = (tail + chunk)[-65536:]
                    m = _TERMINAL.search(tail)
                    if m:
                        self.remember(orjson.loads(m.group(1))["response"], own, prefix)
                    await response.write(chunk)
                await response.write_eof()
                return response
            raw = await upstream.read()
        self.remember(orjson.loads(raw), own, prefix)
        return web.Response(body=raw, content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")


class RawServer(asyncio.Protocol):
    """HTTP/1.1 keep-alive by hand: Content-Length requests, one at a time per connection."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.buffer = bytearray()
        self.transport: Any = None
        self.end: int | None = None
        self.body_start = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.end is None:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            m = _LENGTH.search(self.buffer, 0, head_end + 2)
            self.body_start = head_end + 4
            self.end = self.body_start + (int(m.group(1)) if m else 0)
        if len(self.buffer) < self.end:
            return
        head = bytes(self.buffer[: self.body_start])
        body = bytes(self.buffer[self.body_start : self.end])
        del self.buffer[: self.end]
        self.end = None
        task = asyncio.ensure_future(self.answer(head, body))
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)

    async def answer(self, head: bytes, body: bytes) -> None:
        if head.startswith(b"GET /metrics"):
            kind, payload = b"text/plain", b""
        else:
            kind, payload = await self.floor.handle_raw(body)
        line = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
        self.transport.writelines((line % (kind, len(payload)), payload))


_TASKS: set[asyncio.Task[None]] = set()


async def serve(upstream: str, port: int, raw_server: bool, raw_client: bool) -> None:
    floor = Floor(upstream, raw_client)
    floor.session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=None),
    )
    if raw_server:
        server = await asyncio.get_running_loop().create_server(
            lambda: RawServer(floor), "127.0.0.1", port
        )
        bound = server.sockets[0].getsockname()[1]
        print(f"floor proxy listening on http://127.0.0.1:{bound}/v1", flush=True)
        async with server:
            await server.serve_forever()
        return
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/responses", floor.create)
    app.router.add_get("/metrics", floor.metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    host, bound = runner.addresses[0][:2]
    print(f"floor proxy listening on http://{host}:{bound}/v1", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await floor.session.close()
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--server", choices=("aiohttp", "raw"), default="aiohttp")
    parser.add_argument("--upstream-client", choices=("aiohttp", "raw"), default="aiohttp")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(serve(args.upstream, args.port, args.server == "raw", args.upstream_client == "raw"))


if __name__ == "__main__":
    main()
