"""Every other path: reverse-proxied transparently, bodies streamed both ways (CONTRACT.md C2).

A backend's JSON error answer is the exception: it is read whole and relayed as the
proxy's own errors are, its `code` a string (CONTRACT.md C1.3: errors.error_answer).
"""

from __future__ import annotations

from aiohttp import web

from ocxproxy.errors import error_answer
from ocxproxy.http.body import body_chunks, check_length, codings_of, read_body
from ocxproxy.http.context import proxy_of, timing_of, upstream_path
from ocxproxy.http.headers import client_headers, upstream_headers
from ocxproxy.metrics import Timing
from ocxproxy.upstream.dialect import UpstreamResponse


async def passthrough(
    request: web.Request, *, body: bytes | None = None, capture: bool = False
) -> web.StreamResponse:
    """Forward the request as it is. `body`: the client's body when a handler already read
    it (then it may be sent again to another backend). `capture`: the answer is read whole
    into a web.Response that the caller may still change, rather than streamed."""
    proxy = proxy_of(request)
    timing = timing_of(request)
    headers = upstream_headers(
        request.headers, proxy.config, identity=False, request_id=timing.request_id
    )
    limit = proxy.config.max_body_bytes
    check_length(request, limit)
    if body is None and request.body_exists and codings_of(request.headers):
        body = await read_body(request, limit)  # forwarded decoded
    stream = body_chunks(request, limit) if request.body_exists and body is None else None
    # A streamed body over the limit raises PayloadTooLarge out of open(): a 413.
    async with proxy.pool.open(
        request.method,
        upstream_path(request),
        headers,
        stream if stream is not None else body,
        timing=timing,
        retry=stream is None,
    ) as (_, upstream):
        answer = upstream.headers
        if (
            upstream.status >= 400
            and "json" in answer.get("Content-Type", "")
            and answer.get("Content-Encoding", "identity") == "identity"  # (else as it came)
        ):
            with timing.waiting():
                content = await upstream.read()
            shaped = error_answer(upstream.status, content)
            headers = client_headers(upstream.headers, body_rewritten=shaped is not None)
            headers.pop("Content-Length", None)
            return web.Response(
                status=upstream.status,
                reason=upstream.reason,
                headers=headers,
                body=content if shaped is None else shaped,
            )
        if capture:
            with timing.waiting():
                content = await upstream.read()
            headers = client_headers(upstream.headers, body_rewritten=True)
            headers.pop("Content-Length", None)
            return web.Response(
                status=upstream.status, reason=upstream.reason, headers=headers, body=content
            )
        return await _relay(request, upstream, timing)


async def _relay(
    request: web.Request, upstream: UpstreamResponse, timing: Timing
) -> web.StreamResponse:
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
