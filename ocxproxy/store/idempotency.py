"""`Idempotency-Key`s as both stores hold them: the request's `Key`, and a completed
key's entry (the body's fingerprint and the response).

A completed key is kept 24 hours (`TTL`): on one node a record the store keeps (id
derived from credential and key: no index), persisting like the turn it answers
(store:true) or in memory (store:false); keys in flight are process memory
(local/idempotency.py). With a shared store, a store:true request's key lives on the
server instead (shared/idempotency.py), so every replica answers alike; a store:false
one stays in its replica (its fingerprint is a digest of content that must not leave
the process).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson

from ocxproxy.continuation.locks import mismatch

TTL = 24 * 3600.0


@dataclass(slots=True)
class Key:
    record_id: str
    fingerprint: str
    scope: str
    stored: bool = True  # store:true: on the shared store, when there is one
    # On the shared store: this request's in-flight marker, while it holds the key.
    marker: str = field(default_factory=lambda: secrets.token_hex(8))
    holder: asyncio.Task[None] | None = None  # renews the key while this request runs


def entry_of(key: Key, response: Any) -> bytes:
    return orjson.dumps({"fingerprint": key.fingerprint, "response": response})


def response_of(entry: bytes, key: Key) -> dict[str, Any]:
    """A completed key's response; 422 when it was completed for another body."""
    found = orjson.loads(entry)
    if found["fingerprint"] != key.fingerprint:
        raise mismatch()
    response: dict[str, Any] = found["response"]
    return response
