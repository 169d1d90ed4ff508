"""Background responses' bookkeeping (CONTRACT.md C11): each one's status and latest
Response, and the event log a stream replays from.

`Backgrounds` is the interface the request path uses; `store/local/background.py`'s
`LocalBackgrounds` implements it on one node.

The event log is process memory: the bytes of each SSE event by `sequence_number`,
kept `LOG_KEPT` seconds after the terminal event within `--background-log-bytes`
(a running response's log is never dropped), then only the final Response remains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from ocxproxy.errors import NotFound, OcxError, StoreFailure
from ocxproxy.metrics import Metrics
from ocxproxy.model import Record

if TYPE_CHECKING:
    from ocxproxy.store.interface import Conversations, StoreInterface

log = logging.getLogger("ocxproxy.background")

QUEUED, IN_PROGRESS = "queued", "in_progress"
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
STORED = frozenset({"completed", "incomplete"})  # the store keeps their final Response
LOG_KEPT = 600.0  # seconds an event log outlives its terminal event (within the budget)
LOST = "background_lost"
# A background response's input as kept: the response whose chain comes first (None:
# none), then its own items as a segment's bytes.
Inputs = tuple[str | None, bytes]


class EventLog:
    """A background response's SSE events, in order (index = sequence_number), and the
    waiters that follow it."""

    __slots__ = ("_waiters", "closed", "events", "size")

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.size = 0
        self.closed = False  # the terminal event (or the end: cancelled, lost) is in
        self._waiters: list[asyncio.Future[None]] = []

    def append(self, *events: bytes) -> None:
        self.events += events
        self.size += sum(map(len, events))
        if self._waiters:
            self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    async def changed(self) -> None:
        """Until the next append or close."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:  # (a follower that left)
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


@dataclass(slots=True, eq=False)
class Job:
    """One background response."""

    id: str
    scope: str
    status: str
    response: bytes  # the latest Response (JSON)
    stream: bool  # created with stream:true: its events can be streamed again
    created: float = field(default_factory=time.time)
    ended: float | None = None
    log: EventLog | None = None
    task: asyncio.Task[Any] | None = None  # the run (http/background.py), while it runs
    cancelling: bool = False
    # Its own input items, as a segment's bytes (items joined by commas), while the store
    # does not hold its turn: queued, running, failed, cancelled. `parent`: the stored
    # response whose chain comes before them (read from the store when `input_items`
    # asks; `parent_record`, where the run holds it); None: they are the whole input.
    # `durable`: they may reach disk or the shared server.
    inputs: bytes | None = None
    parent: str | None = None
    parent_record: Record | None = None
    durable: bool = True
    # Its stored turn's conversation and the ids of the items the turn appended to it: a
    # cancel that wins against the end takes them out again (`take_back`).
    appended: tuple[str, tuple[str, ...]] | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


async def take_back(
    store: StoreInterface, conversations: Conversations, job: Job, duration: float, metrics: Metrics
) -> None:
    """`job`'s turn, stored before a cancel won against its end, taken back: deleted from
    the store, and the items it appended to its conversation taken out again (as a DELETE
    of each item does, under the conversation's lock, held `duration` at most). What could
    not be taken back is counted (ocxproxy_background_take_back_failures_total)."""
    try:
        await store.delete(job.scope, job.id)
    except (OcxError, StoreFailure) as error:
        metrics.background_take_back_failures.inc()
        log.warning("background response %s: its turn stays stored: %s", job.id, error)
    if job.appended is None:
        return
    conversation_id, ids = job.appended
    try:
        async with conversations.locked(job.scope, conversation_id, duration):
            conversation = await conversations.load(job.scope, conversation_id)
            for item_id in ids:
                with contextlib.suppress(NotFound):  # (deleted by its owner meanwhile)
                    conversation = await conversations.delete_item(conversation, item_id)
    except NotFound:
        return  # (the conversation was deleted meanwhile: nothing stays in it)
    except OcxError as error:  # (its lock held past `duration`, the store failing)
        metrics.background_take_back_failures.inc()
        log.warning("background response %s: its turn's items stay in %s: %s",
                    job.id, conversation_id, error.code)  # fmt: skip


class Backgrounds(Protocol):
    """What the request path asks of background bookkeeping, local or shared."""

    def open(self, job: Job) -> None:
        """A new background response (queued)."""

    async def get(self, scope: str, response_id: str) -> Job | None:
        """The caller's background response (its log, when kept, to follow)."""
        ...

    def append(self, job: Job, *events: bytes, ends: bool = False) -> None:
        """Events of `job`'s stream, in order (the first one's sequence_number is the
        log's length); `ends`: its terminal event, which `moved` to the terminal status
        follows."""

    def moved(self, job: Job, status: str, response: bytes | None = None) -> None:
        """`job` is now `status` (its Response `response`, when given)."""

    async def inputs(self, job: Job) -> Inputs | None:
        """`job`'s parent and own input items (Job.parent, Job.inputs), or None when
        they are not known here."""
        ...

    async def continuing(self, scope: str, response_id: str) -> list[Job]:
        """The background responses whose kept input may continue `response_id`
        (Job.parent), their turns not stored."""
        ...

    async def keep_whole(self, job: Job, parent: str, inputs: bytes) -> None:
        """`job`, while its kept input still continues `parent` (that response is going):
        `inputs`, its whole input, kept as its own from now on, its parent forgotten
        (journaled, or on the server, like the first ones)."""

    def drop(self, job: Job) -> None:
        """`job` is deleted: forgotten, its log with it (its followers' streams end)."""

    async def commit(self) -> None:
        """Until every change so far is durable (a no-op without a state dir)."""

    async def load(self) -> None: ...

    async def close(self) -> None: ...

    def running(self) -> list[asyncio.Task[Any]]: ...


class Gauged(Protocol):
    """What the background gauges read of a Backgrounds: its jobs and its logs' bytes."""

    @property
    def jobs(self) -> Mapping[Any, Job]: ...

    @property
    def log_size(self) -> int: ...


def register_gauges(metrics: Metrics, backgrounds: Gauged) -> None:
    """The queued/running counts and the logs' bytes, read from `backgrounds` through a
    weak reference: the gauges must not make a cycle of it."""
    ref = weakref.ref(backgrounds)

    def count(status: str) -> float:
        b = ref()
        return 0.0 if b is None else float(sum(1 for j in b.jobs.values() if j.status == status))

    for status in (QUEUED, IN_PROGRESS):
        metrics.background_jobs.labels(status=status).set_function(partial(count, status))
    metrics.background_log_bytes.set_function(
        lambda: float(b.log_size) if (b := ref()) is not None else 0.0
    )


def response_event(kind: str, sequence_number: int, response: bytes) -> bytes:
    """The SSE event of `kind` (`response.created`, a terminal one) that carries the
    Response `response` (its JSON bytes), numbered `sequence_number`."""
    payload = {
        "type": kind,
        "sequence_number": sequence_number,
        "response": orjson.Fragment(response),
    }
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def lost_response(response: bytes) -> bytes:
    """The Response of a background response whose run was lost: failed, typed."""
    try:
        body = orjson.loads(response)
    except orjson.JSONDecodeError:
        body = {}
    if type(body) is not dict:
        body = {}
    body["status"] = "failed"
    body["error"] = {
        "code": "server_error",
        "message": f"{LOST}: the proxy running this background response stopped before "
        "it finished.",
    }
    return orjson.dumps(body)
