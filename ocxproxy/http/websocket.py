"""WebSocket mode (CONTRACT.md C3): `GET /v1/responses` with an upgrade; one socket, many turns.

Each `response.create` frame becomes a streaming `POST /v1/responses` to a backend, and
every SSE event goes back as one text frame with its JSON payload unchanged. Turns run one
at a time in arrival order; answers (events or one `error` event) keep that order. A
connection owns a memory-only Store for its store:false turns: never written to disk,
never resolvable from another connection or over HTTP, dropped on close. Errors are
`error` events and the socket stays open, except for the lifetime limit and protocol
violations (a frame over the size limit closes with 1009). At a graceful stop, the turn in
flight may finish by `--shutdown-timeout` (frames after the stop began are refused with
`server_shutting_down`); one still running then ends with that error; the socket closes
with 1001.

A GET without an upgrade is not WebSocket mode: it is forwarded like any other path
(CONTRACT.md C2).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
import time
import weakref
from typing import Any

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.continuation.compaction import response_events
from ocxproxy.continuation.expand import check_request
from ocxproxy.errors import (
    InvalidRequest,
    OcxError,
    RateLimited,
    ShuttingDown,
    StoreFailure,
    UpstreamError,
    backend_error,
    code_for_status,
)
from ocxproxy.http.compaction import compact_first, compaction_turn
from ocxproxy.http.context import (
    PROXY,
    Proxy,
    Stopping,
    proxy_of,
    scope_of,
    timing_of,
    upstream_path,
)
from ocxproxy.http.exchange import (
    Exchange,
    open_upstream,
    prepare_exchange,
    stream_events,
)
from ocxproxy.http.headers import upstream_headers
from ocxproxy.http.middleware import SELF_TIMED
from ocxproxy.http.passthrough import passthrough
from ocxproxy.metrics import Metrics, Timing
from ocxproxy.store import Store
from ocxproxy.upstream.sse import SUCCESS_EVENTS, Event

log = logging.getLogger("ocxproxy.websocket")

WEBSOCKETS: web.AppKey[weakref.WeakSet[Connection]] = web.AppKey("websockets")
HEARTBEAT = 30.0  # seconds between pings; a peer silent for half of it more is dropped
QUEUE_LIMIT = 16  # response.create frames waiting behind the one in flight
LOCAL_MAX_ENTRIES = 4096
TURN_ROUTE = "websocket /v1/responses"  # proxy_overhead label: one observation per turn
_CLIENT_ONLY = ("type", "generate", "stream_id")
# Connection stores publish their gauges here, so they never overwrite the shared store's.
_DETACHED_METRICS = Metrics()


class TurnOutcome(enum.StrEnum):
    COMPLETED = "completed"
    WARMUP = "warmup"
    REJECTED = "rejected"  # refused by the proxy before anything was forwarded
    BACKEND_ERROR = "backend_error"  # non-200 answer, unreachable, or broke off
    FAILED = "failed"  # the stream ended without a completed/incomplete response
    CANCELLED = "cancelled"  # client gone or connection limit reached mid-turn
    SHUTDOWN = "shutdown"  # still running when the graceful stop's deadline came


_EVICTING = frozenset((TurnOutcome.REJECTED, TurnOutcome.BACKEND_ERROR, TurnOutcome.FAILED))


async def responses_socket(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Upgrade", "").strip().lower() != "websocket":
        return await passthrough(request)
    proxy = proxy_of(request)  # the client key was checked by the middleware
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT, max_msg_size=proxy.config.max_body_bytes)
    await ws.prepare(request)
    request[SELF_TIMED] = True  # a connection is not one request: turns record overhead
    connection = Connection(proxy, request, ws)
    sockets = request.app[WEBSOCKETS]
    sockets.add(connection)
    proxy.metrics.ws_open.inc()
    started = time.monotonic()
    try:
        await connection.serve()
    finally:
        sockets.discard(connection)
        _drop_heartbeat_hook(request)
        proxy.metrics.ws_open.dec()
        log.info(
            "websocket closed after %.1fs, %d turns, close code %s",
            time.monotonic() - started,
            connection.turns,
            ws.close_code,
        )
    return ws


def _drop_heartbeat_hook(request: web.Request) -> None:
    """aiohttp leaves the socket's heartbeat callback on the connection's protocol after
    the socket closes, a reference cycle (protocol -> ws -> request -> protocol) that
    `serve`'s frozen heap (heap.py) would keep until the next full GC pass."""
    protocol = request.protocol
    if getattr(protocol, "_data_received_cb", None) is not None:
        protocol._data_received_cb = None


async def close_websockets(app: web.Application) -> None:
    """The graceful stop: close every open socket once its turn in flight is over, by the
    deadline (clients may reconnect elsewhere)."""
    stopping = app[PROXY].stop()
    sockets = app[WEBSOCKETS]
    await asyncio.gather(
        *[connection.shut_down(stopping) for connection in list(sockets)],
        return_exceptions=True,
    )


class Connection:
    """One socket: a frame reader, a turn worker, and the connection's own store."""

    def __init__(self, proxy: Proxy, request: web.Request, ws: web.WebSocketResponse) -> None:
        config = proxy.config
        self.proxy = proxy
        self.ws = ws
        self.scope = scope_of(request.headers)
        self.request_id = timing_of(request).request_id  # the upgrade's; turn n's is <id>.<n>
        self.path_qs = upstream_path(request)
        self.headers = upstream_headers(
            request.headers, config, identity=True, request_id=self.request_id
        )
        for name in [k for k in self.headers if k.lower().startswith("sec-websocket-")]:
            self.headers.popall(name, None)
        self.headers["Content-Type"] = "application/json"
        self.local = Store(  # no state_dir: memory only, gone with the connection
            max_resident_bytes=max(config.resident_bytes(journaled=False) // 4, 1),
            max_entries=LOCAL_MAX_ENTRIES,
            ttl=config.ws_max_age,
            metrics=_DETACHED_METRICS,
        )
        self.queue: asyncio.Queue[str | bytes] = asyncio.Queue(QUEUE_LIMIT)
        self.turns = 0
        self.worker: asyncio.Task[None] | None = None
        self.idle = asyncio.Event()  # no turn in flight
        self.idle.set()
        self._frames_in = proxy.metrics.ws_frames.labels(direction="in")
        self._frames_out = proxy.metrics.ws_frames.labels(direction="out")

    def __repr__(self) -> str:
        return f"<Connection {self.turns} turns {self.queue.qsize()} queued {self.local!r}>"

    async def serve(self) -> None:
        worker = self.worker = spawn(self._work(), name="websocket-turns")
        limit = asyncio.timeout(self.proxy.config.ws_max_age)
        try:
            try:
                async with limit:
                    await self._read()
            except TimeoutError:
                if not limit.expired():
                    raise
            finally:
                await cancel_and_wait(worker)  # the in-flight backend request is closed
            if limit.expired():
                await self._end_by_limit()
        except ConnectionResetError:
            pass  # the client left while an event was being sent to it
        finally:
            await self.local.close()

    async def _read(self) -> None:
        async for msg in self.ws:
            self._frames_in.inc()
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                try:
                    self.queue.put_nowait(msg.data)
                except asyncio.QueueFull:
                    await self._send_error(
                        RateLimited(
                            f"Too many queued response.create events (limit {QUEUE_LIMIT}); "
                            "wait for a response to finish before sending more."
                        )
                    )
            elif msg.type is WSMsgType.ERROR:
                log.info("websocket error: %s", type(msg.data).__name__)
                return

    async def _end_by_limit(self) -> None:
        error = InvalidRequest(
            "Responses websocket connection limit reached "
            f"({_span(self.proxy.config.ws_max_age)}). "
            "Create a new websocket connection to continue.",
            code="websocket_connection_limit_reached",
        )
        await self._send_error(error)
        await self.ws.close()

    async def shut_down(self, stopping: Stopping) -> None:
        """The graceful stop: the turn in flight may finish by the deadline, else it is cut
        (its client gets an error event saying why); then the socket closes (1001)."""
        try:
            async with asyncio.timeout(stopping.left()):
                await self.idle.wait()
        except TimeoutError:
            stopping.expire()
            if self.worker is not None:
                await cancel_and_wait(self.worker)
        await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"Server shutting down")

    async def _work(self) -> None:
        try:
            while True:
                frame = await self.queue.get()
                self.idle.clear()
                try:
                    await self._turn(frame)
                finally:
                    if self.queue.empty():  # queued frames first: each gets its answer
                        self.idle.set()
        except ConnectionResetError:
            return  # the client is gone; the reader sees the close and ends the connection
        except Exception:
            log.exception("websocket turn failed unexpectedly")
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"Internal error")

    async def _turn(self, frame: str | bytes) -> None:
        self.turns += 1
        start = time.perf_counter()
        timing = Timing(f"{self.request_id}.{self.turns}")
        outcome = TurnOutcome.CANCELLED
        prev: str | None = None
        failure: OcxError | None = None
        exchange: Exchange | None = None
        try:
            if self.proxy.stopping is not None:
                raise ShuttingDown(
                    "The server is shutting down and starts no new turns; send this one "
                    "on a new connection (another replica, or this one once it restarts)."
                )
            body, generate = parse_frame(frame)
            request = check_request(body)
            prev = request.previous_response_id
            if prev is not None:
                self._count_cache(prev)
            exchange = await prepare_exchange(
                self.proxy, self.scope, request, None, local=self.local
            )
            timing.exchange = exchange
            if exchange.compaction:
                outcome = await self._compact(exchange, timing)
            elif generate:
                outcome = await self._generate(exchange, timing)
            else:
                outcome = await self._warm_up(exchange)
        except OcxError as error:
            failure = error
            outcome = (
                TurnOutcome.BACKEND_ERROR
                if isinstance(error, UpstreamError)
                else TurnOutcome.REJECTED
            )
            await self._send_error(error)
        except asyncio.CancelledError:
            if self.proxy.cut_by_shutdown():
                outcome = TurnOutcome.SHUTDOWN
                failure = ShuttingDown()
                with contextlib.suppress(ConnectionResetError):
                    await self._send_error(failure)
            raise
        finally:
            if exchange is not None:
                exchange.release()  # its conversation, when the turn ended without a response
            self.proxy.metrics.ws_turns.labels(outcome=str(outcome)).inc()
            if prev is not None and outcome in _EVICTING:
                self.local.delete_nowait(self.scope, prev)  # OpenAI's rule for a failed turn
            elapsed = time.perf_counter() - start
            overhead = max(elapsed - timing.upstream, 0.0)
            self.proxy.metrics.proxy_overhead.labels(route=TURN_ROUTE).observe(overhead)
            log.debug("websocket turn %d: %s", self.turns, outcome)
            if self.proxy.access_log is not None:
                self.proxy.access_log.write(
                    request_id=timing.request_id,
                    method="WS",
                    route=TURN_ROUTE,
                    status=failure.status if failure is not None else None,
                    outcome=str(outcome),
                    elapsed=elapsed,
                    timing=timing,
                    scope=self.scope,
                    error=failure,
                )

    def _count_cache(self, prev: str) -> None:
        try:
            self.local.lookup_nowait(self.scope, prev)
        except StoreFailure:
            result = "miss"
        else:
            result = "hit"
        self.proxy.metrics.ws_cache.labels(result=result).inc()

    async def _generate(self, exchange: Exchange, timing: Timing) -> TurnOutcome:
        self.headers["X-Request-Id"] = timing.request_id  # one turn at a time
        if exchange.pending is not None:  # context_management's threshold passed
            await compact_first(exchange, self.headers, self.path_qs, timing)
        async with open_upstream(exchange, self.path_qs, self.headers, timing, turn=True) as (
            backend,
            upstream,
        ):
            exchange.backend = backend
            content_type = upstream.headers.get("Content-Type", "")
            if upstream.status != 200 or not content_type.startswith("text/event-stream"):
                with timing.waiting():
                    body = await upstream.read()
                await self._send(orjson.dumps(backend_error_event(upstream.status, body)))
                return TurnOutcome.BACKEND_ERROR
            last: str | None = None
            async for batch in stream_events(upstream, exchange, timing):
                for event in batch:
                    if event.data and event.data != b"[DONE]":
                        data, last = ws_payload(event)
                        await self._send(data)
        if exchange.recorded or last in SUCCESS_EVENTS:
            return TurnOutcome.COMPLETED
        return TurnOutcome.FAILED

    async def _compact(self, exchange: Exchange, timing: Timing) -> TurnOutcome:
        """An input ending in a compaction trigger: the proxy's own compaction (C10)."""
        self.headers["X-Request-Id"] = timing.request_id  # one turn at a time
        response = await compaction_turn(exchange, self.headers, self.path_qs, timing)
        for event in response_events(response):
            await self._send(orjson.dumps(event))
        return TurnOutcome.COMPLETED

    async def _warm_up(self, exchange: Exchange) -> TurnOutcome:
        """`generate: false`: remember the input as a response of its own, generate nothing."""
        response = warmup_response("resp_" + secrets.token_hex(24), int(time.time()))
        exchange.envelope.complete(response, final=True)
        exchange.finish(response)  # before response.completed goes out (CONTRACT.md C1.7)
        await exchange.commit()
        pending = {**response, "status": "in_progress", "completed_at": None}
        events = (
            ("response.created", pending),
            ("response.in_progress", pending),
            ("response.completed", response),
        )
        for seq, (kind, payload) in enumerate(events):
            await self._send(
                orjson.dumps({"type": kind, "sequence_number": seq, "response": payload})
            )
        return TurnOutcome.WARMUP

    async def _send(self, data: bytes) -> None:
        await self.ws.send_frame(data, WSMsgType.TEXT)
        self._frames_out.inc()

    async def _send_error(self, error: OcxError) -> None:
        await self._send(
            orjson.dumps(ws_error_event(error.status, error.to_openai_error()["error"]))
        )


# -- pure helpers ------------------------------------------------------------------------


def parse_frame(frame: str | bytes) -> tuple[dict[str, Any], bool]:
    """A client frame → the create body to forward (stream forced on) and `generate`."""
    if isinstance(frame, bytes):
        raise InvalidRequest(
            "Binary frames are not supported: send each event as one JSON text frame.",
            code="invalid_frame",
        )
    try:
        event = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The frame is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(event, dict):
        raise InvalidRequest("A frame must be a JSON object.", code="invalid_frame")
    kind = event.get("type")
    if kind != "response.create":
        raise InvalidRequest(
            f"Unsupported event type {kind!r}: only 'response.create' is accepted.",
            param="type",
            code="unknown_event_type",
        )
    for name in ("generate", "stream", "background"):
        if event.get(name) is not None and not isinstance(event[name], bool):
            raise InvalidRequest(
                f"Invalid type for '{name}': expected a boolean.", param=name, code="invalid_type"
            )
    if event.get("background"):
        raise InvalidRequest(
            "Background mode is not supported over WebSocket.",
            param="background",
            code="unsupported_parameter",
        )
    if event.get("stream_id") is not None:
        raise InvalidRequest(
            "'stream_id' is not supported: this proxy runs one response at a time per "
            "connection; open another connection for parallel responses.",
            param="stream_id",
            code="unsupported_parameter",
        )
    generate = event.get("generate") is not False
    body = {k: v for k, v in event.items() if k not in _CLIENT_ONLY}
    body["stream"] = True  # implied over WebSocket; the proxy always streams from the backend
    return body, generate


def warmup_response(response_id: str, created_at: int) -> dict[str, Any]:
    """The response of a `generate: false` turn: nothing generated, zero usage (what it
    echoes from the request, the exchange's Envelope fills in)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "completed",
        "output": [],
        "usage": {
            "input_tokens": 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 0,
        },
    }


def ws_error_event(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """The WebSocket error event (`ResponseWsError`): status on top, the error nested,
    its `code` never null (errors.code_for_status)."""
    if not isinstance(error.get("code"), str) or not error["code"]:
        error = {**error, "code": code_for_status(status)}
    return {"type": "error", "status": status, "error": error}


def backend_error_event(status: int, body: bytes) -> dict[str, Any]:
    """A backend's non-streaming answer → an error event keeping its status and details."""
    if status == 200:  # a backend that ignored stream:true
        exc = UpstreamError("The backend answered without an event stream.")
        return ws_error_event(exc.status, exc.to_openai_error()["error"])
    return ws_error_event(status, backend_error(status, body))


def ws_payload(event: Event) -> tuple[bytes, str | None]:
    """An SSE event → its WebSocket frame and event type. Payloads go out unchanged, except
    an SSE `error` event (flat: code, message, param; or an `error` object nested), which
    becomes the WebSocket error shape (status on top, the error nested, its code never
    null). Only events without a name, and errors, are parsed."""
    if event.name is not None and event.name != "error":
        return event.data, event.name
    try:
        payload = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return event.data, event.name
    kind = payload.get("type") if isinstance(payload, dict) else None
    if not isinstance(payload, dict) or kind != "error":
        return event.data, kind if isinstance(kind, str) else event.name
    nested = payload.get("error")
    detail = {
        "type": "server_error",
        "code": payload.get("code"),
        "message": payload.get("message") or "The backend reported an error.",
        "param": payload.get("param"),
    }
    if isinstance(nested, dict):
        detail.update(nested)
    status = payload.get("status")
    converted = ws_error_event(status if isinstance(status, int) else 500, detail)
    if "sequence_number" in payload:
        converted["sequence_number"] = payload["sequence_number"]
    return orjson.dumps(converted), "error"


def _span(seconds: float) -> str:
    if seconds >= 60:
        return f"{seconds / 60:g} minutes"
    return f"{seconds:g} seconds"
