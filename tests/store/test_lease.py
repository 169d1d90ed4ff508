"""The lease (store/lease.py) over process memory's slots (local/conversations.py's
`MemorySlots`), on a clock the test moves: one holder at a time, taken again once it
lapsed, renewed by its token only, released by its token only. The same lease over the
server's slots: tests/store/test_store_contract.py's lock tests run on every store."""

from __future__ import annotations

import asyncio

from ocxproxy.store.lease import HEARTBEAT, Lease, ttl_of
from ocxproxy.store.local.conversations import MemorySlots


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_one_holder_at_a_time_until_it_lets_go() -> None:
    slots = MemorySlots(Clock())
    assert await slots.hold("conv_a", "first", 10.0)
    assert not await slots.hold("conv_a", "second", 10.0)
    assert await slots.hold("conv_b", "second", 10.0)  # per conversation
    await slots.drop("conv_a", "second")  # not the holder's token: nothing
    assert not await slots.hold("conv_a", "second", 10.0)
    await slots.drop("conv_a", "first")
    await slots.drop("conv_a", "first")  # idempotent
    assert await slots.hold("conv_a", "second", 10.0)


async def test_a_lapsed_slot_is_taken_and_the_old_token_can_neither_renew_nor_free_it() -> None:
    clock = Clock()
    slots = MemorySlots(clock)
    assert await slots.hold("conv_a", "old", 10.0)
    clock.now += 9
    assert await slots.hold("conv_a", "old", 10.0)  # renewed: 10 s from now
    clock.now += 9
    assert not await slots.hold("conv_a", "new", 10.0)
    clock.now += 1.5
    assert await slots.hold("conv_a", "new", 10.0)  # lapsed: taken
    assert not await slots.hold("conv_a", "old", 10.0)  # the old holder cannot renew ...
    await slots.drop("conv_a", "old")  # ... nor free the new holder's
    assert not await slots.hold("conv_a", "other", 10.0) and len(slots) == 1


async def test_a_lease_is_released_at_once_in_process_memory() -> None:
    slots = MemorySlots()
    lease = await Lease.take(slots, "conv_a", 30.0)
    assert lease is not None and lease.beat is not None
    assert await Lease.take(slots, "conv_a", 30.0) is None
    beat = lease.beat
    lease.release()  # from code that cannot wait: no step of the loop needed
    assert len(slots) == 0 and lease.token is None
    await asyncio.sleep(0)
    assert beat.cancelled()
    lease.release()  # idempotent
    again = await Lease.take(slots, "conv_a", 30.0)
    assert again is not None
    await again.let_go()
    assert len(slots) == 0


async def test_a_short_ttl_in_the_slot_renewed_by_the_beat() -> None:
    """A slot's TTL is at most HEARTBEAT whatever the lease's duration (a killed
    replica's lapses soon); the lease's beat renews it up to the lease's own end."""
    assert ttl_of(600.0) == HEARTBEAT and ttl_of(1.0) == 1.0
    slots = MemorySlots()
    lease = await Lease.take(slots, "conv_a", 0.3)
    assert lease is not None
    for _ in range(6):  # 0.6 s of progress: twice the duration
        lease.renew()
        await asyncio.sleep(0.1)
    assert not await slots.hold("conv_a", "other", 1.0)
    await asyncio.sleep(0.6)  # silent: it lapsed
    assert await slots.hold("conv_a", "other", 1.0)
    lease.release()
    assert not await slots.hold("conv_a", "third", 1.0)  # the other holder's stays
