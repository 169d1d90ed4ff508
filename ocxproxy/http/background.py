"""Background responses (CONTRACT.md C11): `background: true` on `POST /v1/responses`.

`start` answers at once with the Response (`queued`, `background: true`, the proxy's
own id) and runs the turn itself (once the response is kept: a create the store refused
is undone, never run), as the same create turn a client's streamed request
is (http/exchange.py: expansion, conversations, affinity, Idempotency-Key, the turn
remembered before it is told finished), with the request's `background` taken out and
`stream: true` put in: the backend never sees `background`. The turn's answer goes to a
`JobReply`, which keeps the Response's status and, for `stream: true`, the event log
(store/background.py), renumbered from 0: `response.created` (queued) is the proxy's,
the backend's first lifecycle event becomes `response.in_progress`, then its events up
to the terminal one. `follow` streams a log from a sequence number and then the live
turn to its end; `cancel` stops the run (the backend request is closed with it) and
keeps nothing of the turn.

At most `--max-background` run at once; the rest wait `queued`, up to
`--background-queue` of them (429 beyond).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections.abc import Mapping
from typing import Any

import orjson
from multidict import CIMultiDict

from ocxproxy.aio import spawn
from ocxproxy.continuation.envelope import complete_items
from ocxproxy.continuation.expand import Request, serialize_items
from ocxproxy.errors import (
    FailureReason,
    InvalidRequest,
    NotFound,
    OcxError,
    RateLimited,
    ShuttingDown,
    StorageUnavailable,
    StoreFailure,
)
from ocxproxy.http import idempotency
from ocxproxy.http.context import Proxy, Reply
from ocxproxy.http.exchange import Exchange, forward, prepare_exchange
from ocxproxy.metrics import Timing
from ocxproxy.model import Record
from ocxproxy.store import IN_PROGRESS, QUEUED, STORED, TERMINAL, Inputs, Job, take_back
from ocxproxy.upstream.sse import (
    TERMINAL_EVENTS,
    Event,
    EventSplitter,
    encode_event,
    framed,
    loads_or_none,
)

log = logging.getLogger("ocxproxy.background")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
JSON_HEADERS = {"Content-Type": "application/json"}
CANCEL_WAIT = 1.0  # seconds a cancel waits for the run to let go of its backend request
_SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*-?\d+')
_LIFECYCLE = ("response.created", "response.in_progress", "response.queued")
# Decoded by JobReply (an event without a name too).
_SPECIAL = frozenset((*_LIFECYCLE, *TERMINAL_EVENTS, "error", None))
_NOT_STARTED, _NOT_KEPT = -1, -2  # (JobReply._next)
_QUEUED, _IN_PROGRESS = b'"status":"queued"', b'"status":"in_progress"'
# A lookup's failures that mean the response's chain is gone (any other is a read failure).
_GONE = frozenset(
    (FailureReason.UNKNOWN, FailureReason.EXPIRED, FailureReason.EVICTED, FailureReason.MISSING)
)


async def start(
    proxy: Proxy,
    scope: str,
    headers: Mapping[str, str],
    path_qs: str,
    raw: bytes,
    request: Request,
    timing: Timing,
    reply: Reply,
) -> None:
    """`POST /v1/responses` with `background: true`."""
    if request.body.get("background") is not True:
        raise InvalidRequest(
            "Invalid type for 'background': expected a boolean.", param="background"
        )
    if not request.store:
        raise InvalidRequest(
            "Background mode requires store=true: a background response is kept so it can "
            "be polled, streamed again and cancelled.",
            param="background",
        )
    if proxy.background_runs.waiting >= proxy.config.background_queue:
        proxy.metrics.background_refused.inc()
        raise RateLimited(
            "Too many background responses are waiting to run; retry later.",
        )
    key = idempotency.key_of(headers, scope, raw, stored=True)
    done = await idempotency.begin(proxy, key) if key is not None else None
    if done is not None:  # answered before: the same response again
        try:
            await idempotency.replay(
                reply, await _as_now(proxy, scope, done), stream=request.stream
            )
        finally:
            assert key is not None
            idempotency.end(proxy, key)
        return
    body = request.body.copy()
    del body["background"]  # (True: checked above)
    body["stream"] = True
    forwarded = orjson.dumps(body)
    checked = Request(body, request.previous_response_id, True, request.store, request.items)
    exchange: Exchange | None = None
    try:
        exchange = await prepare_exchange(proxy, scope, checked, forwarded)
        parent, inputs = await _inputs(proxy, exchange)
    except BaseException:
        if exchange is not None:
            exchange.release()
        if key is not None:
            idempotency.end(proxy, key)
        raise
    exchange.idempotency_key = key
    exchange.pending_raw = True  # (JobReply makes its own)
    response_id = "resp_" + secrets.token_hex(24)
    exchange.envelope.pin(id=response_id, background=True)
    first = {"id": response_id, "status": QUEUED, "output": []}
    exchange.envelope.complete(first, final=False)
    first_bytes = orjson.dumps(first)
    job = Job(
        response_id, scope, QUEUED, first_bytes, request.stream, inputs=inputs,
        parent=parent.id if parent is not None else None, parent_record=parent,
        durable=exchange.durable,
    )  # fmt: skip
    book = proxy.backgrounds
    book.open(job)
    if job.log is not None:
        book.append(job, _event("response.created", 0, orjson.Fragment(first_bytes)))
    # Answered once the response is kept (on a shared store always: every replica finds it),
    # and run only then: a create the store refused is undone (its 503 is retried, and a
    # run of it would keep a turn, in a conversation too, under an id no client knows).
    if proxy.config.durability == "ack" or proxy.config.shared_store is not None:
        try:
            await book.commit()
        except BaseException:
            book.drop(job)  # (the next commit writes it gone; the shared store deletes it)
            exchange.release()
            if key is not None:
                idempotency.end(proxy, key)
            raise
    copied = CIMultiDict(headers)
    proxy.background_runs.exchanges[scope, response_id] = exchange
    job.task = spawn(
        _run(proxy, exchange, job, copied, path_qs, timing.request_id),
        name=f"background-{response_id}",
    )
    if request.stream:
        await reply.start(200, CIMultiDict(SSE_HEADERS))
        await follow(job, reply, -1)
    else:
        reply.answer(200, CIMultiDict(JSON_HEADERS), first_bytes)


async def _as_now(proxy: Proxy, scope: str, done: dict[str, Any]) -> dict[str, Any]:
    """The Response a completed key names, as a poll shows it now: a cancel that won
    against the turn's end (the turn stored, its key completed, then taken back) made
    it `cancelled`."""
    response_id = done.get("id")
    if done.get("background") is not True or not isinstance(response_id, str):
        return done
    job = await proxy.backgrounds.get(scope, response_id)
    return _loads(job.response) if job is not None and job.status == "cancelled" else done


def _numbered(data: bytes, sequence_number: int) -> bool:
    """Whether an SSE event's payload (or its bytes) carries this `sequence_number`
    (compact JSON)."""
    tag = b'"sequence_number":%d' % sequence_number
    return data.endswith(tag + b"}") or tag + b"," in data or tag + b"}" in data


def _event(kind: str, sequence_number: int, response: Any) -> bytes:
    payload = {"type": kind, "sequence_number": sequence_number, "response": response}
    return encode_event(kind, orjson.dumps(payload))


async def follow(job: Job, reply: Reply, after: int) -> None:
    """The events of `job`'s log after `after`, then each as it comes, to the end; a
    log that cannot be read (the shared store is down) ends the stream with an `error`
    event: the client resumes after the last event it got."""
    at = after + 1
    while True:
        events = job.log
        if events is None:
            break
        if at < len(events.events):
            batch = events.events[at:]
            at += len(batch)
            await reply.write(b"".join(batch))
            continue
        if events.closed:
            break
        try:
            await events.changed()
        except OcxError as error:
            # (no sequence_number of its own: it is not in the log, and must not be
            # taken for its next event)
            body = error.to_openai_error()["error"]
            payload = {**body, "type": "error", "error": body}
            await reply.write(encode_event("error", orjson.dumps(payload)))
            break
    await reply.end()


async def cancel(proxy: Proxy, job: Job) -> bytes:
    """`POST /v1/responses/{id}/cancel`: the Response, `cancelled` unless it had ended."""
    task = job.task
    if not job.terminal and task is not None:
        job.cancelling = True
        task.cancel()
        await asyncio.wait([task], timeout=CANCEL_WAIT)
    cancelled(proxy, job)  # (a run that did not end in time is cut all the same)
    await proxy.backgrounds.commit()
    return job.response


async def _run(
    proxy: Proxy,
    exchange: Exchange,
    job: Job,
    headers: CIMultiDict[str],
    path_qs: str,
    request_id: str,
) -> None:
    """The turn of a background response, once a slot is free, to its end."""
    runs = proxy.background_runs
    reply = JobReply(proxy, job, exchange)
    try:
        runs.waiting += 1
        try:
            if runs.slots is not None:
                await runs.slots.acquire()
        finally:
            runs.waiting -= 1
        try:
            await forward(exchange, headers, path_qs, Timing(request_id), reply)
            if not job.terminal:  # (forward ends every stream with a terminal or error event)
                reply.fail("server_error", "The backend's stream ended before it finished.")
        finally:
            if runs.slots is not None:
                runs.slots.release()
    except asyncio.CancelledError:
        if exchange.recorded and not job.terminal:  # cut once stored: not kept after all
            await _take_back(proxy, exchange, job)
        if job.cancelling:
            cancelled(proxy, job)
        else:
            stopped = ShuttingDown()
            reply.fail(stopped.code, stopped.message)
        await _write_end(proxy, job)
        raise
    except OcxError as error:
        reply.fail(error.code or "server_error", error.message)
    except Exception:
        log.exception("background response %s failed", job.id)
        reply.fail("server_error", "The proxy failed running this background response.")
    finally:
        runs.exchanges.pop((job.scope, job.id), None)
        exchange.release()
        if exchange.idempotency_key is not None:
            idempotency.end(proxy, exchange.idempotency_key)
    if job.status not in STORED:  # (a completed one is the store's: its line can wait)
        await _write_end(proxy, job)


async def _write_end(proxy: Proxy, job: Job) -> None:
    """The end of a run, written. A store that cannot take it leaves the response to
    its lease (another replica fails it, or the next start does; a journal that could
    not be written: the next start): the run ends all the same, rather than with an
    error no one awaits."""
    try:
        await proxy.backgrounds.commit()
    except (StorageUnavailable, OSError) as error:
        log.warning("background response %s: its end could not be written: %s", job.id, error)


async def _take_back(proxy: Proxy, exchange: Exchange, job: Job) -> None:
    """A turn stored before its run was cut (a cancel won against its end): deleted, and
    its items taken out of its conversation again."""
    job.appended = _appended(exchange)
    store = proxy.store
    await take_back(store, store.conversations, job, proxy.lease_duration, proxy.metrics)
    if job.appended is not None:
        proxy.cache_book.edited(job.appended[0])


def _appended(exchange: Exchange) -> tuple[str, tuple[str, ...]] | None:
    """The conversation a recorded turn was appended to, and its items' ids there."""
    turn = exchange.conversation
    if not exchange.recorded or turn is None or not turn.conversation.meta.ids:
        return None
    return turn.conversation.id, tuple(turn.conversation.meta.ids[-1])  # (its segment)


def cancelled(proxy: Proxy, job: Job) -> None:
    """`job` is cancelled; its stream ends with `response.cancelled` (the Response,
    `cancelled`), so a client following it knows it ended."""
    if job.terminal:
        return
    response = _loads(job.response)
    response["status"] = "cancelled"
    proxy.metrics.background_cancels.inc()
    book = proxy.backgrounds
    if job.log is not None:
        book.append(job, _event("response.cancelled", len(job.log.events), response), ends=True)
    book.moved(job, "cancelled", orjson.dumps(response))


async def delete(proxy: Proxy, job: Job) -> None:
    """DELETE of a background response: a running or queued one is cancelled first (its
    backend request closed, nothing kept), then it is forgotten, event log and all."""
    if not job.terminal:
        await cancel(proxy, job)
    proxy.backgrounds.drop(job)
    await proxy.backgrounds.commit()


async def _inputs(proxy: Proxy, exchange: Exchange) -> tuple[Record | None, bytes]:
    """The input items of a background response, kept for `input_items` while the store
    does not hold its turn (queued, running, failed, cancelled), on any replica: the
    response it continues (its chain is read from the store when asked), and its own
    items as a segment's bytes. A conversation's items are kept whole: the conversation
    moves on."""
    own = exchange.tail if exchange.tail is not None else serialize_items(exchange.request.items)
    parent = exchange.parent
    if parent is not None and exchange.conversation is not None:
        return None, b",".join([*await proxy.store.history(parent), *own])
    return parent, b",".join(own)


async def input_history(proxy: Proxy, job: Job, kept: Inputs) -> list[bytes]:
    """A background response's input items as kept (`Backgrounds.inputs`), as segments'
    bytes: the chain of the response it continues, then its own. NotFound when that
    response is gone (deleted or expired before this one's turn was stored): its items
    are not answered in part; StorageUnavailable when it could not be read."""
    parent, own = kept
    history: list[bytes] = []
    if parent is not None:
        try:
            record = job.parent_record or await proxy.store.lookup(job.scope, parent)
            history = await proxy.store.history(record)
        except StoreFailure as failure:
            if failure.reason not in _GONE:
                raise StorageUnavailable(
                    f"The input items of response '{job.id}' could not be read: the proxy's "
                    f"storage failed reading the response it continued ({failure.reason}). "
                    "Retry later."
                ) from None
            raise NotFound(
                f"The input items of response '{job.id}' are no longer available: the "
                f"response it continued, '{parent}', was deleted or has expired."
            ) from None
    return [*history, own] if own else history


async def keep_inputs_past(proxy: Proxy, scope: str, response_id: str) -> None:
    """`response_id` is about to be deleted: the background responses continuing it whose
    turns the store does not hold keep their whole input from now on, so input_items
    lists it after a restart too. StorageUnavailable when a chain could not be read: the
    delete must not go ahead and lose that input."""
    book = proxy.backgrounds
    jobs = await book.continuing(scope, response_id)
    for job in jobs:
        kept = await book.inputs(job)
        if kept is None or kept[0] != response_id:
            continue
        with contextlib.suppress(NotFound):  # (its chain is gone already)
            history = await input_history(proxy, job, kept)
            await book.keep_whole(job, response_id, b",".join(history))
    if jobs:
        await book.commit()


def _loads(data: bytes) -> dict[str, Any]:
    value = loads_or_none(data)
    return value if type(value) is dict else {}


class JobReply:
    """The Reply of a background run: its events become the job's status and log."""

    def __init__(self, proxy: Proxy, job: Job, exchange: Exchange) -> None:
        self.proxy = proxy
        self.job = job
        self.exchange = exchange
        self.splitter: EventSplitter | None = None  # (for what the relay writes itself)
        self.started = False  # the backend's first lifecycle event has been seen

    def answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        """A JSON answer: the backend's error (or a backend that does not stream)."""
        payload = loads_or_none(body)
        if status == 200 and type(payload) is dict and payload.get("object") == "response":
            self._terminal(str(payload.get("status")), payload)
            return
        error = payload.get("error") if type(payload) is dict else None
        message = error.get("message") if type(error) is dict else None
        code = error.get("code") if type(error) is dict else None
        self.fail(
            code if isinstance(code, str) else "server_error",
            message if isinstance(message, str) else f"The backend answered {status}.",
        )

    async def start(self, status: int, headers: CIMultiDict[str]) -> None:
        pass

    async def write(self, data: bytes) -> None:
        """What the relay writes itself (its closing `error` event)."""
        if self.splitter is None:
            self.splitter = EventSplitter()
        self.events(self.splitter.feed(data))

    async def write_events(self, events: list[Event]) -> None:
        self.events(events)

    def events(self, batch: list[Event]) -> None:
        """The relayed events (exchange.relay_stream hands them over unsplit). Most are
        neither lifecycle nor terminal, and already carry the number they get in the log
        (the backend's `response.created` becomes its `response.in_progress` and its own
        is dropped): those go in as they came, undecoded, together."""
        job, book = self.job, self.proxy.backgrounds
        run: list[bytes] = []  # such events, not appended yet
        at = self._next()
        for event in batch:
            if at != _NOT_STARTED and event.name not in _SPECIAL:
                if at == _NOT_KEPT:
                    continue
                raw = event.raw  # (its number at its end as a rule: looked for there first)
                if raw.endswith(b'"sequence_number":%d}\n\n' % at) or _numbered(raw, at):
                    run.append(raw)
                    at += 1
                    continue
            if run:
                book.append(job, *run)
                run.clear()
            if event.data and event.data != b"[DONE]":
                self._event(event.name, event)
            at = self._next()
        if run:
            book.append(job, *run)

    def _next(self) -> int:
        """The log number the next relayed event must carry to go in as it came; or
        _NOT_STARTED (before the backend's first lifecycle event), or _NOT_KEPT (no log,
        or the run ended: the event is dropped)."""
        job = self.job
        if not self.started:
            return _NOT_STARTED
        if job.log is None or job.status in TERMINAL:
            return _NOT_KEPT
        return len(job.log.events)

    async def end(self) -> None:
        pass

    def _event(self, name: str | None, event: Event) -> None:
        job, book = self.job, self.proxy.backgrounds
        if job.terminal:
            return
        kind = name
        payload: Any = None
        final = self.exchange.final  # (the terminal event's Response, decoded by the relay)
        if kind in _LIFECYCLE or (kind in TERMINAL_EVENTS and type(final) is dict):
            pass  # (the name says enough)
        elif kind is None or kind in _SPECIAL:
            payload = loads_or_none(event.data)
            if type(payload) is not dict:
                return
            kind = payload.get("type")
        if kind in _LIFECYCLE:
            if self.started:
                return  # one `response.in_progress` in the log
            self.started = True
            # The queued Response, in progress: the backend's lifecycle Responses carry
            # nothing the proxy's lacks (the relay leaves them uncompleted for this).
            # `status` is the queued Response's second member, before any other.
            progress = job.response.replace(_QUEUED, _IN_PROGRESS, 1)
            book.moved(job, IN_PROGRESS, progress)
            self._append("response.in_progress", None, orjson.Fragment(progress))
            return
        if kind in TERMINAL_EVENTS:
            if payload is not None:
                final = payload.get("response")
            if type(final) is dict:
                self._terminal(kind.removeprefix("response."), final)
            return
        if kind == "error":
            error = payload.get("error")
            error = error if type(error) is dict else payload
            self.fail(str(error.get("code") or "server_error"), str(error.get("message")))
            return
        if not self.started:
            self.started = True
            book.moved(job, IN_PROGRESS)
        self._append(kind, event, None)

    def _append(
        self, kind: str | None, given: Event | None, response: Any, *, ends: bool = False
    ) -> None:
        """An event into the log, numbered next: `given` (renumbered when it must be),
        else one of `kind` carrying `response`."""
        job = self.job
        if job.log is None:
            return
        seq = len(job.log.events)
        if given is None:
            event = _event(kind or "", seq, response)
        elif given.name == kind and _numbered(given.data, seq):
            event = framed(given)
        else:
            data = given.data
            numbered, count = _SEQUENCE.subn(b'"sequence_number":%d' % seq, data, count=1)
            if not count:
                payload = _loads(data)
                payload["sequence_number"] = seq
                numbered = orjson.dumps(payload)
            event = encode_event(kind, numbered)
        self.proxy.backgrounds.append(job, event, ends=ends)

    def _terminal(self, status: str, response: dict[str, Any]) -> None:
        """The run's end: its Response (the relay's, completed but for its output items)
        encoded once, for the terminal event and the job alike."""
        if status not in TERMINAL:
            status = "failed"
        response["status"] = status
        complete_items(response.get("output") or [])
        encoded = orjson.dumps(response)
        self.job.appended = _appended(self.exchange)  # (for a cancel that wins yet)
        self._append("response." + status, None, orjson.Fragment(encoded), ends=True)
        self.proxy.backgrounds.moved(self.job, status, encoded)

    def fail(self, code: str, message: str) -> None:
        """The run ended without the backend's terminal event: `failed`, with why."""
        if self.job.terminal:
            return
        response = _loads(self.job.response)
        response["error"] = {"code": code, "message": message}
        self._terminal("failed", response)
