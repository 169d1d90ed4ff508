"""heap.settle: what the proxy's process does every second (ocxproxy/heap.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest

from ocxproxy import heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite runs with nothing frozen


def test_settle_collects_cyclic_garbage_then_freezes_the_survivors(unfrozen: None) -> None:
    garbage, kept = Node(), Node()
    garbage.other, kept.other = garbage, kept  # two cycles; only `kept` stays referenced
    gone = weakref.ref(garbage)
    del garbage
    before = gc.get_freeze_count()
    heap.settle()
    assert gone() is None  # collected first, not frozen with the rest
    assert gc.get_freeze_count() > before
    assert not any(obj is kept for obj in gc.get_objects())  # out of every collection


def test_a_full_settle_collects_a_cycle_that_died_after_it_was_frozen(unfrozen: None) -> None:
    late = Node()
    late.other = late  # alive at the first settle: frozen with the rest
    gone = weakref.ref(late)
    heap.settle()
    del late
    heap.settle()
    assert gone() is not None  # an ordinary settle never looks at frozen objects
    heap.settle(full=True)
    assert gone() is None


async def test_the_full_pass_waits_for_an_idle_moment_but_not_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passes: list[bool] = []
    monkeypatch.setattr(heap, "settle", lambda *, full=False: passes.append(full))
    monkeypatch.setattr(heap, "FULL_AFTER", 3)
    monkeypatch.setattr(heap, "FULL_EVERY", 5)
    idle = False

    async def settled(n: int) -> list[int]:
        """The settles (1-based, of the next `n`) that were full passes."""
        del passes[:]
        task = asyncio.ensure_future(heap.keep_settled(lambda: idle, every=0.001))
        while len(passes) < n:
            await asyncio.sleep(0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return [i + 1 for i, full in enumerate(passes[:n]) if full]

    assert await settled(11) == [5, 10]  # never idle: only when it must
    idle = True
    assert await settled(7) == [3, 6]  # idle: as soon as it may
