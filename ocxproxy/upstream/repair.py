"""Make an incomplete Responses SSE stream spec-complete (CONTRACT.md C1.7), and say a
Response cut short at `max_output_tokens` is `incomplete`. Pure, no I/O.

llama.cpp's events carry no `sequence_number`, `output_index` or `content_index`, and its
`response.created` holds a stub response; the official SDK's `responses.stream()` helper
indexes its snapshot by those fields and fails without them. Streams that already carry
`sequence_number` are never given to this class.

Each event is decoded here anyway, so the Responses it carries are completed by the
exchange's `Envelope` (continuation/envelope.py) and its items and parts as that module
wants them, before the one encoding.
"""

from __future__ import annotations

from typing import Any

import orjson

from ocxproxy.continuation.envelope import Envelope, complete_item, complete_part
from ocxproxy.upstream.sse import RESPONSE_EVENTS, TERMINAL_EVENTS, Event, encode_event

# Events addressed to one content part of one output item.
_CONTENT_EVENTS = frozenset(
    (
        "response.content_part.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_text.annotation.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    )
)
_TEXT_EVENTS = frozenset(("response.output_text.delta", "response.output_text.done"))
_ADDED = frozenset(("response.output_item.added", "response.output_item.done"))
_PARTS = frozenset(("response.content_part.added", "response.content_part.done"))


def cut_short(response: Any, limit: Any) -> bool:
    """Mark a Response its backend calls `completed` though its output took all of the
    request's `max_output_tokens` as OpenAI reports an answer cut there (see
    CONTRACT.md C1.10): `incomplete`, reason `max_output_tokens`, no `completed_at`, its
    last item `incomplete`. llama.cpp's Responses API says `completed` either way; an
    answer whose natural end falls on the budget's very last token is marked too, which
    usage alone cannot tell apart. True when it was changed (in place)."""
    if type(limit) is not int or type(response) is not dict:
        return False
    usage = response.get("usage")
    spent = usage.get("output_tokens") if type(usage) is dict else None
    if response.get("status") != "completed" or type(spent) is not int or spent < limit:
        return False
    response["status"] = "incomplete"
    response["incomplete_details"] = {"reason": "max_output_tokens"}
    if "completed_at" in response:
        response["completed_at"] = None
    output = response.get("output")
    last = output[-1] if type(output) is list and output else None
    if type(last) is dict and last.get("status") == "completed":
        last["status"] = "incomplete"
    return True


class StreamRepair:
    __slots__ = ("_envelope", "_item_index", "_next_output", "_parts", "_seq")

    def __init__(self, envelope: Envelope | None = None) -> None:
        self._seq = 0
        self._next_output = 0
        self._item_index: dict[str, int] = {}  # item id → output_index
        self._parts: dict[int, int] = {}  # output_index → content parts added
        self._envelope = envelope if envelope is not None else Envelope()

    def fix(self, event: Event) -> tuple[Event, Any]:
        """The event with the missing fields filled in, and its parsed payload."""
        try:
            payload = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            return event, None
        if not isinstance(payload, dict):
            return event, payload
        payload["sequence_number"] = self._seq
        self._seq += 1
        kind = payload.get("type")
        if kind in RESPONSE_EVENTS:
            response = payload.get("response")
            if isinstance(response, dict):  # its output items: once recorded (exchange.py)
                self._envelope.complete(response, final=kind in TERMINAL_EVENTS)
        elif isinstance(kind, str) and kind.startswith("response."):
            self._index(kind, payload)
            self._complete_content(kind, payload)
        data = orjson.dumps(payload)
        return Event(encode_event(event.name or kind, data), event.name or kind, data), payload

    def _index(self, kind: str, payload: dict[str, Any]) -> None:
        item = payload.get("item")
        item_id = payload.get("item_id")
        if item_id is None and isinstance(item, dict):
            item_id = item.get("id")
        if kind == "response.output_item.added":
            index = payload.setdefault("output_index", self._next_output)
            self._next_output = max(self._next_output, index + 1)
            if isinstance(item_id, str):
                self._item_index[item_id] = index
            return
        if "output_index" not in payload:
            payload["output_index"] = self._item_index.get(
                item_id if isinstance(item_id, str) else "", max(self._next_output - 1, 0)
            )
        output_index = payload["output_index"]
        if kind == "response.content_part.added":
            payload.setdefault("content_index", self._parts.get(output_index, 0))
            self._parts[output_index] = payload["content_index"] + 1
        elif kind in _CONTENT_EVENTS:
            payload.setdefault("content_index", max(self._parts.get(output_index, 1) - 1, 0))
        if kind in _TEXT_EVENTS:
            payload.setdefault("logprobs", [])

    @staticmethod
    def _complete_content(kind: str, payload: dict[str, Any]) -> None:
        item, part = payload.get("item"), payload.get("part")
        if kind in _ADDED and isinstance(item, dict):
            done = kind == "response.output_item.done"
            complete_item(item, "completed" if done else "in_progress")
        elif kind in _PARTS and isinstance(part, dict):
            complete_part(part)
