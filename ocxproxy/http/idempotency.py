"""`Idempotency-Key` on `POST /v1/responses` (the IETF idempotency-key draft), per
credential, for 24 hours: the retry of a completed request gets the same response (as
JSON, or as an SSE replay of it), a retry while the first is in flight gets 409 and no
backend call, the same key with another body 422.

The keys are the store's (`Store.idempotency`: store/idempotency.py and each store's
own); here, the header read and the replay of a completed request's response.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from multidict import CIMultiDict

from ocxproxy.continuation.envelope import complete_response
from ocxproxy.continuation.locks import fingerprint, idempotency_record_id
from ocxproxy.errors import InvalidRequest
from ocxproxy.http.context import Proxy, Reply
from ocxproxy.model import Record
from ocxproxy.store import IDEMPOTENCY_TTL as TTL
from ocxproxy.store import IdempotencyKey as Key
from ocxproxy.upstream.sse import encode_event

__all__ = ["TTL", "Key", "begin", "complete", "end", "key_of", "replay"]

HEADER = "Idempotency-Key"
MAX_KEY = 255


def key_of(headers: Mapping[str, str], scope: str, raw: bytes, *, stored: bool) -> Key | None:
    value = headers.get(HEADER)
    if value is None:
        return None
    if not value or len(value) > MAX_KEY:
        raise InvalidRequest(f"Invalid '{HEADER}': 1 to {MAX_KEY} characters.", param=HEADER)
    return Key(idempotency_record_id(scope, value), fingerprint(raw), scope, stored)


async def begin(proxy: Proxy, key: Key) -> dict[str, Any] | None:
    """The key is in flight until `end` (a retry meanwhile: 409, or 422 for another
    body); the response a completed request with this key got, to answer again."""
    return await proxy.store.idempotency.begin(key, proxy.lease_duration)


def end(proxy: Proxy, key: Key) -> None:
    """Idempotent: when the response is remembered, and again when the request ends."""
    proxy.store.idempotency.end(key)


def complete(proxy: Proxy, key: Key, response: Any | None, *, durable: bool) -> Record | None:
    """The request has its response: a retry from now on gets it (when it is one the
    proxy remembers, else None: a retry runs again). The completed key's record, to
    commit before the answer is acknowledged."""
    return proxy.store.idempotency.complete(key, response, durable=durable)


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
    # (`cancelled`: a background response a cancel won against the end of)
    ended = status in ("incomplete", "cancelled")
    terminal = f"response.{status}" if ended else "response.completed"
    events.append((terminal, {"response": response}))
    return b"".join(
        encode_event(kind, orjson.dumps({"type": kind, "sequence_number": seq, **fields}))
        for seq, (kind, fields) in enumerate(events)
    )
