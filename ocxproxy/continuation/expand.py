"""Client request → validated fields → the body forwarded to the backend.

The stored history is spliced in as already-serialized bytes: expansion is one join,
never a parse or re-encode of the history. Only the request itself (small) is parsed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from ocxproxy.errors import InvalidRequest
from ocxproxy.model import Record

_OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")
_STATE_FIELDS = ("previous_response_id", "conversation", "input")  # replaced by the splice
# A JSON string, or one structural character: numbers and literals lie between tokens.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]', re.DOTALL)


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed `POST /v1/responses` body and the fields the proxy reads from it."""

    body: dict[str, Any]
    previous_response_id: str | None
    stream: bool
    store: bool
    items: list[Any]  # the request's own input as items ([] when absent)


def parse_request(raw: bytes) -> Request:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return check_request(body)


def check_request(body: dict[str, Any]) -> Request:
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise _bad_type("previous_response_id", "a non-empty string")
    if prev is not None and body.get("conversation") is not None:
        raise InvalidRequest(
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            param="previous_response_id",
            code="mutually_exclusive_parameters",
        )
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad_type("store", "a boolean")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad_type("stream", "a boolean")
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        items: list[Any] = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        items = raw_input
    elif raw_input is None:
        items = []
    else:
        raise _bad_type("input", "a string or an array of input items")
    return Request(body, prev, bool(stream), store, items)


def _bad_type(param: str, expected: str) -> InvalidRequest:
    return InvalidRequest(
        f"Invalid type for '{param}': expected {expected}.", param=param, code="invalid_type"
    )


def serialize_items(items: Iterable[Any]) -> list[bytes]:
    """Items → one JSON value each (a segment's bytes once comma-joined)."""
    return [orjson.dumps(item) for item in items]


def tail_as_sent(raw: bytes, request: Request) -> list[bytes]:
    """A first turn's own items as the backend saw them in `raw`, one serialized item
    each: what is remembered, so the next turn replays them byte for byte (CONTRACT.md C1.2)."""
    encoded = [orjson.dumps(item) for item in request.items]
    # (find(), not `in`: CPython 3.11's bytes `in` raises and clears a TypeError first)
    if (
        not isinstance(request.body.get("input"), list)
        or raw.find(b"[" + b",".join(encoded) + b"]") >= 0
    ):
        return encoded  # a string input, or the client encodes as compactly as orjson
    found = raw_input_items(raw)
    return encoded if found is None or len(found) != len(encoded) else found


def raw_input_items(raw: bytes) -> list[bytes] | None:
    """The items of the top-level `input` array exactly as the client wrote them
    (whitespace around them dropped), or None when `input` is no array.

    `raw` must be valid JSON (it was parsed first).
    """
    depth = 0
    string: bytes | None = None  # the last string seen at depth 1
    key: bytes | None = None  # the key whose value is being read at depth 1
    spans: list[bytes] | None = None  # items of the `input` array being read
    start = 0
    result: list[bytes] | None = None
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token[0] == 0x22:  # '"'
            if depth == 1:
                string = token
        elif token == b":":
            if depth == 1:
                key = string
        elif token == b",":
            if depth == 1:
                key = None
            elif depth == 2 and spans is not None:
                spans.append(raw[start : match.start()].strip())
                start = match.end()
        elif token in (b"{", b"["):
            if depth == 1 and token == b"[" and key is not None and _is_input_key(key):
                spans, start = [], match.end()
            depth += 1
        else:  # } or ]
            depth -= 1
            if depth == 1 and spans is not None:
                last = raw[start : match.start()].strip()
                if last:
                    spans.append(last)
                result, spans = spans, None
    return result


def _is_input_key(key: bytes) -> bool:
    return key == b'"input"' or (b"\\" in key and orjson.loads(key) == "input")


def call_ids_of(items: Iterable[Any]) -> frozenset[str]:
    """Call ids of the tool calls among `items` (any call item, not the outputs)."""
    ids = set()
    for item in items:
        if isinstance(item, dict):
            call_id = item.get("call_id")
            kind = item.get("type")
            if isinstance(call_id, str) and isinstance(kind, str) and not kind.endswith("_output"):
                ids.add(call_id)
    return frozenset(ids)


def check_call_bindings(items: list[Any], record: Record) -> None:
    """CONTRACT.md C1.5: every tool output must answer a call in the expanded history."""
    seen_here: set[str] | None = None
    for index, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type") not in _OUTPUT_TYPES:
            continue
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise InvalidRequest(f"Missing or invalid 'call_id' in input[{index}].", param="input")
        if record.has_call_id(call_id):
            continue
        if seen_here is None:
            seen_here = set(call_ids_of(items))
        if call_id not in seen_here:
            raise InvalidRequest(
                f"No tool call found for function call output with call_id {call_id}.",
                param="input",
            )


def forwarded_members(body: dict[str, Any]) -> bytes:
    """The JSON object of the request's members that are forwarded as they are: all but
    `previous_response_id`, `conversation` and `input`."""
    return orjson.dumps({k: v for k, v in body.items() if k not in _STATE_FIELDS})


def expand(
    body: dict[str, Any], history: list[bytes], tail: list[bytes], members: bytes | None = None
) -> bytes:
    """The forwarded body: the request without `previous_response_id` or `conversation`,
    its input being the stored history followed by the request's own items (`tail`, one
    serialized item each). `members`: `forwarded_members(body)`, when at hand."""
    head = forwarded_members(body) if members is None else members
    opening = head[:-1] + (b',"input":[' if len(head) > 2 else b'"input":[')
    items = [*history, *tail]
    if not items:
        return opening + b"]}"
    # [opening, item, ",", item, ..., item, closing]: separators by slice, no Python loop.
    parts = [b","] * (2 * len(items) + 1)
    parts[1::2] = items
    parts[0], parts[-1] = opening, b"]}"
    return b"".join(parts)
