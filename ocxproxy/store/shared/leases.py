"""A conversation's lease on the shared store (store/shared/conversations.py's keys).

Its TTL on the server is short (HEARTBEAT, or --read-timeout when shorter) and a task
renews it every third of that while the holder lives, up to the lease's own end: the
holder's last sign of progress plus --read-timeout (`renew`, a local update per chunk from
the backend, as on one node). So a live turn keeps its conversation as long as its backend
makes progress, and a replica killed mid-turn holds it no longer than HEARTBEAT.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from ocxproxy.aio import spawn
from ocxproxy.errors import OcxError, StoreFailure
from ocxproxy.store.shared.conversations import SharedConversations

HEARTBEAT = 10.0  # seconds: the longest a dead replica holds a lease or an in-flight key


def ttl_of(duration: float) -> float:
    """A lease's (or in-flight key's) TTL on the server."""
    return min(HEARTBEAT, duration)


@dataclass(slots=True)
class SharedLease:
    """Released by compare-and-delete (a lapsed one taken by another holder stays theirs);
    when a renewal or release fails, it lapses by itself."""

    shared: SharedConversations
    scope: str
    conversation_id: str
    token: str | None
    duration: float
    expires: float  # monotonic: the lease's own end, which `renew` moves
    beat: asyncio.Task[None] | None = None

    @classmethod
    async def acquire(
        cls, shared: SharedConversations, scope: str, conversation_id: str, duration: float
    ) -> SharedLease | None:
        """The lease, or None while another holder's is live."""
        token = await shared.acquire(scope, conversation_id, ttl_of(duration))
        return None if token is None else cls.held(shared, scope, conversation_id, token, duration)

    @classmethod
    def held(
        cls, shared: SharedConversations, scope: str, conversation_id: str, token: str,
        duration: float,
    ) -> SharedLease:  # fmt: skip
        """The lease `token` took (with `ttl_of(duration)`), renewed from now on."""
        lease = cls(shared, scope, conversation_id, token, duration, time.monotonic() + duration)
        lease.beat = spawn(lease._beat(ttl_of(duration)), name="conversation-lease")
        return lease

    def renew(self) -> None:
        self.expires = time.monotonic() + self.duration

    async def _beat(self, ttl: float) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            left = self.expires - time.monotonic()
            if self.token is None or left <= 0:
                return  # it lapses on the server by itself
            renewal = self.shared.renew(
                self.scope, self.conversation_id, self.token, min(ttl, left)
            )
            await quietly(renewal)

    def stop(self) -> None:
        """The token is spent (an append released it): no more renewals."""
        self.token = None
        if self.beat is not None:
            self.beat.cancel()
            self.beat = None

    def release(self) -> None:
        """In the background (from code that cannot wait)."""
        if self.token is not None:
            spawn(self.let_go(), name="conversation-lease")

    async def let_go(self) -> None:
        """Before the answer: the next request, on any replica, finds it free."""
        token = self.token
        self.stop()
        if token is not None:
            await quietly(self.shared.release(self.scope, self.conversation_id, token))


async def quietly(call: Awaitable[Any]) -> None:
    """A renewal or release in the background: when it fails, the key lapses by itself."""
    with contextlib.suppress(OcxError, StoreFailure):
        await call
