"""One writer per conversation, and one run per Idempotency-Key: process memory.

On a single node a crashed process holds nothing after a restart; within a process a
lock is a lease, so a holder that never released it (a bug, a task that vanished)
cannot keep a conversation locked for longer than the lease. A live holder renews it as
the backend's bytes arrive.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from ocxproxy.errors import Conflict, Unprocessable


@dataclass(slots=True)
class Lease:
    key: str
    token: int
    expires_at: float


class Leases:
    """Exclusive leases by key (a conversation id)."""

    def __init__(self, duration: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.duration = duration
        self.clock = clock
        self._held: dict[str, Lease] = {}
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        return len(self._held)

    def acquire(self, key: str) -> Lease | None:
        """A new lease on `key`, or None while another one is live."""
        now = self.clock()
        held = self._held.get(key)
        if held is not None and held.expires_at > now:
            return None
        lease = Lease(key, next(self._tokens), now + self.duration)
        self._held[key] = lease
        return lease

    def renew(self, lease: Lease) -> bool:
        """Extend a live lease; False when it was lost (expired and taken, or released)."""
        if self._held.get(lease.key) is not lease:
            return False
        lease.expires_at = self.clock() + self.duration
        return True

    def holds(self, lease: Lease) -> bool:
        return self._held.get(lease.key) is lease and lease.expires_at > self.clock()

    def release(self, lease: Lease) -> None:
        """Idempotent; a lease that expired and was taken by another holder stays theirs."""
        if self._held.get(lease.key) is lease:
            del self._held[lease.key]


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def idempotency_record_id(scope: str, key: str) -> str:
    """The store's id for a completed Idempotency-Key: derived, so it needs no index."""
    return "idem_" + hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()[:48]


class InFlight:
    """Idempotency-Keys whose first request is still running: a retry meanwhile gets 409
    (and no second backend call); a different body under the same key gets 422."""

    def __init__(self) -> None:
        self._running: dict[str, str] = {}  # record id -> body fingerprint

    def __len__(self) -> int:
        return len(self._running)

    def begin(self, record_id: str, body_fingerprint: str) -> None:
        running = self._running.get(record_id)
        if running is not None:
            if running != body_fingerprint:
                raise mismatch()
            raise in_progress()
        self._running[record_id] = body_fingerprint

    def end(self, record_id: str) -> None:
        self._running.pop(record_id, None)


def in_progress() -> Conflict:
    return Conflict(
        "A request with this Idempotency-Key is still in progress; retry later.",
        param="Idempotency-Key",
    )


def mismatch() -> Unprocessable:
    return Unprocessable(
        "This Idempotency-Key was used with a different request body.",
        param="Idempotency-Key",
    )
