"""Errors → OpenAI JSON (the one place that happens), per-route counts and proxy overhead."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from ocxproxy.errors import OcxError, PayloadTooLarge, to_openai_error
from ocxproxy.http.context import TIMING_KEY, check_client_key, proxy_of
from ocxproxy.upstream.client import Timing

log = logging.getLogger("ocxproxy.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Routes that answer without a client key: liveness, readiness and metrics scrapes.
_PROBES = frozenset(("/healthz", "/readyz", "/metrics"))
# Set by a handler that records its own overhead (a WebSocket connection, per turn).
SELF_TIMED = web.RequestKey("self_timed", bool)


def error_response(error: OcxError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return web.Response(
        body=error.body(), status=error.status, content_type="application/json", headers=headers
    )


def route_of(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def handle_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    proxy = proxy_of(request)
    timing = request[TIMING_KEY] = Timing()
    route = route_of(request)
    start = time.perf_counter()
    outcome = "error"
    try:
        if route not in _PROBES:
            check_client_key(request, proxy.config.api_keys)
        response = await handler(request)
        outcome = str(response.status)
        return response
    except OcxError as exc:
        outcome = str(exc.status)
        log.info("%s %s -> %d %s", request.method, route, exc.status, exc.code or exc.type)
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        outcome = "413"
        return error_response(
            PayloadTooLarge(f"Request body exceeds {proxy.config.max_body_bytes} bytes.")
        )
    except web.HTTPException as exc:
        outcome = str(exc.status)
        body = to_openai_error(exc.reason, "invalid_request_error")
        return web.json_response(body, status=exc.status)
    except (ConnectionResetError, asyncio.CancelledError):  # the client went away
        outcome = "client_disconnected"
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, route)
        body = to_openai_error("The proxy failed to handle the request.", "server_error")
        return web.json_response(body, status=500)
    finally:
        proxy.metrics.requests.labels(route=route, outcome=outcome).inc()
        if route != "/metrics" and not request.get(SELF_TIMED, False):
            overhead = time.perf_counter() - start - timing.upstream
            proxy.metrics.proxy_overhead.labels(route=route).observe(max(overhead, 0.0))
