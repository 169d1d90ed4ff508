"""The least a continuation proxy on aiohttp can do, as a yardstick for ocxproxy's overhead.

One aiohttp server, one keep-alive ClientSession, an in-memory dict of response id →
history bytes, and the same byte splice as ocxproxy. No metrics, no validation, no
header filtering, no limits, no affinity, no error mapping, no eviction. It is what the
framework costs; whatever ocxproxy spends above it is its own.

`--upstream-client raw` swaps aiohttp's client for a hand-written HTTP/1.1 keep-alive
pool, and `--server raw` aiohttp's server for a hand-written one (both loopback.py's:
Content-Length bodies; an SSE answer is passed on whole): what each side of aiohttp costs
per request.

    python scripts/bench/floor_proxy.py --upstream URL --port 0   # "... listening on URL/v1"
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import aiohttp
import loopback
import orjson
from aiohttp import web
from loopback import RawClient

_TERMINAL = re.compile(rb"^data: (\{\"type\":\"response\.completed\".*)$", re.M)


class RawPool:
    """Keep-alive connections to one backend, as many as requests in flight."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.idle: list[RawClient] = []

    async def post(self, path: str, body: bytes) -> tuple[bytes, bytes]:
        """(content type, body) of the answer."""
        client = self.idle.pop() if self.idle else RawClient(self.url)
        _, kind, data = await client.post(path, body)
        self.idle.append(client)
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
            kind, answer = await self.pool.post("/v1/responses", data)
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

    async def handle_raw_request(self, head: bytes, body: bytes) -> tuple[bytes, bytes]:
        """The raw server's handler: a scrape of /metrics gets an empty answer."""
        if head.startswith(b"GET /metrics"):
            return b"text/plain", b""
        return await self.handle_raw(body)

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


async def serve(upstream: str, port: int, raw_server: bool, raw_client: bool) -> None:
    floor = Floor(upstream, raw_client)
    floor.session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=None),
    )
    banner = "floor proxy listening on {url}/v1"
    try:
        if raw_server:
            await loopback.serve(port, banner, handler=floor.handle_raw_request)
        else:
            app = web.Application(client_max_size=1 << 30)
            app.router.add_post("/v1/responses", floor.create)
            app.router.add_get("/metrics", floor.metrics)
            await loopback.serve(port, banner, app=app)
    finally:
        await floor.session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--server", choices=("aiohttp", "raw"), default="aiohttp")
    parser.add_argument("--upstream-client", choices=("aiohttp", "raw"), default="aiohttp")
    args = parser.parse_args()
    raw_server, raw_client = args.server == "raw", args.upstream_client == "raw"
    loopback.run(serve(args.upstream, args.port, raw_server, raw_client))


if __name__ == "__main__":
    main()
