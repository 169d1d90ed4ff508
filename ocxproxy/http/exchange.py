"""One create turn, for HTTP and WebSocket alike: resolve → expand → forward → relay → record.

`prepare_exchange` resolves what the request continues (a previous response, a
conversation, item references) and splices the forwarded body; `open_upstream` sends it to
the backend its affinity picks; `create` relays a JSON answer or, through `stream_events`,
an SSE stream. `Exchange.finish` remembers the turn, and appends it to its conversation,
before the client can see that it ended (CONTRACT.md C1.7); `Exchange.commit` holds the
answer until that is durable, or turns it into an error (an `error` event in a stream) when
it cannot be. The answer goes to a `Reply` (http/context.py). No aiohttp.web here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import orjson

from ocxproxy.continuation.affinity import affinity_of, chain_key
from ocxproxy.continuation.compaction import (
    Injection,
    compact_threshold,
    compacted_history,
    open_items,
    replace_in_body,
    summary_request,
    with_summaries,
)
from ocxproxy.continuation.conversation import conversation_id_of
from ocxproxy.continuation.envelope import (
    Envelope,
    Patch,
    spliced,
    written,
    written_event,
)
from ocxproxy.continuation.expand import (
    Request,
    check_call_bindings,
    expand,
    forwarded_members,
    parse_request,
    serialize_items,
    tail_as_sent,
)
from ocxproxy.continuation.record import build_turn, input_tokens_of, not_recordable_reason
from ocxproxy.continuation.references import not_storable, scan_input, splice
from ocxproxy.continuation.window import NO_CUT, Cut
from ocxproxy.errors import (
    FailureReason,
    OcxError,
    PreviousResponseNotFound,
    ShuttingDown,
    StorageUnavailable,
    StoreFailure,
    UpstreamError,
    complete_error_event,
    error_answer,
    not_stored,
)
from ocxproxy.http import compaction, idempotency
from ocxproxy.http.context import Proxy, Reply, scope_of
from ocxproxy.http.headers import client_headers, upstream_headers
from ocxproxy.http.stores import resolve_items, resolve_previous, retention, wait_for_room
from ocxproxy.http.warm import check_cache, resume, save_after
from ocxproxy.http.window import book_keys, fit_window, passes_threshold, remember_usage
from ocxproxy.metrics import Timing
from ocxproxy.model import Record, Turn
from ocxproxy.store import ConversationTurn, Store, StoreInterface
from ocxproxy.upstream.dialect import CHAT, UpstreamResponse
from ocxproxy.upstream.kvsave import Outcome
from ocxproxy.upstream.pool import Backend, read_chunk
from ocxproxy.upstream.repair import StreamRepair, cut_short
from ocxproxy.upstream.sse import (
    FINAL_EVENTS,
    PENDING_EVENTS,
    RESPONSE_EVENTS,
    TERMINAL_EVENTS,
    Event,
    EventSplitter,
    encode_event,
    error_event,
    loads_or_none,
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
    target: StoreInterface | None  # where the finished turn is remembered; None: not at all
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
    conversation: ConversationTurn | None = None  # the one this turn reads and appends to
    idempotency_key: idempotency.Key | None = None  # the request's Idempotency-Key
    kept: list[Record] = field(default_factory=list)  # a conversation append, a key; commit() waits
    key_entry: Record | None = None  # the completed Idempotency-Key, committed after the turn
    failure: OcxError | None = None  # why the finished turn must not be acknowledged
    envelope: Envelope = field(default_factory=Envelope)  # completes each Response sent
    # A background run's: its Reply makes its own lifecycle events from the proxy's
    # queued Response, and its terminal event from `final`, so stream_events leaves the
    # backend's as they came (undecoded, not written again).
    pending_raw: bool = False
    final: Any = None  # the terminal Response, as finished (completed in place after)
    # The input ended in a compaction trigger: `body` asks the backend for a summary
    # (http/compaction.py answers the client), and the turn is remembered as `summary`
    # (its message bytes) on top of `retained` (a chain starts again from the compacted
    # window: the kept user messages, serialized and parsed).
    compaction: bool = False
    summary: bytes | None = None
    retained: tuple[list[bytes], list[Any]] = ([], [])
    # context_management's threshold passed: the summary request and the history it
    # summarizes, until http/compaction.py has compacted (`body` is then the compacted
    # window and this turn's input, and `injection` puts the item first in the answer).
    pending: tuple[bytes, list[bytes]] | None = None
    injection: Injection | None = None
    cut: Cut = NO_CUT  # items left out to fit the context window (http/window.py)
    book_key: str | None = None  # where the turn's window fact is kept (BookKeys.put)
    # What warm resume knew before sending that explains a cache miss (http/warm.py):
    # restore_failed, fingerprint_mismatch.
    cache_note: str | None = None
    cache_expect: int | None = None  # the tokens of the chain's save, when it has one
    restored: Outcome | None = None  # the restore made before sending, to verify

    def finish(
        self, response: Any, encoded: bytes | None = None, patch: Patch | None = None
    ) -> None:
        """Remember the turn when the response is one to remember (CONTRACT.md C1.6),
        append it to its conversation, and let the conversation go: before the client can
        see the end. `encoded`: the response's bytes, when they are at hand; `patch`: the
        members they hold and the dict may not (merged into it if it is encoded)."""
        self.finished = True
        self.final = response
        metrics = self.proxy.metrics
        self.observe_usage(response)
        reason = not_recordable_reason(response)
        if self.conversation is not None:
            if reason is None and self.request.store:  # store:false content never on disk
                reason = self._append(response, encoded, patch)
            self.kept += self.conversation.let_go()  # before the client sees the end
        done = response if reason is None else None  # what a retry with its key gets
        if reason is None and self.target is None:
            reason = "store_false"
        if reason is not None:
            metrics.turns_not_recorded.labels(reason=reason).inc()
        else:
            assert self.target is not None  # else reason is "store_false"
            if self.record is None:  # (a conversation turn's may be put already: _append)
                self.record = self.target.put(
                    self._turn(response, encoded, patch), self._chains_on()
                )
            self.recorded = True
        if self.idempotency_key is not None:  # after the turn, in the journal as in commit()
            self.key_entry = idempotency.complete(
                self.proxy, self.idempotency_key, done, durable=self.durable
            )

    def _append(
        self, response: dict[str, Any], encoded: bytes | None, patch: Patch | None
    ) -> str | None:
        """Append the turn to its conversation; else the reason it was not (a metric
        label), and the error that answers the client instead (commit() raises it)."""
        assert self.conversation is not None
        items = [*self.request.items, *response["output"]]
        backend = self.backend.url if self.backend else None
        try:
            turn = self._turn(response, encoded, patch)
            if self.target is not None and self.conversation.put_first:
                # Put while the conversation's record it chains on is live, so its row
                # names it: after the append it would need its whole chain (O(length)).
                self.record = self.target.put(turn, self._chains_on())
            self.kept.append(self.conversation.append(self.scope, turn, items, backend))
        except OcxError as error:
            if self.record is not None and self.target is not None:  # not kept after all
                self.target.delete_nowait(self.scope, self.record.id)
                self.record = None
            self.failure = error
            changed = error.code == "conversation_changed"
            return "conversation_changed" if changed else "conversation_failed"
        return None

    def release(self) -> None:
        """Let the conversation go (idempotent): on completion, failure, cancel, disconnect."""
        if self.conversation is not None:
            self.conversation.release()

    def _chains_on(self) -> Record | None:
        """The record the turn is put on top of: none for a compaction outside a
        conversation (its window starts a chain: later turns forward only that)."""
        return None if self.summary is not None and self.conversation is None else self.parent

    def _turn(
        self, response: dict[str, Any], encoded: bytes | None = None, patch: Patch | None = None
    ) -> Turn:
        if self.tail is None:  # forwarded as the client sent it: remember those bytes
            self.tail = tail_as_sent(self.body, self.request)
        tail, tail_items = self.tail, self.request.items
        if self.injection is not None:  # compacted first: the window, then the turn
            window, window_items = self.retained
            output = [item for item in response["output"] if item is not self.injection.item]
            turn = build_turn(
                response={**response, "output": output},
                scope=self.scope,
                durable=self.durable,
                tail=[*window, *tail],
                tail_items=[*window_items, *tail_items],
                backend=self.backend.url if self.backend else None,
                affinity_key=chain_key(self.affinity_key, self.parent, response),
                stored=self.request.store,
            )
            return replace(turn, response=orjson.dumps(response), output_at=None)
        if self.summary is not None and self.conversation is None:
            tail, tail_items = self.retained
        return build_turn(
            response=response,
            scope=self.scope,
            durable=self.durable,
            tail=tail,
            tail_items=tail_items,
            backend=self.backend.url if self.backend else None,
            affinity_key=chain_key(self.affinity_key, self.parent, response),
            stored=self.request.store,
            output_parts=None if self.summary is None else [self.summary],
            encoded=encoded,
            patch=patch,
        )

    async def commit(self) -> None:
        """Until the turn finish() remembered, and what it wrote to its conversation, are
        durable (a no-op unless the store is in `ack` mode); when they cannot be, the error
        the store's reason calls for (errors.not_stored), or the error that kept finish()
        from appending the turn to its conversation: the turn must not be acknowledged."""
        if self.failure is not None:
            raise self.failure
        kept, self.kept = self.kept, []
        key_entry, self.key_entry = self.key_entry, None
        record, target = self.record, self.target
        self.record = None
        metrics = self.proxy.metrics
        try:
            for other in kept:  # its conversation's new state
                await self.proxy.store.commit(other)
            if record is not None and target is not None:
                await target.commit(record)
        except StoreFailure as failure:
            self.recorded = False
            metrics.turns_not_recorded.labels(reason="storage_unavailable").inc()
            raise not_stored(failure) from None
        if record is not None:
            metrics.turns_recorded.labels(kind="durable" if record.durable else "memory").inc()
            save_after(self, record)
        if key_entry is None:
            return
        try:  # last: a completed key always names a response that is kept
            await self.proxy.store.commit(key_entry)
        except StoreFailure:
            raise StorageUnavailable(
                "The response was stored, but its Idempotency-Key could not be: the proxy's "
                "storage is unavailable. A retry with this key runs the request again."
            ) from None

    def output_limit(self) -> Any:
        """The request's `max_output_tokens`, where a `completed` from the backend may hide
        an answer cut there (CONTRACT.md C1.10); None for a Chat Completions backend,
        whose `finish_reason` says which it was."""
        if self.backend is not None and self.backend.dialect == CHAT:
            return None
        return self.request.body.get("max_output_tokens")

    def observe_usage(self, response: Any) -> None:
        if self.injection is not None:  # the turn's own: its billed usage has the summary's
            response = self.injection.own(response)
        usage = input_tokens_of(response)
        if usage is None or self.backend is None:
            return
        (total, cached), metrics, url = usage, self.proxy.metrics, self.backend.url
        metrics.input_tokens.labels(url).inc(total)
        self.input_tokens = total
        remember_usage(self.proxy, response, url, self.body, self.cut, total, self.book_key)
        if cached is not None:
            self.cached_tokens = cached
            metrics.cached_tokens.labels(url).inc(cached)
            metrics.cached_ratio.labels(url).observe(min(cached / total, 1.0))
            if self.parent is not None:
                metrics.continuation_input_tokens.labels(url).inc(total)
                metrics.continuation_cached_tokens.labels(url).inc(cached)
        check_cache(self, response, total, cached)


async def prepare_exchange(
    proxy: Proxy,
    scope: str,
    request: Request,
    raw: bytes | None,
    *,
    local: Store | None = None,
    remember: bool = True,
) -> Exchange:
    """Resolve and expand a create request; raises before anything is forwarded.

    `raw` is the client's body, forwarded unchanged when there is nothing to expand or
    resolve (CONTRACT.md C1.1). `local` is a WebSocket connection's own store: store:false
    turns live there, and a chain that started there stays there. Without `remember` (the
    siblings of create), nothing will be: a conversation is read without its lock.
    """
    refs, sealed, trigger = scan_input(request.items)
    threshold: int | None = None
    managed = "context_management" in request.body  # served here, never forwarded
    if managed:
        threshold = compact_threshold(request.body)
        body_fields = {k: v for k, v in request.body.items() if k != "context_management"}
        request = replace(request, body=body_fields)
    resolved, sources = await resolve_items(proxy, scope, refs, local) if refs else ({}, {})
    # A turn holding items of a WebSocket connection's own store stays there, like a
    # chain that started there: its store:false content must not reach disk.
    parent_store: StoreInterface | None = local if local in sources else None
    parent: Record | None = None
    history: list[bytes] = []
    expansion: str | None = None
    held: ConversationTurn | None = None
    prev = request.previous_response_id
    echo: tuple[str, Any] | None = None if prev is None else ("previous_response_id", prev)
    conversation_id = conversation_id_of(request.body)
    if conversation_id is not None:
        if local in sources and request.store:  # the conversation would keep it (on disk)
            raise not_storable(sources[local][0])
        held, history = await proxy.store.conversations.open_turn(
            scope, conversation_id, proxy.lease_duration, locked=remember
        )
        history = compacted_history(conversation_id, history)  # from its latest summary on
        parent, parent_store, expansion = held.conversation.record, proxy.store, "conversation"
        echo = ("conversation", {"id": conversation_id})
    elif prev is not None:
        try:
            store, parent = await resolve_previous(proxy, scope, prev, local)
            history = await store.history(parent)
        except StoreFailure as failure:
            proxy.metrics.expansions.labels(outcome=str(failure.reason)).inc()
            unknown = failure.reason == FailureReason.UNKNOWN
            if proxy.config.forward_unknown_ids and unknown and not (sealed or trigger):
                body = raw if raw is not None else orjson.dumps(request.body)  # as it came
                reason = str(failure.reason)
                envelope = Envelope(request.body, echo, proxy.served_models)
                return Exchange(
                    proxy, scope, request, body, None, expansion=reason, envelope=envelope
                )
            raise PreviousResponseNotFound(prev, failure.reason) from None
        parent_store, expansion = parent_store or store, "hit"
    pending: tuple[bytes, list[bytes]] | None = None
    keys = book_keys(scope, request, parent, conversation_id)
    try:
        tail: list[bytes] | None = None  # the request's own items as forwarded
        members: bytes | None = None  # the request's other members as forwarded
        # Compaction items reach the backend, and the store, as their summary messages.
        opened = open_items(proxy.sealer, scope, request.items, sealed) if sealed else {}
        fast: bytes | None = None  # a first turn with no more to do: its own bytes edited
        if opened and parent is None and not (resolved or trigger or managed) and raw is not None:
            fast = replace_in_body(raw, request.items, opened)
        if fast is not None:
            body = fast
            request = replace(request, items=with_summaries(request.items, opened))
        elif parent is not None or resolved or opened or trigger or managed:
            if parent is None and raw is not None:  # a first turn keeps the client's bytes
                tail = tail_as_sent(raw, request)
            else:
                tail = serialize_items(request.items)
            if resolved:
                tail, items = splice(tail, request.items, resolved)
                request = replace(request, items=items)
            if opened:
                for index, message in opened.items():
                    tail[index] = message
                request = replace(request, items=with_summaries(request.items, opened))
            if trigger:  # never forwarded: the backend is asked for a summary instead
                tail, request = tail[:-1], replace(request, items=request.items[:-1])
            if parent is not None:
                check_call_bindings(request.items, parent)
            if held is not None and remember:
                held.check_room(sum(len(part) + 1 for part in tail))
            if trigger:
                body = summary_request(request.body, history, tail)
            else:
                members = forwarded_members(request.body)
                body = expand(request.body, history, tail, members)
                # A conversation keeps its items: it is not compacted by a threshold.
                if (
                    threshold is not None
                    and held is None
                    and await passes_threshold(proxy, parent, keys.get, body, threshold)
                ):
                    pending = (summary_request(request.body, history, tail), history)
        else:  # nothing to splice in: forwarded as the client sent it
            body = raw if raw is not None else orjson.dumps(request.body)
        cut = NO_CUT
        if remember and not trigger and pending is None:  # a compaction has its own window
            body, cut = await fit_window(proxy, request, parent, keys.get, history, tail, body, raw)
        if expansion == "hit":
            proxy.metrics.expansions.labels(outcome="hit").inc()
        target, durable = retention(proxy, request, local, parent_store, remember)
        await wait_for_room(proxy, target)
    except BaseException:
        if held is not None:
            held.release()
        raise
    return Exchange(
        proxy,
        scope,
        request,
        body,
        target,
        durable and (parent is None or parent.durable),
        parent=parent,
        tail=tail,
        affinity_key=affinity_of(request, parent),
        expansion=expansion,
        history_bytes=sum(map(len, history)),
        conversation=held,
        envelope=Envelope(request.body, echo, proxy.served_models, members),  # (positional)
        compaction=trigger,
        pending=pending,
        cut=cut,
        book_key=keys.put,
    )


def open_upstream(
    exchange: Exchange,
    path_qs: str,
    headers: Mapping[str, str],
    timing: Timing,
    *,
    turn: bool = False,
) -> AbstractAsyncContextManager[tuple[Backend, UpstreamResponse]]:
    """The backend request of a create exchange, routed by its chain's affinity (CONTRACT.md C6).
    A `turn`'s chain the chosen backend lost gets its saved KV state there first."""
    warm = turn and exchange.proxy.kv_saves is not None and exchange.parent is not None
    return exchange.proxy.pool.open(
        "POST",
        path_qs,
        headers,
        exchange.body,
        timing=timing,
        affinity_key=exchange.affinity_key,
        preferred=exchange.parent.backend if exchange.parent else None,
        prepare=partial(resume, exchange) if warm else None,
    )


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
    if request.body.get("background") not in (None, False):
        import ocxproxy.http.background as background  # (it builds on this module)

        await background.start(proxy, scope, headers, path_qs, raw, request, timing, reply)
        return
    key = idempotency.key_of(headers, scope, raw, stored=request.store)
    done = await idempotency.begin(proxy, key) if key is not None else None
    try:
        if done is not None:  # answered before: the same response again
            await idempotency.replay(reply, done, stream=request.stream)
            return
        exchange = await prepare_exchange(proxy, scope, request, raw)
        timing.exchange = exchange
        exchange.idempotency_key = key
        try:
            if exchange.compaction:
                await compaction.answer(exchange, headers, path_qs, timing, reply)
            else:
                await forward(exchange, headers, path_qs, timing, reply)
        finally:
            exchange.release()
    finally:
        if key is not None:
            idempotency.end(proxy, key)


async def forward(
    exchange: Exchange,
    headers: Mapping[str, str],
    path_qs: str,
    timing: Timing,
    reply: Reply,
) -> None:
    proxy = exchange.proxy
    forwarded = upstream_headers(headers, proxy.config, identity=True, request_id=timing.request_id)
    forwarded["Content-Type"] = "application/json"
    if exchange.pending is not None:  # context_management's threshold passed
        await compaction.compact_first(exchange, forwarded, path_qs, timing)
    async with open_upstream(exchange, path_qs, forwarded, timing, turn=True) as (
        backend,
        upstream,
    ):
        exchange.backend = backend
        content_type = upstream.headers.get("Content-Type", "")
        if upstream.status == 200 and content_type.startswith("text/event-stream"):
            await relay_stream(reply, upstream, exchange, timing)
            return
        with timing.waiting():
            body = await upstream.read()
        shaped = error_answer(upstream.status, body) if upstream.status >= 400 else None
        answer_headers = client_headers(upstream.headers, body_rewritten=shaped is not None)
        if shaped is not None:  # in OpenAI's shape, its code never null (CONTRACT.md C10)
            body = shaped
            answer_headers["Content-Type"] = "application/json"
        # The turn is remembered, and durable, before the client can see the answer.
        if upstream.status == 200 and "json" in content_type:
            try:
                response = orjson.loads(body)
            except orjson.JSONDecodeError:
                proxy.metrics.turns_not_recorded.labels(reason="malformed").inc()
            else:
                if type(response) is dict:
                    if cut_short(response, exchange.output_limit()):
                        body = orjson.dumps(response)
                    if exchange.injection is not None:  # compacted first: the item leads
                        exchange.injection.into(response)
                    # The filled members are written into the bytes; the dict gets them
                    # only where it is read for them: a retry's answer, a re-encoding.
                    if exchange.injection is None:
                        stored, patch = exchange.envelope.answer(body, response)
                    else:  # (its bytes are the dict's)
                        patch = exchange.envelope.complete(response, final=True, merge=False)
                        patch.rewrite = patch.items = True
                        stored = spliced(body, response, patch)
                    if exchange.idempotency_key is not None:
                        patch.merge(response)
                    # The backend's items, as it gave them (the patch: if the dict is encoded)
                    exchange.finish(response, stored, patch)
                    body = written(stored, response, merged=patch) if patch.items else stored
                else:
                    exchange.finish(response)
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
            await reply.write_events(batch)
            last = next((e for e in reversed(batch) if e.data), last)
    except UpstreamError as exc:
        log.warning("backend broke off a stream: %s", exc.message)
        if not exchange.finished:
            # The status line is out: say so in the stream, then end it; nothing is recorded.
            exchange.proxy.metrics.turns_not_recorded.labels(reason="broken_off").inc()
            await reply.write(error_event(exc.to_openai_error(), after=last))
    except OcxError as exc:  # instead of the terminal event: it cannot be acknowledged
        await reply.write(error_event(exc.to_openai_error(), after=last))
    except asyncio.CancelledError:
        if not exchange.proxy.cut_by_shutdown():
            raise
        # The graceful stop's deadline: a terminal event that says so, then the end.
        await reply.write(error_event(ShuttingDown().to_openai_error(), after=last))
        await reply.end()
        raise
    await reply.end()


async def stream_events(
    upstream: UpstreamResponse, exchange: Exchange, timing: Timing
) -> AsyncIterator[list[Event]]:
    """The backend's SSE events in arrival order, a batch per chunk read. Streams that
    lack spec fields are repaired; the turn is recorded before the terminal event is
    yielded, so a continuation sent the instant it arrives resolves (CONTRACT.md C1.7),
    and yielded only once durable: the events before it, then StorageUnavailable, when it
    cannot be (or the error that kept the turn off its conversation).
    A stream that ends with neither a terminal event nor an `error` one is an
    UpstreamError: the client would otherwise take a cut-short response for a finished
    one."""
    splitter = EventSplitter()
    repair: StreamRepair | None = None
    envelope = exchange.envelope
    decided = False
    last: str | None = None  # the type of the last event with data
    while True:
        with timing.waiting():
            chunk = await read_chunk(upstream)
        if exchange.conversation is not None:
            exchange.conversation.renew()
        events = splitter.feed(chunk) if chunk else splitter.flush()
        batch: list[Event] = []
        terminal = -1  # where in the batch the terminal event of a remembered turn is
        for event in events:
            if not event.data or event.data == b"[DONE]":
                batch.append(event)
                continue
            if not decided:
                decided = True
                if event.data.find(b'"sequence_number"') < 0:  # (find: see sse.py)
                    repair = StreamRepair(envelope)  # completes the Responses too
                    exchange.proxy.metrics.stream_repairs.inc()
            payload: Any = None
            if repair is not None:
                event, payload = repair.fix(event)
            kind = event.name
            if kind is None:
                payload = payload if payload is not None else loads_or_none(event.data)
                kind = payload.get("type") if isinstance(payload, dict) else None
            if exchange.injection is not None:  # compacted first: the item leads
                payload = payload if payload is not None else loads_or_none(event.data)
                if isinstance(payload, dict):
                    for extra in exchange.injection.before(payload):
                        data = orjson.dumps(extra)
                        batch.append(Event(encode_event(extra["type"], data), extra["type"], data))
                    exchange.injection.shift(payload)
                    data = orjson.dumps(payload)
                    event = Event(encode_event(event.name, data), event.name, data)
            patch: Patch | None = None
            # A terminal event's Response's bytes, and whether the event is written
            in_bytes: tuple[bytes, bool] | None = None
            if kind in PENDING_EVENTS and repair is None and exchange.injection is None:
                if not exchange.pending_raw:
                    event = envelope.pending_event(event)  # (not decoded when seen before)
            elif kind == "error":  # the backend's: its error nested, codes never null
                payload = payload if payload is not None else loads_or_none(event.data)
                if isinstance(payload, dict) and complete_error_event(payload):
                    event = with_data(event, orjson.dumps(payload))
            elif kind in RESPONSE_EVENTS:
                payload = payload if payload is not None else loads_or_none(event.data)
                response = payload.get("response") if isinstance(payload, dict) else None
                if type(response) is dict:
                    if kind == "response.completed" and cut_short(
                        response, exchange.output_limit()
                    ):
                        kind = payload["type"] = "response.incomplete"
                        data = orjson.dumps(payload)
                        event = Event(encode_event(kind, data), kind, data)
                    final = kind in TERMINAL_EVENTS
                    # A repaired event's Response is complete already (StreamRepair).
                    if repair is not None:
                        patch = Patch()
                    elif final and exchange.injection is None and not exchange.pending_raw:
                        # The filled members go into the event's bytes and the store's;
                        # the dict gets them only where it is read.
                        patch, in_bytes = envelope.terminal_event(event, payload)
                        if exchange.idempotency_key is not None:  # (the retries' answer)
                            patch.merge(response)
                    else:
                        patch = envelope.complete(response, final=final)
            if kind in TERMINAL_EVENTS:
                payload = payload if payload is not None else loads_or_none(event.data)
                if isinstance(payload, dict):  # its items as the backend gave them
                    exchange.finish(payload.get("response"), in_bytes and in_bytes[0], patch)
                    terminal = len(batch)
            if patch is not None and not exchange.pending_raw and not (in_bytes and in_bytes[1]):
                event = written_event(event, payload, patch)
            last = kind
            batch.append(event)
        if terminal >= 0:
            try:
                await exchange.commit()
            except OcxError:
                if terminal:
                    yield batch[:terminal]
                raise
        if batch:
            yield batch
        if not chunk:
            if last not in FINAL_EVENTS:
                raise UpstreamError("The backend's stream ended before the response finished.")
            return
