"""Helpers for the HTTP tests: raw JSON spans, SSE parsing, scripted Responses events
(the byte-scripted backend is tests/fakes/scripted.py)."""

from __future__ import annotations

import itertools
import json
import socket
from typing import Any

import orjson

_DECODER = json.JSONDecoder()


def top_level_span(body: bytes, key: str) -> bytes:
    """The raw bytes of a top-level key's value, found with the stdlib decoder (not the
    proxy's own scanner), so tests compare exactly what went over the wire."""
    text = body.decode()
    end = len(text)
    pos = text.index("{") + 1
    found: bytes | None = None
    while pos < end:
        while text[pos] in " \t\r\n,":
            pos += 1
        if text[pos] == "}":
            break
        name, pos = _DECODER.raw_decode(text, pos)
        while text[pos] in " \t\r\n:":
            pos += 1
        _, value_end = _DECODER.raw_decode(text, pos)
        if name == key:
            found = text[pos:value_end].encode()
        pos = value_end
    if found is None:
        raise KeyError(key)
    return found


def assert_append_only(bodies: list[bytes]) -> None:
    """Each forwarded `input` array is a byte prefix of the next one's (CONTRACT.md C1.2)."""
    spans = [top_level_span(body, "input") for body in bodies]
    for before, after in itertools.pairwise(spans):
        assert before.startswith(b"[") and before.endswith(b"]"), before
        assert after.startswith(before[:-1] + b","), (before, after)


def sse_payloads(raw: bytes) -> list[dict[str, Any]]:
    """JSON payloads of an SSE byte stream (any line ending), comments and [DONE] skipped."""
    text = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    payloads = []
    for block in text.split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if data and data != [b"[DONE]"]:
            payloads.append(orjson.loads(b"\n".join(data)))
    return payloads


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def response_object(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A Response as a spec-complete backend sends it: every member the schema requires
    (so the proxy has nothing to add to it)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    item = {
        "id": "msg_" + rid,
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [part],
    }
    return {
        "id": rid,
        "object": "response",
        "created_at": 1,
        "completed_at": 2 if status == "completed" else None,
        "status": status,
        "model": "scripted",
        "output": [item] if status != "in_progress" else [],
        "usage": None,
        **COMPLETE_ENVELOPE,
    }


COMPLETE_ENVELOPE: dict[str, Any] = {
    "error": None,
    "incomplete_details": None,
    "previous_response_id": None,
    "instructions": None,
    "tools": [],
    "tool_choice": "auto",
    "truncation": "disabled",
    "parallel_tool_calls": True,
    "text": {"format": {"type": "text"}},
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_logprobs": 0,
    "temperature": 1.0,
    "reasoning": {"effort": None, "summary": None},
    "max_output_tokens": None,
    "max_tool_calls": None,
    "store": True,
    "background": False,
    "service_tier": "default",
    "metadata": {},
    "safety_identifier": None,
    "prompt_cache_key": None,
}


def script_events(rid: str, text: str, *, spec: bool) -> list[dict[str, Any]]:
    """A text answer's events; `spec` adds sequence_number/output_index/content_index."""
    done = response_object(rid, text)
    item = done["output"][0]
    loc = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response_object(rid, "", "in_progress")},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        {"type": "response.content_part.added", **loc, "part": {"type": "output_text", "text": ""}},
        {"type": "response.output_text.delta", **loc, "delta": text, "obfuscation": "x"},
        {"type": "response.output_text.done", **loc, "text": text},
        {"type": "response.content_part.done", **loc, "part": item["content"][0]},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": done},
    ]
    for seq, event in enumerate(events):
        if spec:
            event["sequence_number"] = seq
        else:
            for key in ("output_index", "content_index"):
                event.pop(key, None)
    return events
