"""Idempotency-Keys on the single-node store: in flight in process memory
(continuation/locks.py's `InFlight`), completed as records the store keeps."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ocxproxy.continuation.locks import InFlight
from ocxproxy.errors import StoreFailure
from ocxproxy.model import Record
from ocxproxy.store.idempotency import TTL, Key, entry_of, response_of

if TYPE_CHECKING:
    from ocxproxy.store.local.store import Store


class LocalKeys:
    """The Idempotency-Keys a Store holds: running ones, and completed ones as records."""

    def __init__(self, store: Store) -> None:
        # A weak reference: the store owns this, and a cycle would keep a connection's
        # memory-only store alive until the garbage collector's next pass.
        self.store: Store = weakref.proxy(store)
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
