"""The `/v1/responses` routes on aiohttp: create (the turn itself is http/exchange.py's),
its siblings `input_tokens` and `compact` (served here: CONTRACT.md C10), and the stored
responses (CONTRACT.md C2)."""

from __future__ import annotations

import asyncio
import secrets
import time

import orjson
from aiohttp import web
from multidict import CIMultiDict

from ocxproxy.continuation.compaction import (
    TRIGGER,
    compacted,
    new_item,
    retained_user_messages,
    summarized_items,
    window_message,
)
from ocxproxy.continuation.envelope import complete_stored
from ocxproxy.continuation.expand import check_request
from ocxproxy.continuation.listing import includes_of, input_item_views, page, parse_list_query
from ocxproxy.continuation.references import references
from ocxproxy.errors import (
    FailureReason,
    InvalidRequest,
    NotFound,
    StorageUnavailable,
    StoreFailure,
)
from ocxproxy.http import background
from ocxproxy.http.body import read_body
from ocxproxy.http.compaction import seal, summarize
from ocxproxy.http.context import Proxy, proxy_of, scope_of, timing_of, upstream_path
from ocxproxy.http.exchange import create, open_upstream, prepare_exchange
from ocxproxy.http.headers import client_headers, upstream_headers
from ocxproxy.http.passthrough import passthrough
from ocxproxy.model import Record
from ocxproxy.store import STORED, Job
from ocxproxy.upstream.sse import Event, loads_or_none, wire


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

    async def write_events(self, events: list[Event]) -> None:
        await self.write(b"".join(wire(events, False)))

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


async def create_response(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    raw = await read_body(request, proxy.config.max_body_bytes)
    reply = WebReply(request)
    await create(proxy, request.headers, upstream_path(request), raw, timing_of(request), reply)
    assert reply.response is not None
    return reply.response


async def create_sibling(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses/input_tokens` takes `previous_response_id`, `conversation` and
    item references too: they are expanded and resolved the same way (the backend counts
    the whole chain or conversation), and nothing is remembered (a conversation is read
    without its lock). Without any of them, the body passes unchanged."""
    proxy = proxy_of(request)
    raw = await read_body(request, proxy.config.max_body_bytes)
    parsed = loads_or_none(raw)
    if not isinstance(parsed, dict) or (
        parsed.get("previous_response_id") is None
        and parsed.get("conversation") is None
        and not (isinstance(parsed.get("input"), list) and references(parsed["input"]))
    ):
        return await passthrough(request, body=raw)
    scope = scope_of(request.headers)
    exchange = await prepare_exchange(proxy, scope, check_request(parsed), raw, remember=False)
    timing = timing_of(request)
    timing.exchange = exchange
    headers = upstream_headers(
        request.headers, proxy.config, identity=False, request_id=timing.request_id
    )
    headers["Content-Type"] = "application/json"
    async with open_upstream(exchange, upstream_path(request), headers, timing) as (_, upstream):
        with timing.waiting():
            body = await upstream.read()
        return web.Response(
            body=body,
            status=upstream.status,
            headers=client_headers(upstream.headers, body_rewritten=False),
        )


async def compact_response(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses/compact`, answered by the proxy whatever the backend (CONTRACT.md
    C10): the context (input, previous_response_id, conversation, item references) is
    expanded as for a create, the backend's model summarizes it, and the answer is the
    compacted window: the newest user messages, then one sealed compaction item. Nothing
    is remembered."""
    proxy = proxy_of(request)
    raw = await read_body(request, proxy.config.max_body_bytes)
    parsed = loads_or_none(raw)
    if not isinstance(parsed, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("Missing required parameter: 'model'.", param="model")
    items = check_request(parsed).items
    if items and isinstance(items[-1], dict) and items[-1].get("type") == TRIGGER:
        items = items[:-1]
    body = {**parsed, "input": [*items, {"type": TRIGGER}]}
    scope = scope_of(request.headers)
    exchange = await prepare_exchange(proxy, scope, check_request(body), None, remember=False)
    timing = timing_of(request)
    timing.exchange = exchange
    headers = upstream_headers(
        request.headers, proxy.config, identity=True, request_id=timing.request_id
    )
    headers["Content-Type"] = "application/json"
    summary, usage = await summarize(
        exchange, headers, upstream_path(request), timing, route="compact"
    )
    output = [
        *map(window_message, retained_user_messages(summarized_items(exchange.body))),
        new_item(seal(exchange, summary)),
    ]
    proxy.metrics.compactions.labels(route="compact", outcome="completed").inc()
    answer = compacted("resp_" + secrets.token_hex(24), int(time.time()), output, usage)
    return web.json_response(answer, dumps=lambda obj: orjson.dumps(obj).decode())


# -- stored responses (CONTRACT.md C2) ---------------------------------------------------


async def _lookup(proxy: Proxy, request: web.Request) -> Record | None:
    """The caller's stored response, else NotFound: these routes are the proxy's, never the
    backend's. None only with --forward-unknown-ids, for an id the proxy does not know (the
    backend may): the caller forwards the request. A store:false turn kept in memory for
    chaining is not retrievable (as on OpenAI). A turn kept after its chain went while it
    ran is (the store's `retrieve`): its Response is stored, its history is not."""
    response_id = request.match_info["response_id"]
    try:
        record = await proxy.store.retrieve(scope_of(request.headers), response_id)
    except StoreFailure as failure:
        if proxy.config.forward_unknown_ids and failure.reason == FailureReason.UNKNOWN:
            return None
        raise _not_found(response_id) from None
    if not record.stored:
        raise _not_found(response_id)
    return record


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.")


async def _job(proxy: Proxy, request: web.Request) -> Job | None:
    """The caller's background response of that id, while it is kept as one."""
    return await proxy.backgrounds.get(scope_of(request.headers), request.match_info["response_id"])


async def get_response(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    if _truthy(request.query.get("stream")):
        return await _stream_again(proxy, request)
    job = await _job(proxy, request)
    if job is not None and (not job.terminal or job.status == "cancelled"):
        # (a cancelled one keeps nothing: a turn its run stored meanwhile is being deleted)
        return web.Response(body=job.response, content_type="application/json")
    try:  # an ended one the store keeps is the store's, as any (one lost by a restart too)
        record = await _lookup(proxy, request)
    except NotFound:
        record = None
        if job is None:
            raise
    if record is None:
        if job is not None:
            return web.Response(body=job.response, content_type="application/json")
        return await passthrough(request)
    try:
        body = await proxy.store.response_bytes(record)
    except StoreFailure:
        raise _not_found(record.id) from None
    return web.Response(body=complete_stored(body), content_type="application/json")


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1")


async def _stream_again(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`GET /v1/responses/{id}?stream=true[&starting_after=N]`: a background response's
    events after N (all of them without), then each as it comes, to the end."""
    text = request.query.get("starting_after")
    after = -1
    if text is not None:
        try:
            after = int(text)
        except ValueError:
            raise InvalidRequest(
                "Invalid 'starting_after': expected an integer.", param="starting_after"
            ) from None
    job = await _job(proxy, request)
    if job is None or not job.stream:
        if job is None:
            await _lookup(proxy, request)  # an unknown id is a 404
        raise InvalidRequest(
            "This response cannot be streamed: only a response created with "
            "background=true and stream=true can be, while its events are kept (at "
            "least 10 minutes after it ends); retrieve it without stream.",
            param="stream",
        )
    if job.log is None:
        raise InvalidRequest(
            "This response's events are no longer kept (they are kept at least 10 "
            "minutes after it ends); retrieve it without stream.",
            param="stream",
        )
    proxy.metrics.background_resumes.inc()
    reply = WebReply(request)
    await reply.start(200, CIMultiDict(background.SSE_HEADERS))
    await background.follow(job, reply, after)
    assert reply.response is not None
    return reply.response


async def delete_response(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    response_id = request.match_info["response_id"]
    job = await _job(proxy, request)
    if job is not None:  # a queued or running one is cancelled, then deleted
        await background.delete(proxy, job)
    await background.keep_inputs_past(proxy, scope_of(request.headers), response_id)
    deleted = await proxy.store.delete(scope_of(request.headers), response_id)
    if not deleted and job is None:
        if proxy.config.forward_unknown_ids:
            return await passthrough(request)
        raise _not_found(response_id)
    try:
        await proxy.store.commit()  # ack mode: the delete is durable before it is answered
    except StoreFailure:
        raise StorageUnavailable(
            "The delete could not be stored: the proxy's storage is unavailable. Retry later."
        ) from None
    if proxy.kv_saves is not None:  # a KV save only it reached goes too
        proxy.kv_saves.forget(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.StreamResponse:
    """Only a response created with `background: true` can be cancelled (as on OpenAI):
    a running one is cancelled, an ended one answered as it is (CONTRACT.md C11); any
    other stored response is a 400, and an unknown id a 404."""
    proxy = proxy_of(request)
    job = await _job(proxy, request)
    if job is not None:
        body = await background.cancel(proxy, job)
        return web.Response(body=body, content_type="application/json")
    record = await _lookup(proxy, request)
    if record is None:
        return await passthrough(request)
    try:  # a background response that ended and is kept as any stored one: as it is
        body = complete_stored(await proxy.store.response_bytes(record))
    except StoreFailure:
        raise _not_found(record.id) from None
    if loads_or_none(body).get("background") is not True:
        raise InvalidRequest("Only responses created with background=true can be cancelled.")
    return web.Response(body=body, content_type="application/json")


async def list_input_items(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    query = parse_list_query(request.query, includes_of(request.query))
    job = await _job(proxy, request)
    # A background response whose turn the store does not hold (queued, running, failed,
    # cancelled): the input it was created with.
    kept = (
        await proxy.backgrounds.inputs(job)
        if job is not None and job.status not in STORED
        else None
    )
    if kept is not None:
        assert job is not None
        history = await background.input_history(proxy, job, kept)
        response_id, n_output = request.match_info["response_id"], 0
    else:
        record = await _lookup(proxy, request)
        if record is None:
            return await passthrough(request)
        try:
            history = await proxy.store.history(record)
            stored = orjson.loads(await proxy.store.response_bytes(record))
        except StoreFailure as failure:
            if failure.reason == FailureReason.EVICTED:
                raise NotFound(
                    f"The input items of response '{record.id}' are no longer stored: the "
                    "stored history it continues was evicted."
                ) from None
            raise _not_found(record.id) from None
        response_id, n_output = record.id, len(stored.get("output", []))
    views = await asyncio.to_thread(input_item_views, response_id, history, n_output, query.include)
    return web.json_response(page(views, query), dumps=lambda obj: orjson.dumps(obj).decode())
