"""Every other path: reverse-proxied transparently, bodies streamed both ways (C2)."""

from __future__ import annotations

from aiohttp import web

from ocxproxy.http.context import proxy_of, timing_of
from ocxproxy.http.headers import client_headers, upstream_headers


async def passthrough(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    timing = timing_of(request)
    headers = upstream_headers(request.headers, proxy.config, identity=False)
    data = request.content if request.body_exists else None
    async with proxy.pool.open(
        request.method, request.path_qs, headers, data, timing=timing, retry=data is None
    ) as (_, upstream):
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=client_headers(upstream.headers, body_rewritten=False),
        )
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(request)
        while True:
            with timing.waiting():
                chunk = await upstream.content.readany()
            if not chunk:
                break
            await response.write(chunk)
        await response.write_eof()
        return response
