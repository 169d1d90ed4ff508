"""Errors → OpenAI JSON (the one place that happens), per-route counts and proxy overhead.

`guarded()` is that place for both ways a request comes in: aiohttp's routes (through the
`handle_errors` middleware) and the front end's own create path (http/front.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

from aiohttp import web

from ocxproxy.errors import OcxError, ShuttingDown
from ocxproxy.http.body import too_large
from ocxproxy.http.context import (
    TIMING_KEY,
    V1,
    Proxy,
    check_client_key,
    proxy_of,
    scope_of,
    unprefixed,
)
from ocxproxy.http.headers import answer_request_id, request_id
from ocxproxy.metrics import Timing

log = logging.getLogger("ocxproxy.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Routes that answer without a client key: liveness, readiness and metrics scrapes.
_PROBES = frozenset(("/healthz", "/readyz", "/metrics"))
# The status a request without a numeric outcome was answered with (none: the client left).
_NO_STATUS = {"error": 500, "shutdown": ShuttingDown.status}
# Set by a handler that records its own overhead (a WebSocket connection, per turn).
SELF_TIMED = web.RequestKey("self_timed", bool)


class _Answered(Protocol):
    @property
    def status(self) -> int: ...


A = TypeVar("A", bound=_Answered)


class HttpError(OcxError):
    """aiohttp's own refusals (no such route, wrong method), in the one error shape."""

    type = "invalid_request_error"


async def guarded(
    proxy: Proxy,
    method: str,
    route: str,
    headers: Mapping[str, str],
    timing: Timing,
    handler: Callable[[Timing], Awaitable[A]],
    fail: Callable[[OcxError], A],
    *,
    self_timed: Callable[[], bool] = lambda: False,
) -> A:
    """Run a request's handler: check the client's key, turn an error into its answer
    (`fail`), count the request by route and outcome and record the proxy's overhead (wall
    time minus the time spent waiting on the backend, in `timing`, which the caller made
    with the request's id). A request cancelled by the graceful stop's deadline ends
    here with ShuttingDown, counted as `shutdown`."""
    start = time.perf_counter()
    outcome = "error"
    error: OcxError | None = None
    try:
        if route not in _PROBES:
            check_client_key(headers, proxy.config.api_keys)
        answer = await handler(timing)
        outcome = str(answer.status)
        return answer
    except OcxError as exc:
        error = exc
        outcome = str(exc.status)
        log.info("%s %s -> %d %s", method, route, exc.status, exc.code or exc.type)
        return fail(exc)
    except (ConnectionResetError, asyncio.CancelledError):
        if not proxy.cut_by_shutdown():  # the client went away
            outcome = "client_disconnected"
            raise
        # The graceful stop's deadline: the request is over (its cancellation is taken
        # here), and its client is told why, if its answer has not begun.
        outcome = "shutdown"
        error = ShuttingDown()
        return fail(error)
    except Exception:
        log.exception("unhandled error on %s %s", method, route)
        return fail(OcxError("The proxy failed to handle the request."))
    finally:
        proxy.metrics.requests.labels(route, outcome).inc()
        if route != "/metrics" and not self_timed():
            elapsed = time.perf_counter() - start
            proxy.metrics.proxy_overhead.labels(route).observe(max(elapsed - timing.upstream, 0.0))
            if proxy.access_log is not None and route not in _PROBES:
                proxy.access_log.write(
                    request_id=timing.request_id,
                    method=method,
                    route=route,
                    status=int(outcome) if outcome.isdigit() else _NO_STATUS.get(outcome),
                    outcome=outcome,
                    elapsed=elapsed,
                    timing=timing,
                    scope=scope_of(headers),
                    error=error,
                )


def error_response(error: OcxError) -> web.Response:
    return web.Response(body=error.body(), status=error.status, headers=error.headers())


async def tag_answer(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer aiohttp sends carries the request's id."""
    timing = request.get(TIMING_KEY)
    if timing is not None:
        answer_request_id(response.headers, timing.request_id)


def route_of(request: web.Request) -> str:
    """The matched route's path, under /v1 when the client left it out (one series)."""
    info = request.match_info.route.resource
    if info is None:
        return "unmatched"
    return V1 + info.canonical if unprefixed(request) else info.canonical


@web.middleware
async def handle_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    proxy = proxy_of(request)
    timing = request[TIMING_KEY] = Timing(request_id(request.headers))

    async def run(timing: Timing) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            raise too_large(proxy.config.max_body_bytes) from None
        except web.HTTPException as exc:
            raise HttpError(exc.reason, status=exc.status) from None

    def fail(error: OcxError) -> web.StreamResponse:
        if request.writer.output_size:  # the head is out: an error answer would land in the body
            if request.transport is not None:
                request.transport.close()  # the client sees a short body instead
            raise ConnectionResetError("answer cut short")
        return error_response(error)

    # A request in flight that the graceful stop waits for, then cuts (not a WebSocket:
    # its turns are, http/websocket.py).
    task = None if request.headers.get("Upgrade") else asyncio.current_task()
    if task is not None:
        proxy.handlers.add(task)
    try:
        return await guarded(
            proxy,
            request.method,
            route_of(request),
            request.headers,
            timing,
            run,
            fail,
            self_timed=lambda: request.get(SELF_TIMED, False),
        )
    finally:
        if task is not None:
            proxy.handlers.discard(task)
