"""Leases (one writer per conversation) and in-flight Idempotency-Keys."""

from __future__ import annotations

import pytest

from ocxproxy.continuation.locks import InFlight, Leases, idempotency_record_id
from ocxproxy.errors import Conflict, Unprocessable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_holder_at_a_time_until_release() -> None:
    leases = Leases(10.0, Clock())
    first = leases.acquire("conv_a")
    assert first is not None
    assert leases.acquire("conv_a") is None
    assert leases.acquire("conv_b") is not None  # per conversation
    leases.release(first)
    leases.release(first)  # idempotent
    assert leases.acquire("conv_a") is not None


def test_a_lease_that_is_never_released_expires_and_renewal_keeps_it() -> None:
    clock = Clock()
    leases = Leases(10.0, clock)
    held = leases.acquire("conv_a")
    assert held is not None
    clock.now += 9
    assert leases.renew(held) and leases.holds(held)
    clock.now += 9  # 18 s after taking it, 9 after the renewal: still held
    assert leases.acquire("conv_a") is None
    clock.now += 1.5
    assert not leases.holds(held)
    taker = leases.acquire("conv_a")
    assert taker is not None
    assert not leases.renew(held)  # lost: the old holder can neither renew ...
    leases.release(held)  # ... nor free the new holder's lease
    assert leases.acquire("conv_a") is None and leases.holds(taker)


def test_in_flight_keys() -> None:
    running = InFlight()
    running.begin("idem_1", "body-a")
    with pytest.raises(Conflict) as conflict:
        running.begin("idem_1", "body-a")
    assert conflict.value.status == 409
    with pytest.raises(Unprocessable) as other:
        running.begin("idem_1", "body-b")
    assert other.value.status == 422
    running.end("idem_1")
    running.begin("idem_1", "body-b")
    assert len(running) == 1


def test_record_ids_are_scoped() -> None:
    a = idempotency_record_id("scope-a", "key")
    assert a == idempotency_record_id("scope-a", "key")
    assert a != idempotency_record_id("scope-b", "key") and a.startswith("idem_")
