"""The cyclic GC over a large, long-lived heap (`serve`, and a checkpoint, which settles
just before it captures the index and freezes the capture: store/local/durable.py).

The store's index (per record: a Record, a chain link, a response Segment) holds no
reference cycle and is freed by reference counting, yet every full collection traverses
all of it: ~0.5 s with the event loop stopped at 100,000 records, and CPython runs one
whenever the objects that survived grew by a quarter. So `serve` settles the heap every
few seconds: a full collection of what is not frozen yet (only what was allocated since
the last settle, a few ms), then `gc.freeze()`, which takes the survivors out of every
later collection. The price: a reference cycle among objects frozen while alive is not
collected when it dies, so the frozen heap is thawed and collected whole from time to time:
a full pass, ~0.5 s with the loop stopped at 100,000 records. The proxy's own per-turn
objects hold no cycle once done (an HTTP reader drops llhttp's parser, whose callbacks
are its bound methods), so what waits for that pass is little (aiohttp's WebSocket
connection, ~7 KB each): it runs at the first settle with no backend request in flight
once `FULL_AFTER` settles have passed, and after `FULL_EVERY` regardless.

`trim()` hands the memory freed at the top of malloc's heaps back to the system (after
start-up's load, ~18 MiB at 100,000 records, after each checkpoint, ~36 MiB of encoding
there, and every half minute).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
from collections.abc import Callable

SETTLE_EVERY = 1.0  # seconds between settles
TRIM_EVERY = 30  # settles between trims (a trim walks malloc's free lists: a few ms)
FULL_AFTER = 600  # settles before a full collection of the frozen heap, once idle
FULL_EVERY = 3600  # settles before one, idle or not


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


async def keep_settled(idle: Callable[[], bool], every: float = SETTLE_EVERY) -> None:
    """Settle every `every` seconds; `idle` says whether a full pass would keep no request
    waiting."""
    n = since_full = 0
    while True:
        await asyncio.sleep(every)
        n += 1
        since_full += 1
        full = since_full >= FULL_EVERY or (since_full >= FULL_AFTER and idle())
        settle(full=full)
        if full:
            since_full = 0
        if n % TRIM_EVERY == 0:
            trim()
