"""`/v1/responses`: create (JSON and SSE) with continuation, and the stored-response routes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import web
from multidict import CIMultiDict

from ocxproxy.continuation.expand import (
    Request,
    check_call_bindings,
    check_request,
    expand,
    parse_request,
    serialize_items,
    tail_as_sent,
)
from ocxproxy.continuation.record import build_turn, not_recordable_reason
from ocxproxy.errors import (
    FailureReason,
    InvalidRequest,
    NotFound,
    OcxError,
    PayloadTooLarge,
    PreviousResponseNotFound,
    StoreFailure,
    UpstreamError,
)
from ocxproxy.http.context import Proxy, proxy_of, scope_of, timing_of
from ocxproxy.http.headers import client_headers, upstream_headers
from ocxproxy.http.passthrough import passthrough
from ocxproxy.model import Record
from ocxproxy.store import Store
from ocxproxy.upstream.pool import Backend, Timing, read_chunk
from ocxproxy.upstream.dialect import UpstreamResponse
from ocxproxy.upstream.repair import StreamRepair
from ocxproxy.upstream.sse import TERMINAL_EVENTS, Event, EventSplitter, encode_event

log = logging.getLogger("ocxproxy.responses")

# Affinity keys (C6) by origin: the client's prompt_cache_key, a chain's root response id,
# a digest of how a conversation opens.
PCK_KEY, ROOT_KEY, HEAD_KEY = "pck:", "root:", "head:"


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"Request body exceeds {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body exceeds {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(slots=True)
class Exchange:
    """One create call: what was asked, what was forwarded, and where to remember it."""

    proxy: Proxy
    scope: str
    request: Request
    body: bytes  # as forwarded
    target: Store | None  # where the finished turn is remembered; None: not at all
    durable: bool = False  # may the turn reach disk
    parent: Record | None = None
    tail: bytes | None = None  # the request's own items as forwarded (serialized)
    backend: Backend | None = None
    affinity_key: str | None = None
    recorded: bool = False
    finished: bool = False  # a terminal response arrived (remembered or not)

    def finish(self, response: Any) -> None:
        """Remember the turn when the response is one to remember (C1.6)."""
        self.finished = True
        metrics = self.proxy.metrics
        self.observe_usage(response)
        reason = not_recordable_reason(response)
        if reason is None and self.target is None:
            reason = "store_false"
        if reason is not None:
            metrics.turns_not_recorded.labels(reason=reason).inc()
            return
        assert self.target is not None  # else reason is "store_false"
        if self.tail is None:  # forwarded as the client sent it: remember those bytes
            self.tail = tail_as_sent(self.body, self.request)
        turn = build_turn(
            response=response,
            scope=self.scope,
            durable=self.durable,
            tail=self.tail,
            tail_items=self.request.items,
            backend=self.backend.url if self.backend else None,
            affinity_key=self.chain_key(response),
            stored=self.request.store,
        )
        self.target.put(turn, self.parent)
        self.recorded = True
        kind = "durable" if self.durable else "memory"
        metrics.turns_recorded.labels(kind=kind).inc()

    def chain_key(self, response: Any) -> str | None:
        """The affinity key a turn is remembered with. A chain's first turn, routed by how
        it opens, hands its chain its own id instead: chains that open alike stay apart."""
        key = self.affinity_key
        response_id = response.get("id") if isinstance(response, dict) else None
        opened = key is None or key.startswith(HEAD_KEY)
        if self.parent is None and opened and isinstance(response_id, str):
            return ROOT_KEY + response_id
        return key

    def observe_usage(self, response: Any) -> None:
        usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict) or self.backend is None:
            return
        total = usage.get("input_tokens")
        details = usage.get("input_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(total, int) or total <= 0:
            return
        metrics, url = self.proxy.metrics, self.backend.url
        metrics.input_tokens.labels(url).inc(total)
        if isinstance(cached, int) and cached >= 0:
            metrics.cached_tokens.labels(url).inc(cached)
            metrics.cached_ratio.labels(url).observe(min(cached / total, 1.0))


async def prepare_exchange(
    proxy: Proxy,
    scope: str,
    request: Request,
    raw: bytes | None,
    *,
    local: Store | None = None,
) -> Exchange:
    """Resolve and expand a create request; raises before anything is forwarded.

    `raw` is the client's body, forwarded unchanged when there is nothing to expand
    (C1.1). `local` is a WebSocket connection's own store: store:false turns live
    there, and a chain that started there stays there.
    """
    prev = request.previous_response_id
    if prev is None:
        target, durable = _retention(proxy, request, local, parent_store=None)
        await _room_in(proxy, target)
        body = raw if raw is not None else orjson.dumps(request.body)
        return Exchange(
            proxy,
            scope,
            request,
            body,
            target,
            durable,
            affinity_key=affinity_of(request, None),
        )
    metrics = proxy.metrics
    try:
        store, parent = _resolve(proxy, scope, prev, local)
        history = await store.history(parent)
    except StoreFailure as failure:
        metrics.expansions.labels(outcome=str(failure.reason)).inc()
        if proxy.config.forward_unknown_ids and failure.reason == FailureReason.UNKNOWN:
            body = raw if raw is not None else orjson.dumps(request.body)
            return Exchange(proxy, scope, request, body, None)
        raise PreviousResponseNotFound(prev, failure.reason) from None
    check_call_bindings(request.items, parent)
    tail, _ = serialize_items(request.items)
    body = expand(request.body, history, tail)
    metrics.expansions.labels(outcome="hit").inc()
    target, durable = _retention(proxy, request, local, parent_store=store)
    await _room_in(proxy, target)
    return Exchange(
        proxy,
        scope,
        request,
        body,
        target,
        durable and parent.durable,
        parent=parent,
        tail=tail,
        affinity_key=affinity_of(request, parent),
    )


async def _room_in(proxy: Proxy, target: Store | None) -> None:
    """A turn the shared store will take waits while its disk writer is behind (bounded);
    one remembered elsewhere, or nowhere, does not."""
    if target is proxy.store:
        await proxy.store.wait_for_room()


def _resolve(proxy: Proxy, scope: str, prev: str, local: Store | None) -> tuple[Store, Record]:
    if local is not None:
        try:
            return local, local.lookup(scope, prev)
        except StoreFailure:
            pass
    return proxy.store, proxy.store.lookup(scope, prev)


def _retention(
    proxy: Proxy, request: Request, local: Store | None, parent_store: Store | None
) -> tuple[Store | None, bool]:
    """Where a turn is remembered and whether it may reach disk (C3, C5)."""
    if local is not None and (parent_store is local or not request.store):
        return local, False
    if request.store:
        return proxy.store, not proxy.config.zdr
    if proxy.config.retain_unstored:
        return proxy.store, False
    return None, False


def affinity_of(request: Request, parent: Record | None) -> str:
    """The key a request's backend is chosen by (C6): the client's prompt_cache_key, else
    its chain's (recorded with the parent: the chain's root response id), else a digest of
    how the conversation opens (model, instructions, first input item; never the whole
    history), which full-history requests of one conversation share."""
    key = request.body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return PCK_KEY + key
    if parent is not None and parent.affinity_key:
        return parent.affinity_key
    body = request.body
    opening = (body.get("model"), body.get("instructions"), request.items[:1])
    digest = hashlib.blake2b(orjson.dumps(opening, option=orjson.OPT_SORT_KEYS), digest_size=16)
    return HEAD_KEY + digest.hexdigest()


def open_upstream(
    exchange: Exchange, path_qs: str, headers: Mapping[str, str], timing: Timing
) -> AbstractAsyncContextManager[tuple[Backend, UpstreamResponse]]:
    """The backend request of a create exchange, routed by its chain's affinity (C6)."""
    return exchange.proxy.pool.open(
        "POST",
        path_qs,
        headers,
        exchange.body,
        timing=timing,
        affinity_key=exchange.affinity_key,
        preferred=exchange.parent.backend if exchange.parent else None,
    )


class Reply(Protocol):
    """Where a create call's answer goes: an aiohttp response (WebReply), or the front
    end's own connection (http/front.py)."""

    def answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        """The whole answer at once. Synchronous on purpose: create() remembers the turn
        right after, before anything else can run."""

    async def start(self, status: int, headers: CIMultiDict[str]) -> None:
        """The head of a streamed answer."""

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


class WebReply:
    """A Reply on aiohttp: the route handler returns `response`."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    def answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self.response = web.Response(body=body, status=status, headers=headers)

    async def start(self, status: int, headers: CIMultiDict[str]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


async def create_response(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    raw = await read_body(request, proxy.config.max_body_bytes)
    reply = WebReply(request)
    await create(proxy, request.headers, request.path_qs, raw, timing_of(request), reply)
    assert reply.response is not None
    return reply.response


async def create(
    proxy: Proxy,
    headers: Mapping[str, str],
    path_qs: str,
    raw: bytes,
    timing: Timing,
    reply: Reply,
) -> None:
    """`POST /v1/responses`: expand, forward, relay the answer, remember the turn."""
    exchange = await prepare_exchange(proxy, scope_of(headers), parse_request(raw), raw)
    forwarded = upstream_headers(headers, proxy.config, identity=True)
    forwarded["Content-Type"] = "application/json"
    async with open_upstream(exchange, path_qs, forwarded, timing) as (backend, upstream):
        exchange.backend = backend
        content_type = upstream.headers.get("Content-Type", "")
        if upstream.status == 200 and content_type.startswith("text/event-stream"):
            await relay_stream(reply, upstream, exchange, timing)
            return
        with timing.waiting():
            body = await upstream.read()
        answer_headers = client_headers(upstream.headers, body_rewritten=False)
        reply.answer(upstream.status, answer_headers, body)
        # The answer may be on the wire already, but the turn is remembered before this
        # task yields to the loop (no await from here on), so no request can miss it.
        if upstream.status == 200 and "json" in content_type:
            try:
                exchange.finish(orjson.loads(body))
            except orjson.JSONDecodeError:
                proxy.metrics.turns_not_recorded.labels(reason="malformed").inc()


async def create_sibling(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses/input_tokens` and `/v1/responses/compact` take
    `previous_response_id` too: it is expanded the same way (the backend counts or compacts
    the whole chain), and nothing is remembered. Without one, the body passes unchanged."""
    proxy = proxy_of(request)
    raw = await read_body(request, proxy.config.max_body_bytes)
    parsed = _loads(raw)
    if not isinstance(parsed, dict) or parsed.get("previous_response_id") is None:
        return await passthrough(request, body=raw)
    exchange = await prepare_exchange(proxy, scope_of(request.headers), check_request(parsed), raw)
    timing = timing_of(request)
    headers = upstream_headers(request.headers, proxy.config, identity=False)
    headers["Content-Type"] = "application/json"
    async with open_upstream(exchange, request.path_qs, headers, timing) as (_, upstream):
        with timing.waiting():
            body = await upstream.read()
        return web.Response(
            body=body,
            status=upstream.status,
            headers=client_headers(upstream.headers, body_rewritten=False),
        )


async def relay_stream(
    reply: Reply,
    upstream: UpstreamResponse,
    exchange: Exchange,
    timing: Timing,
) -> None:
    await reply.start(upstream.status, client_headers(upstream.headers, body_rewritten=True))
    last: Event | None = None  # the last event with data, for the next sequence number
    try:
        async for batch in stream_events(upstream, exchange, timing):
            await reply.write(b"".join(event.raw for event in batch))
            last = next((e for e in reversed(batch) if e.data), last)
    except UpstreamError as exc:
        log.warning("backend broke off a stream: %s", exc.message)
        if not exchange.finished:
            # The status line is out: say so in the stream, then end it; nothing is recorded.
            exchange.proxy.metrics.turns_not_recorded.labels(reason="broken_off").inc()
            await reply.write(error_event(exc, _next_sequence_number(last)))
    await reply.end()


def error_event(error: OcxError, sequence_number: int | None) -> bytes:
    """An SSE `error` event: the nested error object, its fields also at the top level."""
    body = error.to_openai_error()["error"]
    payload = {"type": "error", "code": body["code"], "message": body["message"]}
    payload.update(param=body["param"], error=body)
    if sequence_number is not None:
        payload["sequence_number"] = sequence_number
    return encode_event("error", orjson.dumps(payload))


def _next_sequence_number(last: Event | None) -> int | None:
    if last is None:
        return 0
    payload = _loads(last.data)
    seq = payload.get("sequence_number") if isinstance(payload, dict) else None
    return seq + 1 if isinstance(seq, int) else None


async def stream_events(
    upstream: UpstreamResponse, exchange: Exchange, timing: Timing
) -> AsyncIterator[list[Event]]:
    """The backend's SSE events in arrival order, a batch per chunk read. Streams that
    lack spec fields are repaired; the turn is recorded before the terminal event is
    yielded, so a continuation sent the instant it arrives resolves (C1.7). A stream that
    ends with neither a terminal event nor an `error` one is an UpstreamError: the
    client would otherwise take a cut-short response for a finished one."""
    splitter = EventSplitter()
    repair: StreamRepair | None = None
    decided = False
    last: str | None = None  # the type of the last event with data
    while True:
        with timing.waiting():
            chunk = await read_chunk(upstream)
        events = splitter.feed(chunk) if chunk else splitter.flush()
        batch: list[Event] = []
        for event in events:
            if not event.data or event.data == b"[DONE]":
                batch.append(event)
                continue
            if not decided:
                decided = True
                if b'"sequence_number"' not in event.data:
                    repair = StreamRepair()
                    exchange.proxy.metrics.stream_repairs.inc()
            payload: Any = None
            if repair is not None:
                event, payload = repair.fix(event)
            kind = event.name
            if kind is None:
                payload = payload if payload is not None else _loads(event.data)
                kind = payload.get("type") if isinstance(payload, dict) else None
            if kind in TERMINAL_EVENTS:
                payload = payload if payload is not None else _loads(event.data)
                if isinstance(payload, dict):
                    exchange.finish(payload.get("response"))
            last = kind
            batch.append(event)
        if batch:
            yield batch
        if not chunk:
            if last not in FINAL_EVENTS:
                raise UpstreamError("The backend's stream ended before the response finished.")
            return


FINAL_EVENTS = TERMINAL_EVENTS | {"error"}  # after one of these the client expects nothing more


def _loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


# -- stored responses (C2) ---------------------------------------------------------------


def _lookup(proxy: Proxy, request: web.Request) -> Record | None:
    """The caller's stored response; a store:false turn kept in memory for chaining is not
    retrievable (as on OpenAI)."""
    try:
        record = proxy.store.lookup(scope_of(request.headers), request.match_info["response_id"])
    except StoreFailure:
        return None
    return record if record.stored else None


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.")


async def get_response(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    record = _lookup(proxy, request)
    if record is None:
        return await passthrough(request)
    try:
        body = await proxy.store.response_bytes(record)
    except StoreFailure:
        raise _not_found(record.id) from None
    return web.Response(body=body, content_type="application/json")


async def delete_response(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    response_id = request.match_info["response_id"]
    if not proxy.store.delete(scope_of(request.headers), response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    record = _lookup(proxy, request)
    if record is None:
        raise _not_found(request.match_info["response_id"])
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("Invalid 'order': expected 'asc' or 'desc'.", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest("Invalid 'limit': expected an integer from 1 to 100.", param="limit")
    try:
        history = await proxy.store.history(record)
        stored = orjson.loads(await proxy.store.response_bytes(record))
    except StoreFailure:
        raise _not_found(record.id) from None
    items = await asyncio.to_thread(_input_items, record.id, history, len(stored.get("output", [])))
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"No item with id '{after}' in this list.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        },
        dumps=lambda obj: orjson.dumps(obj).decode(),
    )


def _input_items(response_id: str, history: list[bytes], n_output: int) -> list[dict[str, Any]]:
    """The model-visible input of a stored response as OpenAI lists it: each item with an
    id (minted when the client sent none, stable per response and position), messages in
    the typed form (content parts, status)."""
    items: list[Any] = orjson.loads(b"[" + b",".join(history) + b"]")
    if n_output:
        items = items[:-n_output]
    result: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        item = {"id": f"msg_{response_id.removeprefix('resp_')}_{index}", **item}
        if "role" in item:
            item.setdefault("type", "message")
        if item.get("type") == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
        result.append(item)
    return result
