"""heap.settle: what the proxy's process does every second (ocxproxy/heap.py)."""

from __future__ import annotations

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
    monkeypatch.setattr(heap, "FULL_AFTER", 3)
    monkeypatch.setattr(heap, "FULL_EVERY", 5)
    idle = False

    class Enough(Exception):
        pass

    async def settled(n: int) -> list[int]:
        """Which of the next `n` settles (1-based) were full passes."""
        passes: list[bool] = []

        def settle(*, full: bool = False) -> None:
            passes.append(full)
            if len(passes) == n:
                raise Enough

        monkeypatch.setattr(heap, "settle", settle)
        with pytest.raises(Enough):
            await heap.keep_settled(lambda: idle, every=0.001)
        return [i + 1 for i, full in enumerate(passes) if full]

    assert await settled(11) == [5, 10]  # never idle: only when it must
    idle = True
    assert await settled(7) == [3, 6]  # idle: as soon as it may
