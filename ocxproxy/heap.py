"""The cyclic GC over a large, long-lived heap (`serve` only).

The store's index (per record: a Record, a chain link, a response Segment) holds no
reference cycle and is freed by reference counting, yet every full collection traverses
all of it: ~0.5 s with the event loop stopped at 100,000 records, and CPython runs one
whenever the objects that survived grew by a quarter. So `serve` settles the heap every
few seconds: a full collection of what is not frozen yet (only what was allocated since
the last settle, a few ms), then `gc.freeze()`, which takes the survivors out of every
later collection. The price: a reference cycle among objects frozen while alive (a
WebSocket connection's tasks, an exception's traceback) is not collected when it dies, so
every `FULL_EVERY` settles the frozen heap is thawed and collected whole: one full pass
(~0.5 s at 100,000 records) every ten minutes bounds what such cycles can hold.

`trim()` hands the memory freed at the top of malloc's heaps back to the system (after
start-up's load, ~18 MiB at 100,000 records, and every half minute: checkpoint buffers).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc

SETTLE_EVERY = 1.0  # seconds between settles
TRIM_EVERY = 30  # settles between trims (a trim walks malloc's free lists: a few ms)
FULL_EVERY = 600  # settles between full collections of the frozen heap too


def _malloc_trim() -> object:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def trim() -> None:
    if callable(_TRIM):
        _TRIM(0)


def settle(*, full: bool = False) -> None:
    """Collect what is not frozen (everything when `full`), then freeze the survivors."""
    if full:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


async def keep_settled(every: float = SETTLE_EVERY) -> None:
    n = 0
    while True:
        await asyncio.sleep(every)
        n += 1
        settle(full=n % FULL_EVERY == 0)
        if n % TRIM_EVERY == 0:
            trim()
