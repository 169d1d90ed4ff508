"""`Idempotency-Key` on `POST /v1/responses` (the IETF idempotency-key draft), per
credential, for 24 hours: the retry of a completed request gets the same response (as
JSON, or as an SSE replay of it), a retry while the first is in flight gets 409 and no
backend call, the same key with another body 422.

A completed key is a record the store keeps (`Store.keep`, id derived from credential and
key) holding the body's fingerprint and the response: it persists like the turn it
answers (store:true), or stays in memory (store:false). Keys in flight are process memory.
Only a response the proxy would remember is kept: a retry of a failed request runs again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from multidict import CIMultiDict

from ocxproxy.continuation.locks import fingerprint, idempotency_record_id, mismatch
from ocxproxy.errors import InvalidRequest, StoreFailure
from ocxproxy.http.context import Proxy, Reply
from ocxproxy.model import Record
from ocxproxy.upstream.sse import encode_event

HEADER = "Idempotency-Key"
TTL = 24 * 3600.0
MAX_KEY = 255


@dataclass(frozen=True, slots=True)
class Key:
    record_id: str
    fingerprint: str
    scope: str


def key_of(headers: Mapping[str, str], scope: str, raw: bytes) -> Key | None:
    value = headers.get(HEADER)
    if value is None:
        return None
    if not value or len(value) > MAX_KEY:
        raise InvalidRequest(f"Invalid '{HEADER}': 1 to {MAX_KEY} characters.", param=HEADER)
    return Key(idempotency_record_id(scope, value), fingerprint(raw), scope)


async def begin(proxy: Proxy, key: Key) -> dict[str, Any] | None:
    """The key is in flight until `end` (a retry meanwhile: 409, or 422 for another
    body); the response a completed request with this key got, to answer again."""
    proxy.in_flight.begin(key.record_id, key.fingerprint)
    try:
        return await _stored(proxy, key)
    except BaseException:
        end(proxy, key)
        raise


def end(proxy: Proxy, key: Key) -> None:
    """Idempotent: when the response is remembered, and again when the request ends."""
    proxy.in_flight.end(key.record_id)


async def _stored(proxy: Proxy, key: Key) -> dict[str, Any] | None:
    """The response a completed request with this key got; 422 for another body."""
    try:
        record = proxy.store.record(key.scope, key.record_id)
        entry = orjson.loads(await proxy.store.response_bytes(record))
    except StoreFailure:
        return None
    if entry["fingerprint"] != key.fingerprint:
        raise mismatch()
    response: dict[str, Any] = entry["response"]
    return response


def complete(proxy: Proxy, key: Key, response: Any | None, *, durable: bool) -> Record | None:
    """The request has its response: a retry from now on gets it (when it is one the
    proxy remembers, else None: a retry runs again). The completed key's record, to
    commit before the answer is acknowledged."""
    end(proxy, key)
    if response is None:
        return None
    entry = orjson.dumps({"fingerprint": key.fingerprint, "response": response})
    now = proxy.store.clock()
    try:
        return proxy.store.keep(
            key.record_id, key.scope, (), entry, created_at=now, expires_at=now + TTL,
            durable=durable,
        )  # fmt: skip
    except StoreFailure:
        proxy.metrics.turns_not_recorded.labels(reason="idempotency_key").inc()
        return None


async def replay(reply: Reply, response: dict[str, Any], *, stream: bool) -> None:
    """The answer to a retry of a completed request: its response, as JSON or SSE."""
    headers = CIMultiDict({"Idempotent-Replayed": "true"})
    if not stream:
        headers["Content-Type"] = "application/json"
        reply.answer(200, headers, orjson.dumps(response))
        return
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    await reply.start(200, headers)
    await reply.write(_replay_stream(response))
    await reply.end()


def _replay_stream(response: dict[str, Any]) -> bytes:
    """A stored response as SSE: its lifecycle and item events (no deltas), then the
    terminal event its status calls for."""
    pending = {**response, "status": "in_progress", "output": []}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": pending}),
        ("response.in_progress", {"response": pending}),
    ]
    for index, item in enumerate(response.get("output") or []):
        events.append(("response.output_item.added", {"output_index": index, "item": item}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    status = response.get("status")
    terminal = "response.incomplete" if status == "incomplete" else "response.completed"
    events.append((terminal, {"response": response}))
    return b"".join(
        encode_event(kind, orjson.dumps({"type": kind, "sequence_number": seq, **fields}))
        for seq, (kind, fields) in enumerate(events)
    )
