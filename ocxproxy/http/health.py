"""Liveness, readiness and metrics (CONTRACT.md C2, C7)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ocxproxy.http.context import proxy_of


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    proxy = proxy_of(request)
    # A store whose journal refuses writes (an I/O error, a full disk) or whose shared
    # server is unreachable cannot acknowledge stored turns: not ready, until a write
    # succeeds again (the store probes by itself). A store full for --max-disk-bytes is
    # ready: it serves reads, DELETEs (which make room) and store:false turns, and
    # answers a turn to store 507 store_full; its body says so.
    store = proxy.store
    available, full = store.available, store.full
    ready = proxy.ready and (available or full) and proxy.pool.is_ready()
    body = {
        "status": "ready" if ready else "not ready",
        "store_loaded": proxy.ready,
        "store": "available" if available else "full" if full else "unavailable",
        "backends": {b.url: "up" if b.healthy else "down" for b in proxy.pool.backends},
    }
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    proxy = proxy_of(request)
    response = web.Response(body=proxy.metrics.render())
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response
