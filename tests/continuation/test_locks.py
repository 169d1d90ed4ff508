"""In-flight Idempotency-Keys and their ids."""

from __future__ import annotations

import pytest

from ocxproxy.continuation.locks import InFlight, idempotency_record_id
from ocxproxy.errors import Conflict, Unprocessable


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
