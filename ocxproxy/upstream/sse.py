"""Incremental Server-Sent Events framing: bytes in, whole events out. Pure, no I/O.

An event is kept as its raw bytes (so it can be relayed untouched) plus the two fields
the proxy reads: the `event:` name and the joined `data:` payload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@dataclass(frozen=True, slots=True)
class Event:
    raw: bytes  # including its terminating blank line
    name: str | None
    data: bytes


def parse_event(raw: bytes) -> Event:
    name: str | None = None
    data: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    return Event(raw, name, b"\n".join(data))


class EventSplitter:
    """Feed chunks, get complete events; the incomplete tail waits for more bytes."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[Event] = []
        start = 0
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


def encode_event(name: str | None, data: bytes) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + data + b"\n\n"
