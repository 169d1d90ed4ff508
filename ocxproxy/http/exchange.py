"""One create turn, for HTTP and WebSocket alike: resolve → expand → forward → relay → record.

`prepare_exchange` resolves `previous_response_id` (in the caller's scope, or a WebSocket
connection's own store first) and splices the forwarded body; `open_upstream` sends it to
the backend its chain's affinity picks; `create` relays a JSON answer or, through
`stream_events`, an SSE stream, and `Exchange.finish` remembers the turn before the client
can see that it ended (CONTRACT.md C1.7); with the durable store in `ack` mode
`Exchange.commit` then holds the answer (the JSON body, the SSE or WebSocket terminal
event) until the turn is fsynced, and turns it into a 503 storage_unavailable / `error`
event when it cannot be.
Where the answer goes is a `Reply`: an aiohttp response (http/responses.py) or the front
end's own connection (http/front.py). No aiohttp.web here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson
from multidict import CIMultiDict

from ocxproxy.continuation.affinity import affinity_of, chain_key
from ocxproxy.continuation.conversation import conversation_id_of
from ocxproxy.continuation.echo import echo_previous_id
from ocxproxy.continuation.expand import (
    Request,
    check_call_bindings,
    expand,
    parse_request,
    serialize_items,
    tail_as_sent,
)
from ocxproxy.continuation.locks import Lease
from ocxproxy.continuation.record import build_turn, not_recordable_reason
from ocxproxy.continuation.references import not_found, references, splice
from ocxproxy.errors import (
    FailureReason,
    OcxError,
    PreviousResponseNotFound,
    StorageUnavailable,
    StoreFailure,
    UpstreamError,
)
from ocxproxy.http import idempotency
from ocxproxy.http.context import Proxy, scope_of
from ocxproxy.http.conversation_state import (
    Conversation,
    append,
    check_room,
    load,
    lock,
    unreadable,
)
from ocxproxy.http.headers import client_headers, upstream_headers
from ocxproxy.metrics import Timing
from ocxproxy.model import Record, Segment, Turn
from ocxproxy.store import Store
from ocxproxy.upstream.dialect import UpstreamResponse
from ocxproxy.upstream.pool import Backend, read_chunk
from ocxproxy.upstream.repair import StreamRepair
from ocxproxy.upstream.sse import (
    FINAL_EVENTS,
    RESPONSE_EVENTS,
    TERMINAL_EVENTS,
    Event,
    EventSplitter,
    encode_event,
    with_data,
)

log = logging.getLogger("ocxproxy.responses")


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
    tail: list[bytes] | None = None  # the request's own items as forwarded (serialized)
    backend: Backend | None = None
    affinity_key: str | None = None
    recorded: bool = False
    finished: bool = False  # a terminal response arrived (remembered or not)
    record: Record | None = None  # the remembered turn, until commit() has made it durable
    # For the access log: how previous_response_id resolved, the stored history's size,
    # and the usage the backend reported.
    expansion: str | None = None
    history_bytes: int = 0
    input_tokens: int | None = None
    cached_tokens: int | None = None
    conversation: Conversation | None = None  # the one this turn reads and appends to
    lease: Lease | None = None  # its lock, held from prepare_exchange until the end
    idempotency_key: idempotency.Key | None = None  # the request's Idempotency-Key
    kept: list[Record] = field(default_factory=list)  # written by Store.keep; commit() waits

    def finish(self, response: Any) -> None:
        """Remember the turn when the response is one to remember (CONTRACT.md C1.6),
        append it to its conversation, and let the conversation go: before the client can
        see the end."""
        self.finished = True
        metrics = self.proxy.metrics
        self.observe_usage(response)
        reason = not_recordable_reason(response)
        if self.idempotency_key is not None:  # a retry from now on gets this response
            if reason is None:
                entry = idempotency.remember(
                    self.proxy, self.idempotency_key, response, durable=self.durable
                )
                if entry is not None:
                    self.kept.append(entry)
            self.proxy.in_flight.end(self.idempotency_key.record_id)
        if self.conversation is not None:
            if reason is None and self.request.store:  # store:false content never on disk
                self._append(response)
            self.release()
        if reason is None and self.target is None:
            reason = "store_false"
        if reason is not None:
            metrics.turns_not_recorded.labels(reason=reason).inc()
            return
        assert self.target is not None  # else reason is "store_false"
        self.record = self.target.put(self._turn(response), self.parent)
        self.recorded = True

    def _append(self, response: dict[str, Any]) -> None:
        """Append the request's items and the output to the conversation (as one segment,
        the bytes this turn's record holds too): the answer is out, so even past the
        store's caps (their room was checked before the turn, for its own items)."""
        conversation = self.conversation
        assert conversation is not None
        store = self.proxy.store
        try:
            current = store.record(self.scope, conversation.id)
        except StoreFailure:
            current = None
        if current is not conversation.record:  # deleted, or written by a lease-breaker
            log.warning("conversation %s changed during a turn; not appended", conversation.id)
            self.proxy.metrics.turns_not_recorded.labels(reason="conversation_changed").inc()
            return
        turn = self._turn(response)
        segment = Segment(
            turn.items, turn.n_items, turn.call_ids, durable=False, item_ids=turn.item_ids
        )
        items = [*self.request.items, *response["output"]]
        backend = self.backend.url if self.backend else None
        try:
            self.conversation = append(
                store, conversation, segment, items, backend=backend, force=True
            )
            self.kept.append(self.conversation.record)
        except OcxError as error:  # its stored items could not be read
            log.error("conversation %s: turn not appended: %s", conversation.id, error)
            self.proxy.metrics.turns_not_recorded.labels(reason="conversation_failed").inc()

    def release(self) -> None:
        """Let the conversation go (idempotent): on completion, failure, cancel, disconnect."""
        if self.lease is not None:
            self.proxy.leases.release(self.lease)
            self.lease = None

    def _turn(self, response: dict[str, Any]) -> Turn:
        if self.tail is None:  # forwarded as the client sent it: remember those bytes
            self.tail = tail_as_sent(self.body, self.request)
        return build_turn(
            response=response,
            scope=self.scope,
            durable=self.durable,
            tail=self.tail,
            tail_items=self.request.items,
            backend=self.backend.url if self.backend else None,
            affinity_key=chain_key(self.affinity_key, self.parent, response),
            stored=self.request.store,
        )

    async def commit(self) -> None:
        """Until the turn finish() remembered, and what it wrote to its conversation, are
        durable (a no-op unless the store is in `ack` mode); StorageUnavailable when they
        cannot be: the turn must not be acknowledged."""
        kept, self.kept = self.kept, []
        record, target = self.record, self.target
        self.record = None
        metrics = self.proxy.metrics
        try:
            for other in kept:  # its conversation's new state, its Idempotency-Key
                await self.proxy.store.commit(other)
            if record is None or target is None:
                return
            await target.commit(record)
        except StoreFailure:
            self.recorded = False
            metrics.turns_not_recorded.labels(reason="storage_unavailable").inc()
            raise StorageUnavailable(
                "The response could not be stored: the proxy's storage is unavailable "
                "(e.g. its disk is full). Nothing was saved; retry later, or send store=false."
            ) from None
        metrics.turns_recorded.labels(kind="durable" if record.durable else "memory").inc()

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
        self.input_tokens = total
        if isinstance(cached, int) and cached >= 0:
            self.cached_tokens = cached
            metrics.cached_tokens.labels(url).inc(cached)
            metrics.cached_ratio.labels(url).observe(min(cached / total, 1.0))
            if self.parent is not None:
                metrics.continuation_input_tokens.labels(url).inc(total)
                metrics.continuation_cached_tokens.labels(url).inc(cached)


async def prepare_exchange(
    proxy: Proxy,
    scope: str,
    request: Request,
    raw: bytes | None,
    *,
    local: Store | None = None,
) -> Exchange:
    """Resolve and expand a create request; raises before anything is forwarded.

    `raw` is the client's body, forwarded unchanged when there is nothing to expand or
    resolve (CONTRACT.md C1.1). `local` is a WebSocket connection's own store: store:false
    turns live there, and a chain that started there stays there.
    """
    refs = references(request.items)
    resolved, sources = await _resolve_items(proxy, scope, refs, local) if refs else ({}, set())
    # A turn holding items of a WebSocket connection's own store stays there, like a
    # chain that started there: its store:false content must not reach disk.
    from_local = local if local in sources else None
    prev = request.previous_response_id
    conversation_id = conversation_id_of(request.body)
    if conversation_id is not None:
        return await _prepare_conversation(proxy, scope, request, conversation_id, local, resolved)
    if prev is None:
        target, durable = _retention(proxy, request, local, parent_store=from_local)
        await _room_in(proxy, target)
        tail: list[bytes] | None = None
        if resolved:
            own = tail_as_sent(raw, request) if raw is not None else serialize_items(request.items)
            tail, items = splice(own, request.items, resolved)
            request = replace(request, items=items)
            body = expand(request.body, [], tail)
        else:
            body = raw if raw is not None else orjson.dumps(request.body)
        return Exchange(
            proxy,
            scope,
            request,
            body,
            target,
            durable,
            tail=tail,
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
            return Exchange(proxy, scope, request, body, None, expansion=str(failure.reason))
        raise PreviousResponseNotFound(prev, failure.reason) from None
    tail = serialize_items(request.items)
    if resolved:
        tail, items = splice(tail, request.items, resolved)
        request = replace(request, items=items)
    check_call_bindings(request.items, parent)
    body = expand(request.body, history, tail)
    metrics.expansions.labels(outcome="hit").inc()
    target, durable = _retention(proxy, request, local, parent_store=from_local or store)
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
        expansion="hit",
        history_bytes=sum(map(len, history)),
    )


async def _resolve_items(
    proxy: Proxy, scope: str, refs: dict[int, str], local: Store | None
) -> tuple[dict[int, bytes], set[Store]]:
    """Each referenced item's stored bytes, by input index, and the stores they came from:
    from the caller's scope, over WebSocket the connection's own store first (its
    store:false items too), else the shared store's stored items. An id found nowhere is
    an InvalidRequest naming it, unless the operator forwards unknown ids (the reference
    then goes as it came)."""
    metrics = proxy.metrics.item_references
    stores = ((local, True), (proxy.store, False)) if local is not None else ((proxy.store, False),)
    wanted: dict[Store, list[tuple[int, Record, str]]] = {}
    for index, item_id in refs.items():
        for store, unstored in stores:
            try:
                record = store.find_item(scope, item_id, unstored=unstored)
            except StoreFailure:
                continue
            wanted.setdefault(store, []).append((index, record, item_id))
            break
        else:
            metrics.labels(outcome=str(FailureReason.UNKNOWN)).inc()
            if not proxy.config.forward_unknown_ids:
                raise not_found(item_id)
    resolved: dict[int, bytes] = {}
    for store, entries in wanted.items():
        try:
            datas = await store.item_bytes([(record, item_id) for _, record, item_id in entries])
        except StoreFailure as failure:  # which one: ask for each
            metrics.labels(outcome=str(failure.reason)).inc()
            datas = []
            for _, record, item_id in entries:
                try:
                    datas += await store.item_bytes([(record, item_id)])
                except StoreFailure:
                    raise not_found(item_id) from None
        resolved.update((index, data) for (index, _, _), data in zip(entries, datas, strict=True))
    metrics.labels(outcome="resolved").inc(len(resolved))
    return resolved, set(wanted)


async def _prepare_conversation(
    proxy: Proxy,
    scope: str,
    request: Request,
    conversation_id: str,
    local: Store | None,
    resolved: dict[int, bytes],
) -> Exchange:
    """A turn on a conversation: its items spliced in front of the input like a chain's,
    under its lock (400 conversation_locked while another turn or write holds it), taken
    before anything is forwarded."""
    store = proxy.store
    lease = lock(proxy.leases, conversation_id)
    try:
        conversation = await load(store, scope, conversation_id)
        parent = conversation.record
        try:
            history = await store.history(parent)
        except StoreFailure as failure:
            raise unreadable(failure) from None
        tail, items = splice(serialize_items(request.items), request.items, resolved)
        request = replace(request, items=items)
        check_call_bindings(request.items, parent)
        check_room(store, conversation, sum(len(part) + 1 for part in tail))
        body = expand(request.body, history, tail)
        target, durable = _retention(proxy, request, local, parent_store=store)
        await _room_in(proxy, target)
    except BaseException:
        proxy.leases.release(lease)
        raise
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
        expansion="conversation",
        history_bytes=sum(map(len, history)),
        conversation=conversation,
        lease=lease,
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
    """Where a turn is remembered and whether it may reach disk (CONTRACT.md C3, C5)."""
    if local is not None and (parent_store is local or not request.store):
        return local, False
    if request.store:
        return proxy.store, not proxy.config.zdr
    if proxy.config.retain_unstored:
        return proxy.store, False
    return None, False


def open_upstream(
    exchange: Exchange, path_qs: str, headers: Mapping[str, str], timing: Timing
) -> AbstractAsyncContextManager[tuple[Backend, UpstreamResponse]]:
    """The backend request of a create exchange, routed by its chain's affinity (CONTRACT.md C6)."""
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


async def create(
    proxy: Proxy,
    headers: Mapping[str, str],
    path_qs: str,
    raw: bytes,
    timing: Timing,
    reply: Reply,
) -> None:
    """`POST /v1/responses`: expand, forward, relay the answer, remember the turn; with an
    Idempotency-Key, a retry is answered from the first run (http/idempotency.py)."""
    scope = scope_of(headers)
    request = parse_request(raw)
    key = idempotency.key_of(headers, scope, raw)
    if key is not None:
        proxy.in_flight.begin(key.record_id, key.fingerprint)  # 409 or 422 while running
    try:
        if key is not None:
            done = await idempotency.stored(proxy, key)
            if done is not None:
                await _replay(reply, done, stream=request.stream)
                return
        exchange = await prepare_exchange(proxy, scope, request, raw)
        timing.exchange = exchange
        exchange.idempotency_key = key
        try:
            await _forward(exchange, headers, path_qs, timing, reply)
        finally:
            exchange.release()
    finally:
        if key is not None:
            proxy.in_flight.end(key.record_id)


async def _replay(reply: Reply, response: dict[str, Any], *, stream: bool) -> None:
    headers = CIMultiDict({"Idempotent-Replayed": "true"})
    if not stream:
        headers["Content-Type"] = "application/json"
        reply.answer(200, headers, orjson.dumps(response))
        return
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    await reply.start(200, headers)
    await reply.write(idempotency.replay_stream(response))
    await reply.end()


async def _forward(
    exchange: Exchange,
    headers: Mapping[str, str],
    path_qs: str,
    timing: Timing,
    reply: Reply,
) -> None:
    proxy = exchange.proxy
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
        prev = exchange.request.previous_response_id
        if prev is not None and upstream.status == 200 and "json" in content_type:
            body = echo_previous_id(body, prev)
        answer_headers = client_headers(upstream.headers, body_rewritten=False)
        # The turn is remembered, and durable, before the client can see the answer.
        if upstream.status == 200 and "json" in content_type:
            try:
                exchange.finish(orjson.loads(body))
            except orjson.JSONDecodeError:
                proxy.metrics.turns_not_recorded.labels(reason="malformed").inc()
            await exchange.commit()
        reply.answer(upstream.status, answer_headers, body)


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
            await reply.write(sse_error_event(exc, _next_sequence_number(last)))
    except StorageUnavailable as exc:  # instead of the terminal event
        await reply.write(sse_error_event(exc, _next_sequence_number(last)))
    await reply.end()


def sse_error_event(error: OcxError, sequence_number: int | None) -> bytes:
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
    payload = loads_or_none(last.data)
    seq = payload.get("sequence_number") if isinstance(payload, dict) else None
    return seq + 1 if isinstance(seq, int) else None


async def stream_events(
    upstream: UpstreamResponse, exchange: Exchange, timing: Timing
) -> AsyncIterator[list[Event]]:
    """The backend's SSE events in arrival order, a batch per chunk read. Streams that
    lack spec fields are repaired; the turn is recorded before the terminal event is
    yielded, so a continuation sent the instant it arrives resolves (CONTRACT.md C1.7),
    and yielded only once durable: the events before it, then StorageUnavailable, when it
    cannot be.
    A stream that ends with neither a terminal event nor an `error` one is an
    UpstreamError: the client would otherwise take a cut-short response for a finished
    one."""
    splitter = EventSplitter()
    repair: StreamRepair | None = None
    echo = exchange.request.previous_response_id
    decided = False
    last: str | None = None  # the type of the last event with data
    while True:
        with timing.waiting():
            chunk = await read_chunk(upstream)
        if exchange.lease is not None:
            exchange.proxy.leases.renew(exchange.lease)
        events = splitter.feed(chunk) if chunk else splitter.flush()
        batch: list[Event] = []
        terminal = -1  # where in the batch the terminal event of a remembered turn is
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
                payload = payload if payload is not None else loads_or_none(event.data)
                kind = payload.get("type") if isinstance(payload, dict) else None
            if echo is not None and kind in RESPONSE_EVENTS:
                event, payload = _echoed(event, payload, echo)
            if kind in TERMINAL_EVENTS:
                payload = payload if payload is not None else loads_or_none(event.data)
                if isinstance(payload, dict):
                    exchange.finish(payload.get("response"))
                    terminal = len(batch)
            last = kind
            batch.append(event)
        if terminal >= 0:
            try:
                await exchange.commit()
            except StorageUnavailable:
                if terminal:
                    yield batch[:terminal]
                raise
        if batch:
            yield batch
        if not chunk:
            if last not in FINAL_EVENTS:
                raise UpstreamError("The backend's stream ended before the response finished.")
            return


def _echoed(event: Event, payload: Any, previous_id: str) -> tuple[Event, Any]:
    """A Response-carrying event naming the request's previous_response_id, patched in
    its bytes (and in its decoded payload, when there is one)."""
    data = echo_previous_id(event.data, previous_id, in_event=True)
    if data is event.data:
        return event, payload
    response = payload.get("response") if isinstance(payload, dict) else None
    if isinstance(response, dict):
        response["previous_response_id"] = previous_id
    return with_data(event, data), payload


def loads_or_none(data: bytes) -> Any:
    """The JSON value of `data`, or None when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
