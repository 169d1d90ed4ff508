"""`Idempotency-Key` on `POST /v1/responses` (the IETF idempotency-key draft), per
credential, for 24 hours: the retry of a completed request gets the same response (as
JSON, or as an SSE replay of it), a retry while the first is in flight gets 409 and no
backend call, the same key with another body 422.

A completed key is a record the store keeps (`Store.keep`, id derived from credential and
key) holding the body's fingerprint and the response: it persists like the turn it
answers (store:true), or stays in memory (store:false). Keys in flight are process memory.
Only a response the proxy would remember is kept: a retry of a failed request runs again.
With a shared store, a store:true request's key lives on the server instead
(store/shared/conversations.py), so every replica answers alike: in flight, a key with a
TTL (renewed while the request runs, so a killed replica's lapses); completed, the
entry, written with the turn. A store:false one stays in its replica (its fingerprint is
a digest of content that must not leave the process).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from multidict import CIMultiDict

from ocxproxy.aio import spawn
from ocxproxy.continuation.envelope import complete_response
from ocxproxy.continuation.locks import fingerprint, idempotency_record_id, in_progress, mismatch
from ocxproxy.errors import InvalidRequest, StoreFailure
from ocxproxy.http.context import Proxy, Reply
from ocxproxy.model import Record
from ocxproxy.store.shared.conversations import (
    SharedConversations,
    shared_conversations,
    staged_write,
)
from ocxproxy.store.shared.leases import quietly, ttl_of
from ocxproxy.upstream.sse import encode_event

HEADER = "Idempotency-Key"
TTL = 24 * 3600.0
MAX_KEY = 255


@dataclass(slots=True)
class Key:
    record_id: str
    fingerprint: str
    scope: str
    stored: bool = True  # store:true: on the shared store, when there is one
    # On the shared store: this request's in-flight marker, while it holds the key.
    marker: str = field(default_factory=lambda: secrets.token_hex(8))
    holder: asyncio.Task[None] | None = None  # renews the key while this request runs


def key_of(headers: Mapping[str, str], scope: str, raw: bytes, *, stored: bool) -> Key | None:
    value = headers.get(HEADER)
    if value is None:
        return None
    if not value or len(value) > MAX_KEY:
        raise InvalidRequest(f"Invalid '{HEADER}': 1 to {MAX_KEY} characters.", param=HEADER)
    return Key(idempotency_record_id(scope, value), fingerprint(raw), scope, stored)


def _shared(proxy: Proxy, key: Key) -> SharedConversations | None:
    return shared_conversations(proxy.store) if key.stored else None


async def begin(proxy: Proxy, key: Key) -> dict[str, Any] | None:
    """The key is in flight until `end` (a retry meanwhile: 409, or 422 for another
    body); the response a completed request with this key got, to answer again."""
    shared = _shared(proxy, key)
    if shared is not None:
        return await _begin_shared(proxy, shared, key)
    proxy.in_flight.begin(key.record_id, key.fingerprint)
    try:
        return await _stored(proxy, key)
    except BaseException:
        end(proxy, key)
        raise


async def _begin_shared(
    proxy: Proxy, shared: SharedConversations, key: Key
) -> dict[str, Any] | None:
    """The same rules on the server, in one round trip: completed (replayed, or 422),
    in flight elsewhere (409, or 422), or now in flight for this request."""
    marker = f"{key.fingerprint}:{key.marker}"
    ttl = ttl_of(proxy.leases.duration)
    state, value = await shared.idempotency_begin(key.scope, key.record_id, marker, ttl)
    if state == 0:
        key.holder = spawn(_hold(shared, key, ttl), name="idempotency-key")
        return None
    if state == 1:
        return _response_of(value, key)
    other = value.decode().partition(":")[0]
    if other and other != key.fingerprint:
        raise mismatch()
    raise in_progress()


async def _hold(shared: SharedConversations, key: Key, ttl: float) -> None:
    """While the request runs, its in-flight key stays (renewed every third of its TTL):
    a replica that dies stops renewing, and the key lapses."""
    marker = f"{key.fingerprint}:{key.marker}"
    while True:
        await asyncio.sleep(ttl / 3)
        await quietly(shared.idempotency_hold(key.scope, key.record_id, marker, ttl))


def end(proxy: Proxy, key: Key) -> None:
    """Idempotent: when the response is remembered, and again when the request ends."""
    shared = _shared(proxy, key)
    if shared is None:
        proxy.in_flight.end(key.record_id)
    elif key.holder is not None:
        key.holder.cancel()
        key.holder = None
        marker = f"{key.fingerprint}:{key.marker}"
        spawn(quietly(shared.idempotency_hold(key.scope, key.record_id, marker, None)), name="idem")


async def _stored(proxy: Proxy, key: Key) -> dict[str, Any] | None:
    """The response a completed request with this key got; 422 for another body."""
    try:
        record = proxy.store.record(key.scope, key.record_id)
        return _response_of(await proxy.store.response_bytes(record), key)
    except StoreFailure:
        return None


def _response_of(entry: bytes, key: Key) -> dict[str, Any]:
    """A completed key's response; 422 when it was completed for another body."""
    found = orjson.loads(entry)
    if found["fingerprint"] != key.fingerprint:
        raise mismatch()
    response: dict[str, Any] = found["response"]
    return response


def complete(proxy: Proxy, key: Key, response: Any | None, *, durable: bool) -> Record | None:
    """The request has its response: a retry from now on gets it (when it is one the
    proxy remembers, else None: a retry runs again). The completed key's record, to
    commit before the answer is acknowledged (on a shared store, a staged write that
    also lets the in-flight key go)."""
    shared = _shared(proxy, key)
    if shared is None or response is None or not durable:
        end(proxy, key)
    if response is None:
        return None
    entry = orjson.dumps({"fingerprint": key.fingerprint, "response": response})
    if shared is not None and durable:
        marker = f"{key.fingerprint}:{key.marker}"

        async def write() -> None:
            await shared.idempotency_done(key.scope, key.record_id, marker, entry, TTL)
            if key.holder is not None:
                key.holder.cancel()
                key.holder = None

        return staged_write(key.record_id, key.scope, write)
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
    complete_response(response)  # kept complete; one kept before that was too
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
    pending = {**response, "status": "in_progress", "output": [], "completed_at": None}
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
