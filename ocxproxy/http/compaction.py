"""Compaction answered by the proxy, over any backend (CONTRACT.md C10).

The create's context is expanded as for any turn (http/exchange.py `prepare_exchange`,
whose body then asks for a summary: continuation/compaction.py `summary_request`); the
backend's own model writes the summary; the client gets one sealed `compaction` item. A
create whose input ends in `compaction_trigger` is remembered like any turn, its output
being that item (`Exchange.summary` is what later turns forward in its place).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from multidict import CIMultiDict

from ocxproxy.aio import spawn
from ocxproxy.continuation.compaction import (
    Injection,
    add_usage,
    binding_calls,
    called_tool,
    compaction_response,
    new_item,
    response_events,
    retained_user_messages,
    sse,
    summarized_items,
    summary_message,
    summary_text,
    usage_of,
    without_tools,
)
from ocxproxy.continuation.expand import expand
from ocxproxy.errors import OcxError, UpstreamError, backend_error
from ocxproxy.http.context import Proxy, Reply
from ocxproxy.http.headers import upstream_headers
from ocxproxy.metrics import Timing
from ocxproxy.upstream.sse import loads_or_none

if TYPE_CHECKING:
    from ocxproxy.http.exchange import Exchange


async def answer(
    exchange: Exchange, headers: Mapping[str, str], path_qs: str, timing: Timing, reply: Reply
) -> None:
    """`POST /v1/responses` whose input ends in a compaction trigger: JSON or SSE."""
    config = exchange.proxy.config
    forwarded = upstream_headers(headers, config, identity=True, request_id=timing.request_id)
    forwarded["Content-Type"] = "application/json"
    response = await compaction_turn(exchange, forwarded, path_qs, timing)
    if exchange.request.stream:
        sse_headers = CIMultiDict(
            {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await reply.start(200, sse_headers)
        await reply.write(sse(response_events(response)))
        await reply.end()
    else:
        json_headers = CIMultiDict({"Content-Type": "application/json"})
        reply.answer(200, json_headers, orjson.dumps(response))


async def compaction_turn(
    exchange: Exchange, forwarded: Mapping[str, str], path_qs: str, timing: Timing
) -> dict[str, Any]:
    """Summarize, seal, remember the turn (durable before it is answered, as any turn):
    the Response, whose output is the one compaction item. `forwarded`: the headers for
    the backend."""
    summary, usage = await summarize(exchange, forwarded, path_qs, timing, route="trigger")
    proxy = exchange.proxy
    item = new_item(seal(exchange, summary))
    exchange.summary = summary_message(summary)
    if exchange.conversation is None:
        retained = retained_user_messages(summarized_items(exchange.body))
        exchange.retained = ([orjson.dumps(message) for message in retained], retained)
    response = compaction_response(
        exchange.request.body, "resp_" + secrets.token_hex(24), int(time.time()), [item], usage
    )
    exchange.envelope.complete(response, final=True)  # and the echoed id or conversation
    exchange.finish(response)
    await exchange.commit()
    proxy.metrics.compactions.labels(route="trigger", outcome="completed").inc()
    if proxy.config.compaction_prewarm and exchange.conversation is None:
        warm = prewarm_body(exchange)
        preferred = exchange.backend.url if exchange.backend is not None else None
        path = responses_path(path_qs)
        spawn(_prewarm(proxy, warm, dict(forwarded), path, preferred), name="compaction prewarm")
    return response


PREWARM_TIMEOUT = 60.0


def prewarm_body(exchange: Exchange) -> bytes:
    """The compacted window as a request of one output token: the turn's instructions
    and tools, the retained user messages, the summary. Sent off the reply path
    (`_prewarm`) to the backend that wrote the summary, so the turn after the compaction
    finds that prefix in its cache."""
    assert exchange.summary is not None
    parts, _ = exchange.retained
    fields = {k: v for k, v in exchange.request.body.items() if k not in _NOT_FOR_PREWARM}
    fields.update(stream=False, store=False, max_output_tokens=1)
    return expand(fields, [], [*parts, exchange.summary])


_NOT_FOR_PREWARM = ("background", "stream_options")


async def _prewarm(
    proxy: Proxy, body: bytes, headers: dict[str, str], path: str, preferred: str | None
) -> None:
    outcome = "backend_error"
    try:
        async with asyncio.timeout(PREWARM_TIMEOUT):
            request = proxy.pool.open(
                "POST", path, headers, body, timing=Timing(), preferred=preferred
            )
            async with request as (_, upstream):
                await upstream.read()
                if upstream.status == 200:
                    outcome = "completed"
    except (OcxError, TimeoutError):
        outcome = "failed"
    proxy.metrics.compaction_prewarms.labels(outcome=outcome).inc()


async def compact_first(
    exchange: Exchange, forwarded: Mapping[str, str], path_qs: str, timing: Timing
) -> None:
    """`context_management`'s threshold passed: summarize the context, then make the
    exchange forward the compacted window (the retained user messages, the summary, the
    calls this turn's tool outputs answer) and this turn's input; the answer carries the
    compaction item first, and the turn is remembered as a chain of its own. `forwarded`:
    the headers for the backend."""
    assert exchange.pending is not None and exchange.tail is not None
    summary_body, history = exchange.pending
    exchange.pending = None
    summary, usage = await summarize(
        exchange, forwarded, path_qs, timing, route="threshold", body=summary_body
    )
    item = new_item(seal(exchange, summary))
    message = summary_message(summary)
    earlier = orjson.loads(b"[" + b",".join(history) + b"]")
    retained = retained_user_messages(earlier)
    calls = binding_calls(earlier, exchange.request.items)
    parts = [*map(orjson.dumps, retained), message, *map(orjson.dumps, calls)]
    # The summary's parsed stand-in carries the item's id: an item_reference to it finds
    # the summary message.
    items = [*retained, {**orjson.loads(message), "id": item["id"]}, *calls]
    exchange.retained = (parts, items)
    exchange.summary = message
    exchange.injection = Injection(item, usage)
    exchange.body = expand(exchange.request.body, [], [*parts, *exchange.tail])
    exchange.proxy.metrics.compactions.labels(route="threshold", outcome="completed").inc()


def seal(exchange: Exchange, summary: str) -> str:
    return exchange.proxy.sealer.seal(
        summary, scope=exchange.scope, model=exchange.request.body.get("model")
    )


async def summarize(
    exchange: Exchange,
    forwarded: Mapping[str, str],
    path_qs: str,
    timing: Timing,
    *,
    route: str,
    body: bytes | None = None,
) -> tuple[str, dict[str, Any]]:
    """Ask the backend for the summary `body` (default: `exchange.body`) requests: its
    text, and the usage. A model that calls a tool instead of writing it (the request
    keeps the turn's tools for the prefix cache, with `tool_choice: "none"`, which some
    backends do not enforce) is asked once more without tools."""
    proxy = exchange.proxy
    metrics = proxy.metrics
    body = exchange.body if body is None else body
    usage: dict[str, Any] | None = None
    try:
        for attempt in range(2):
            response = await _ask(exchange, forwarded, path_qs, timing, body)
            usage = usage_of(response) if usage is None else add_usage(usage, usage_of(response))
            summary = summary_text(response)
            if summary:
                break
            if attempt or not called_tool(response):
                raise UpstreamError("The backend's model wrote no summary text for the compaction.")
            metrics.compaction_retries.labels(route=route).inc()
            body = without_tools(body)
    except OcxError:
        metrics.compactions.labels(route=route, outcome="backend_error").inc()
        raise
    assert usage is not None
    metrics.compaction_summary_tokens.labels(route=route).inc(usage["output_tokens"])
    return summary, usage


async def _ask(
    exchange: Exchange, forwarded: Mapping[str, str], path_qs: str, timing: Timing, body: bytes
) -> Any:
    """The backend's Response to a summary request."""
    async with exchange.proxy.pool.open(
        "POST",
        responses_path(path_qs),
        forwarded,
        body,
        timing=timing,
        affinity_key=exchange.affinity_key,
        preferred=exchange.parent.backend if exchange.parent else None,
    ) as (backend, upstream):
        exchange.backend = backend
        with timing.waiting():
            answer = await upstream.read()
        status = upstream.status
    if status != 200:
        raise backend_failure(status, answer)
    return loads_or_none(answer)


def responses_path(path_qs: str) -> str:
    """The create path beside the route (`…/responses/compact` → `…/responses`)."""
    path = path_qs.partition("?")[0]
    return path.removesuffix("/compact")


def backend_failure(status: int, body: bytes) -> OcxError:
    """A backend's error answer to the summary request, relayed with its status."""
    inner = backend_error(status, body)
    error = OcxError(
        str(inner.get("message") or f"The backend answered {status}."),
        param=inner.get("param") if isinstance(inner.get("param"), str) else None,
        code=inner.get("code") if isinstance(inner.get("code"), str) else None,
        status=status if 400 <= status < 600 else 502,
    )
    if isinstance(inner.get("type"), str):
        error.type = inner["type"]
    return error
