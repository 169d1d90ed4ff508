"""A conversation's lock, a lease, written once for both stores over two primitives each
provides (as aiocache's RedLock is written over add and delete-with-token):

- `Slots.hold(key, token, ttl)`: `token` holds `key` for `ttl` seconds from now, taken
  when it is free (or lapsed), extended when `token` holds it already; False while
  another token's is live;
- `Slots.drop(key, token)`: let it go when `token` holds it (compare-and-delete: a lapsed
  lease another holder took stays theirs).

local/conversations.py's slots are in process memory (a crashed process holds nothing
after a restart), shared/conversations.py's on the server, in its memory only.

A lease's TTL in its slot is short (`HEARTBEAT`, or the lease's duration when shorter)
and a task renews it every third of that while the holder lives, up to the lease's own
end: the holder's last sign of progress plus its duration (`renew`, a local update per
chunk from the backend). So a live turn keeps its conversation as long as its backend
makes progress; a holder that vanished (a task that never released, a killed replica)
holds it no longer than that, and a killed replica's lapses within `HEARTBEAT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from ocxproxy.aio import spawn
from ocxproxy.errors import ConversationLocked, OcxError, StoreFailure

HEARTBEAT = 10.0  # seconds: the longest a dead replica holds a lease or an in-flight key


class Slots(Protocol):
    """The two primitives. Each returns an awaitable of its outcome; slots in process
    memory do the work in the call itself (a release from code that cannot wait takes
    effect at once) and return it done."""

    def hold(self, key: str, token: str, ttl: float) -> Awaitable[bool]: ...

    def drop(self, key: str, token: str) -> Awaitable[None]: ...


def ttl_of(duration: float) -> float:
    """A lease's (or an in-flight key's) TTL in its slot."""
    return min(HEARTBEAT, duration)


def new_token() -> str:
    return secrets.token_hex(12)


@dataclass(slots=True)
class Lease:
    """A held lease: renewed in the background up to its own end, released by
    compare-and-delete; when a renewal or release fails, it lapses by itself."""

    slots: Slots
    key: str
    token: str | None
    duration: float
    expires: float  # monotonic: the lease's own end, which `renew` moves
    beat: asyncio.Task[None] | None = None

    @classmethod
    async def take(cls, slots: Slots, key: str, duration: float) -> Lease | None:
        """The lease, or None while another holder's is live."""
        token = new_token()
        if not await slots.hold(key, token, ttl_of(duration)):
            return None
        return cls.held(slots, key, token, duration)

    @classmethod
    def held(cls, slots: Slots, key: str, token: str, duration: float) -> Lease:
        """The lease `token` took (with `ttl_of(duration)`), renewed from now on."""
        lease = cls(slots, key, token, duration, time.monotonic() + duration)
        lease.beat = spawn(lease._beat(ttl_of(duration)), name="conversation-lease")
        return lease

    def renew(self) -> None:
        """The holder made progress: the lease lasts `duration` from now."""
        self.expires = time.monotonic() + self.duration

    async def _beat(self, ttl: float) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            left = self.expires - time.monotonic()
            if self.token is None or left <= 0:
                return  # it lapses in its slot by itself
            await quietly(self.slots.hold(self.key, self.token, min(ttl, left)))

    def stop(self) -> None:
        """The token is spent (released, or by a write that released it): no more
        renewals."""
        self.token = None
        if self.beat is not None:
            self.beat.cancel()
            self.beat = None

    def release(self) -> None:
        """Let it go from code that cannot wait (idempotent): at once in process memory,
        in the background on a server."""
        token = self.token
        self.stop()
        if token is not None:
            dropping = self.slots.drop(self.key, token)
            if not (isinstance(dropping, asyncio.Future) and dropping.done()):
                spawn(quietly(dropping), name="conversation-lease")

    async def let_go(self) -> None:
        """Let it go before the answer: the next request finds it free."""
        token = self.token
        self.stop()
        if token is not None:
            await quietly(self.slots.drop(self.key, token))


@contextlib.asynccontextmanager
async def holding(slots: Slots, key: str, duration: float) -> AsyncIterator[None]:
    """The lease around a write (ConversationLocked while another holds it), let go
    before the answer."""
    lease = await Lease.take(slots, key, duration)
    if lease is None:
        raise ConversationLocked()
    try:
        yield
    finally:
        await lease.let_go()


async def quietly(call: Awaitable[Any]) -> None:
    """A renewal or release in the background: when it fails, the slot lapses by itself."""
    with contextlib.suppress(OcxError, StoreFailure):
        await call


def done(value: Any) -> asyncio.Future[Any]:
    """An outcome already known, as an awaitable (process memory's slots)."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
