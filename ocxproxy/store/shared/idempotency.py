"""Idempotency-Keys on the shared store: a store:true request's key on the server
(conversations.py's keys), so every replica answers alike: in flight, a key with a TTL
(renewed while the request runs, so a killed replica's lapses); completed, the entry,
written with the turn. A store:false request's key stays in this replica (`local`)."""

from __future__ import annotations

import asyncio
from typing import Any

from ocxproxy.aio import spawn
from ocxproxy.continuation.locks import in_progress, mismatch
from ocxproxy.errors import FailureReason, StorageUnavailable, StoreFailure
from ocxproxy.model import Record
from ocxproxy.store.idempotency import TTL, Key, ProcessKeys, entry_of, response_of
from ocxproxy.store.lease import quietly, ttl_of
from ocxproxy.store.shared.conversations import SharedConversations, staged_write


def _marker(key: Key) -> str:
    return f"{key.fingerprint}:{key.marker}"


class ServerKeys:
    """Store:true keys on the server, store:false ones in `local`."""

    def __init__(self, server: SharedConversations, local: ProcessKeys) -> None:
        self.server = server
        self.local = local

    async def begin(self, key: Key, duration: float) -> dict[str, Any] | None:
        """The same rules as on one node, in one round trip: completed (replayed, or
        422), in flight elsewhere (409, or 422), or now in flight for this request."""
        if not key.stored:
            return await self.local.begin(key, duration)
        ttl = ttl_of(duration)
        state, value = await self.server.idempotency_begin(
            key.scope, key.record_id, _marker(key), ttl
        )
        if state == 0:
            key.holder = spawn(self._hold(key, ttl), name="idempotency-key")
            return None
        if state == 1:
            return response_of(value, key)
        other = value.decode().partition(":")[0]
        if other and other != key.fingerprint:
            raise mismatch()
        raise in_progress()

    async def _hold(self, key: Key, ttl: float) -> None:
        """While the request runs, its in-flight key stays (renewed every third of its
        TTL): a replica that dies stops renewing, and the key lapses."""
        while True:
            await asyncio.sleep(ttl / 3)
            await quietly(self.server.idempotency_hold(key.scope, key.record_id, _marker(key), ttl))

    def end(self, key: Key) -> None:
        """Idempotent: when the response is remembered, and again when the request ends."""
        if not key.stored:
            self.local.end(key)
        elif key.holder is not None:
            key.holder.cancel()
            key.holder = None
            release = self.server.idempotency_hold(key.scope, key.record_id, _marker(key), None)
            spawn(quietly(release), name="idem")

    def complete(self, key: Key, response: Any | None, *, durable: bool) -> Record | None:
        """The completed key: a staged write that also lets the in-flight key go (a
        durable response), else kept in this replica."""
        if not key.stored:
            return self.local.complete(key, response, durable=durable)
        if response is None or not durable:
            self.end(key)
        if response is None:
            return None
        if not durable:
            return self.local.keep(key, response, durable=False)
        entry = entry_of(key, response)

        async def write() -> None:
            try:
                await self.server.idempotency_done(
                    key.scope, key.record_id, _marker(key), entry, TTL
                )
            except StorageUnavailable:  # (its response is stored by now: a failed commit)
                raise StoreFailure(FailureReason.WRITE_FAILED, "shared store unavailable") from None
            if key.holder is not None:
                key.holder.cancel()
                key.holder = None

        return staged_write(key.record_id, key.scope, write)
