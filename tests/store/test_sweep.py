"""The expiry sweep works in short steps of the event loop.

Counted, not timed: the sweep dropped every expired record of 100,000 in one step (20-34
ms of the loop under `serve` with churn). Another task that runs between its steps counts
the drops each step made; what the sweep leaves for later still fails as expired.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.model import Segment
from ocxproxy.store.local.expiry import SWEEP_DROPS
from ocxproxy.store.records import CHUNK
from tests.store.helpers import Clock, inline, make_store, make_turn, sample

N = 10_000


async def test_a_sweep_drops_a_few_records_a_step_and_the_rest_still_fail_as_expired(
    tmp_path: Path,
) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock=clock, ttl=10, max_entries=2 * N, offload=inline)
    await store.start()
    for i in range(N):
        store.put(make_turn(f"r{i}", f"u{i}"), None)
    conv = store.kept.keep(
        "conv_a", "scope-a", (Segment(b"", 0, (), durable=False),), b"{}", created_at=clock.now
    )
    clock.now += 5
    store.put(make_turn("fresh", "u"), None)  # later: not expired yet
    await store.commit()
    clock.now += 6
    gone: list[int] = []  # after each step of the sweep: how many went so far
    failures: list[FailureReason] = []

    async def between_steps() -> None:
        while True:
            gone.append(N + 2 - len(store))
            if len(gone) == 2:  # the newest expired record is not swept yet: it fails
                with pytest.raises(StoreFailure) as info:
                    store.lookup_nowait("scope-a", f"r{N - 1}")
                failures.append(info.value.reason)
            await asyncio.sleep(0)

    watcher = spawn(between_steps(), name="between-steps")
    await asyncio.sleep(0)
    dropped = await store.sweep()
    await cancel_and_wait(watcher)
    assert dropped == N - 1  # r{N-1} went at its lookup
    assert failures == [FailureReason.EXPIRED]
    steps = [b - a for a, b in itertools.pairwise(gone)]
    assert max(steps) <= SWEEP_DROPS + 1  # (+ the lookup's)
    assert len(steps) >= N // SWEEP_DROPS
    assert [r.id for r in store.records()] == ["conv_a", "fresh"]  # the pinned one stays
    assert store.record("scope-a", "conv_a") is conv
    with pytest.raises(StoreFailure) as info:
        store.lookup_nowait("scope-a", "r0")
    assert info.value.reason == FailureReason.EXPIRED
    assert sample(store.metrics.store_evictions, reason="expired") == N
    assert store.check() == []
    await store.close()
    reopened = make_store(tmp_path, clock=clock, ttl=10, offload=inline)
    await reopened.start()  # the drops were not journaled: replay drops them too
    assert sorted(r.id for r in reopened.records()) == ["conv_a", "fresh"]
    await reopened.close()


async def test_a_sweep_with_nothing_expired_looks_at_a_chunk_a_step() -> None:
    store = make_store(None, max_entries=3 * CHUNK)
    for i in range(3 * CHUNK):
        store.put(make_turn(f"r{i}", f"u{i}", durable=False), None)
    passes = 0

    async def count() -> None:
        nonlocal passes
        while True:
            passes += 1
            await asyncio.sleep(0)

    counter = spawn(count(), name="count")
    await asyncio.sleep(0)
    assert await store.sweep() == 0
    await cancel_and_wait(counter)
    assert passes >= 3  # one step per chunk of the order
    assert len(store) == 3 * CHUNK
