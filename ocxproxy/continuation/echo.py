"""The Response object a client receives names the `previous_response_id` its request
gave, as OpenAI's does; a stateless backend never saw one and answers null (or nothing).

Patched in the bytes, not by decoding and re-encoding: the response JSON, and the few
stream events that carry a whole response, get the member set or inserted; everything else
passes untouched.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ocxproxy.upstream.sse import Event, with_data

_NULL = re.compile(rb'"previous_response_id"\s*:\s*null')
_SET = re.compile(rb'"previous_response_id"\s*:\s*"')
_RESPONSE = re.compile(rb'"response"\s*:\s*\{')
_OBJECT = re.compile(rb"\s*\{")
_CLOSE = re.compile(rb"\s*\}")


def echo_previous_id(data: bytes, previous_id: str, *, in_event: bool = False) -> bytes:
    """`data` (a Response object, or with `in_event` a stream event holding one under
    `response`) with `previous_response_id` set to `previous_id` where it was null or
    absent; unchanged when it already names one, or when `data` holds no object to patch.

    A JSON string cannot hold the member's unescaped quotes, so a match is a real member.
    """
    member = b'"previous_response_id":' + orjson.dumps(previous_id)
    patched, count = _NULL.subn(lambda _: member, data, count=1)  # no template escapes
    if count:
        return patched
    if _SET.search(data):
        return data
    match = _RESPONSE.search(data) if in_event else _OBJECT.match(data)
    if match is None:
        return data
    at = match.end()
    empty = _CLOSE.match(data, at) is not None
    return b"".join((data[:at], member, b"" if empty else b",", data[at:]))


def echo_in_event(event: Event, payload: Any, previous_id: str) -> tuple[Event, Any]:
    """A Response-carrying event naming the request's previous_response_id, patched in
    its bytes (and in its decoded payload, when there is one)."""
    data = echo_previous_id(event.data, previous_id, in_event=True)
    if data is event.data:
        return event, payload
    response = payload.get("response") if isinstance(payload, dict) else None
    if isinstance(response, dict):
        response["previous_response_id"] = previous_id
    return with_data(event, data), payload
