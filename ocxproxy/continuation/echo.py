"""The Response object a client receives names the `previous_response_id` or the
`conversation` its request gave, as OpenAI's does; a stateless backend never saw either
and answers null (or nothing).

Patched in the bytes, not by decoding and re-encoding: the response JSON, and the few
stream events that carry a whole response, get the member set or inserted; everything else
passes untouched.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ocxproxy.upstream.sse import Event, with_data


def _patterns(name: str) -> tuple[re.Pattern[bytes], re.Pattern[bytes], bytes]:
    key = b'"' + name.encode() + b'"'
    null = re.compile(re.escape(key) + rb"\s*:\s*null")
    given = re.compile(re.escape(key) + rb'\s*:\s*["{]')
    return null, given, key + b":"


# The members a Response echoes from its request: `previous_response_id` (a string) and
# `conversation` (`{"id": …}`). Turns are stateless on the backend, which answers null or
# nothing for both.
_MEMBERS = {name: _patterns(name) for name in ("previous_response_id", "conversation")}
_RESPONSE = re.compile(rb'"response"\s*:\s*\{')
_OBJECT = re.compile(rb"\s*\{")
_CLOSE = re.compile(rb"\s*\}")


def echo_member(data: bytes, name: str, value: Any, *, in_event: bool = False) -> bytes:
    """`data` (a Response object, or with `in_event` a stream event holding one under
    `response`) with the member `name` set to `value` where it was null or absent;
    unchanged when it already has one, or when `data` holds no object to patch.

    A JSON string cannot hold the member's unescaped quotes, so a match is a real member.
    """
    null, given, key = _MEMBERS[name]
    member = key + orjson.dumps(value)
    patched, count = null.subn(lambda _: member, data, count=1)  # no template escapes
    if count:
        return patched
    if given.search(data):
        return data
    match = _RESPONSE.search(data) if in_event else _OBJECT.match(data)
    if match is None:
        return data
    at = match.end()
    empty = _CLOSE.match(data, at) is not None
    return b"".join((data[:at], member, b"" if empty else b",", data[at:]))


def echo_in_event(event: Event, payload: Any, name: str, value: Any) -> tuple[Event, Any]:
    """A Response-carrying event with the member patched in its bytes (and in its decoded
    payload, when there is one)."""
    data = echo_member(event.data, name, value, in_event=True)
    if data is event.data:
        return event, payload
    response = payload.get("response") if isinstance(payload, dict) else None
    if isinstance(response, dict):
        response[name] = value
    return with_data(event, data), payload
