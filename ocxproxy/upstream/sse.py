"""Incremental Server-Sent Events framing: bytes in, whole events out. Pure, no I/O.

An event is kept as its raw bytes (so it can be relayed untouched) plus the two fields
the proxy reads: the `event:` name and the joined `data:` payload. An event whose payload
the proxy rewrote is not framed anew where it was framed plainly (`event: <name>` and one
`data:` line): its raw bytes are then empty, and it is written as its head, its payload
and a blank line (`wire`), parts that a socket sends with one writev, not a copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from ocxproxy.h1 import chunk
from ocxproxy.speedups import SPEEDUPS

# The events that end a response: after one, the client expects nothing more of it.
TERMINAL_EVENTS = frozenset(
    ("response.completed", "response.incomplete", "response.failed", "response.cancelled")
)
# The terminal events of a response to remember: it finished, wholly or cut short by a limit.
SUCCESS_EVENTS = frozenset(("response.completed", "response.incomplete"))
# The last event a whole stream may end with: a terminal one, or the backend's `error`.
FINAL_EVENTS = TERMINAL_EVENTS | {"error"}
# The events that carry a whole Response object (under `response`).
# The events that carry a whole Response before the terminal one.
PENDING_EVENTS = frozenset(("response.created", "response.in_progress", "response.queued"))
RESPONSE_EVENTS = TERMINAL_EVENTS | PENDING_EVENTS
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs three times more
class Event:
    # Including its terminating blank line; empty: framed by `wire`. (Events are equal when
    # a client reads them alike: framed plainly or as they came.)
    raw: bytes = field(compare=False)
    name: str | None
    data: bytes
    # Where `data` starts in `raw` when `raw` is a head, `data` and the blank line (the
    # usual one-line payload: `with_data` then needs no check); -1 when not known or none.
    at: int = field(default=-1, compare=False)


def parse_event(raw: bytes) -> Event:
    simple = _parse_simple(raw)
    if simple is not None:
        return simple
    name = None
    data: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    return Event(raw, name, b"\n".join(data))


def _parse_simple(raw: bytes) -> Event | None:
    """The usual event (LF line ends, an optional `event:` line, one `data:` line) by
    find() and slices: a regex over the payload costs ~10 ns a byte."""
    name: str | None = None
    at = 0
    if raw.startswith(b"event:"):
        at = raw.find(b"\n") + 1
        name = raw[6 : at - 1].strip().decode("utf-8", "replace")
    # (find(), not `in`: CPython 3.11's bytes `in` tries its operand as an int first, and
    # raises and clears a TypeError each time)
    if not raw.startswith(b"data:", at) or raw.find(b"\r") >= 0:
        return None
    at += 6 if raw.startswith(b" ", at + 5) else 5
    if raw.find(b"\n", at) != len(raw) - 2:
        return None  # more lines than that
    return Event(raw, name, raw[at:-2], at)


class EventSplitter:
    """Feed chunks, get complete events; the incomplete tail waits for more bytes."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[Event] = []
        start = 0
        if buffer.find(b"\r") < 0:  # LF line ends, the usual case: find() beats the regex
            while (end := buffer.find(b"\n\n", start)) >= 0:
                events.append(parse_event(buffer[start : end + 2]))
                start = end + 2
            self._buffer = buffer[start:]
            return events
        for match in _BOUNDARY.finditer(buffer):
            end = match.end()
            events.append(parse_event(buffer[start:end]))
            start = end
        self._buffer = buffer[start:]
        return events

    def flush(self) -> list[Event]:
        """The last event of a stream that ended without a blank line."""
        rest, self._buffer = self._buffer, b""
        return [parse_event(rest + b"\n\n")] if rest.strip() else []


def with_data(event: Event, data: bytes) -> Event:
    """The event carrying `data` instead: not framed when it was framed plainly (see
    `wire`), else framed as it was when its payload was one line at its end (the usual
    case), else re-encoded."""
    raw, old, at = event.raw, event.data, event.at
    if not raw:  # (rewritten before)
        return Event(b"", event.name, data)
    if at < 0:
        end = len(raw) - 2
        if not (raw.endswith(b"\n\n") and b"\n" not in old and raw.endswith(old, 0, end)):
            return Event(encode_event(event.name, data), event.name, data)
        at = end - len(old)
    head = head_of(event.name)
    if head is not None and at == len(head) and raw.startswith(head):
        return Event(b"", event.name, data)
    return Event(b"".join((raw[:at], data, b"\n\n")), event.name, data, at)


def rewrite(event: Event, data: bytes) -> None:
    """`event` changed in place to carry `data` instead, framed as `with_data` frames it."""
    new = with_data(event, data)
    event.raw, event.data, event.at = new.raw, new.data, new.at


_HEADS: dict[str | None, bytes] = {None: b"data: "}  # (a few names: a bounded cache)


def head_of(name: str | None) -> bytes | None:
    """What precedes the payload of an event named `name` framed plainly: `event: <name>`
    and `data: `; None for a name `wire` does not frame (not ASCII, or a line break)."""
    head = _HEADS.get(name)
    if head is None and name is not None and name.isascii() and "\n" not in name:
        head = b"event: " + name.encode() + b"\ndata: "
        if len(_HEADS) < 64:
            _HEADS[name] = head
    return head


def _wire(events: list[Event], chunked: bool) -> list[bytes]:
    parts: list[bytes] = []
    for event in events:
        if event.raw:
            parts.append(event.raw)
        elif (head := head_of(event.name)) is not None:
            parts += (head, event.data, b"\n\n")
        else:  # (made so by hand: `with_data` keeps such an event's raw bytes)
            parts.append(encode_event(event.name, event.data))
    return list(chunk(*parts)) if chunked else parts


def framed(event: Event) -> bytes:
    """The event's bytes as `wire` writes them."""
    return event.raw or b"".join(wire([event], False))


# wire(events, chunked): the events' bytes as parts to write, not joined: each event's raw
# bytes, or for one whose payload was rewritten (no raw bytes), its head, payload and blank
# line; `chunked`: framed as one chunk of an HTTP/1.1 chunked body too (`h1.chunk`).
wire = _wire if SPEEDUPS is None else SPEEDUPS.wire


def encode_event(name: str | None, data: bytes) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + data + b"\n\n"


def error_event(error: dict[str, Any], *, after: Event | None) -> bytes:
    """The client's SSE `error` event for an OpenAI-shaped error, sent after the event
    `after` (None: first): the nested error object, its fields also at the top level."""
    body = error["error"]
    payload = {"type": "error", "code": body["code"], "message": body["message"]}
    payload.update(param=body["param"], error=body)
    sequence_number = _next_sequence_number(after)
    if sequence_number is not None:
        payload["sequence_number"] = sequence_number
    return encode_event("error", orjson.dumps(payload))


def _next_sequence_number(last: Event | None) -> int | None:
    if last is None:
        return 0
    payload = loads_or_none(last.data)
    seq = payload.get("sequence_number") if isinstance(payload, dict) else None
    return seq + 1 if isinstance(seq, int) else None


def loads_or_none(data: bytes) -> Any:
    """The JSON value of `data`, or None when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
