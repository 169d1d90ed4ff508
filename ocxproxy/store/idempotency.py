"""`Idempotency-Key`s as both stores hold them: the request's `Key`, and a completed
key's entry (the body's fingerprint and the response).

A completed key is kept 24 hours (`TTL`): on one node a record the store keeps (id
derived from credential and key: no index), persisting like the turn it answers
(store:true) or in memory (store:false); keys in flight are process memory
(`ProcessKeys`, the single-node store's). With a shared store, a store:true request's
key lives on the server instead (shared/idempotency.py), so every replica answers alike;
a store:false one stays in its replica, in `ProcessKeys` over the memory-only store the
shared store holds (its fingerprint is a digest of content that must not leave the
process).
"""

from __future__ import annotations

import asyncio
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Any

import orjson

from ocxproxy.continuation.locks import InFlight, mismatch
from ocxproxy.errors import StoreFailure
from ocxproxy.model import Record
from ocxproxy.store.process import ProcessStore

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


class ProcessKeys:
    """Idempotency-Keys in a process: running ones in memory (continuation/locks.py's
    `InFlight`), completed ones as records `store` keeps."""

    def __init__(self, store: ProcessStore) -> None:
        # A weak reference: the store owns this, and a cycle would keep a connection's
        # memory-only store alive until the garbage collector's next pass.
        self.store: ProcessStore = weakref.proxy(store)
        self.in_flight = InFlight()

    async def begin(self, key: Key, duration: float) -> dict[str, Any] | None:
        """The key is in flight until `end` (a retry meanwhile: 409, or 422 for another
        body); the response a completed request with this key got, to answer again."""
        self.in_flight.begin(key.record_id, key.fingerprint)
        try:
            return await self._stored(key)
        except BaseException:
            self.end(key)
            raise

    def end(self, key: Key) -> None:
        """Idempotent: when the response is remembered, and again when the request ends."""
        self.in_flight.end(key.record_id)

    def complete(self, key: Key, response: Any | None, *, durable: bool) -> Record | None:
        """The request has its response: the completed key's record, to commit before
        the answer is acknowledged (None when there is no response to keep)."""
        self.end(key)
        return None if response is None else self.keep(key, response, durable=durable)

    def keep(self, key: Key, response: Any, *, durable: bool) -> Record | None:
        store = self.store
        now = store.clock()
        try:
            return store.kept.keep(
                key.record_id, key.scope, (), entry_of(key, response), created_at=now,
                expires_at=now + TTL, durable=durable,
            )  # fmt: skip
        except StoreFailure:
            store.metrics.turns_not_recorded.labels(reason="idempotency_key").inc()
            return None

    async def _stored(self, key: Key) -> dict[str, Any] | None:
        """The response a completed request with this key got; 422 for another body."""
        try:
            record = self.store.record(key.scope, key.record_id)
            return response_of(await self.store.response_bytes(record), key)
        except StoreFailure:
            return None
