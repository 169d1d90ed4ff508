"""One run per Idempotency-Key in process memory (`InFlight`), and the key's derived id
and errors. (A conversation's lock is the store's: store/lease.py.)"""

from __future__ import annotations

import hashlib

from ocxproxy.errors import Conflict, Unprocessable


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
