"""asyncio helpers: background tasks that are named and referenced (so none is
garbage-collected mid-run), and write flow control for hand-written protocols."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

_tasks: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class FlowControlled(asyncio.Protocol):
    """A protocol whose writers can wait while its transport's buffer is over the high-water
    mark (the transport calls pause_writing/resume_writing)."""

    __slots__ = ("_drained",)

    def __init__(self) -> None:
        self._drained: asyncio.Future[None] | None = None

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def wait_drained(self) -> None:
        """Until the transport takes writes again (at once when it does now)."""
        if self._drained is not None:
            await self._drained
